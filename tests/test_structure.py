"""The structure figures of issue 44, kept true: no import circle among trainer/,
models/ and data/ (every import statement counts, also those inside functions), at
most 2 project imports inside functions, at most 12 functions taking the whole
run `config`, `train_and_evaluate` at most 188 lines (issue 44's 180, and issue
53's start-up phases: each block before the first step is a named, timed phase
with a line every 10 s, `with start_up.phase("restoring"):`), `Task` at most 22 public
members (issue 44's 20, and issue 45's two new contracts: `train_steps`, several
steps on a schedule, and `streams`, several input streams), a step setting named on at most 3 lines. Read from the source alone (as
`python3 ../shared/tools/structure.py .` does): nothing is imported."""
import ast
import os
import subprocess
import sys

from test_main import ROOT

PACKAGES = ("trainer", "models", "data")


def _modules() -> dict[str, tuple[str, ast.Module, str]]:
    """module name -> (path, syntax tree, source) of every project module."""
    found = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    module = module.removesuffix(".__init__")
                    source = open(path, encoding="utf-8").read()
                    found[module] = (path, ast.parse(source), source)
    return found


MODULES = _modules()


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[ast.stmt, set[str]]]:
    """Each import statement of `module` and the project modules it names."""
    path, tree, _ = MODULES[module]
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        named = {_project_module(t) for t in targets} - {None, module}
        if named:
            found.append((node, named))
    return found


def _functions(module: str) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(MODULES[module][1])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_module_is_in_an_import_circle():
    edges = {m: set().union(*(named for _, named in _imports(m))) for m in MODULES}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen
    circles = sorted(m for m in MODULES if m in reaches(m))
    assert circles == [], f"modules in an import circle: {circles}"


def test_at_most_two_project_imports_inside_functions():
    deferred = []
    for module in MODULES:
        inner = {id(n) for f in _functions(module) for n in ast.walk(f)}
        deferred += [f"{module}:{node.lineno}" for node, _ in _imports(module)
                     if id(node) in inner]
    assert len(deferred) <= 2, deferred


def test_the_whole_config_reaches_at_most_twelve_functions():
    taking = [f"{module}.{f.name}" for module in MODULES for f in _functions(module)
              if any(a.arg == "config" for a in f.args.args + f.args.kwonlyargs)]
    assert len(taking) <= 12, taking


def test_the_loop_reads_in_at_most_188_lines_and_the_task_contract_has_22_members():
    loop = max(f.end_lineno - f.lineno + 1 for f in _functions("trainer.loop"))
    assert loop <= 188
    task = next(node for node in MODULES["trainer.tasks.base"][1].body
                if isinstance(node, ast.ClassDef) and node.name == "Task")
    members = set()
    for node in task.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
        elif isinstance(node, ast.Assign):
            members.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    public = sorted(m for m in members if not m.startswith("_"))
    assert len(public) <= 22, public


def test_a_step_setting_is_named_on_three_lines_its_field_and_its_use():
    lines = [f"{module}:{number}" for module, (_, _, source) in MODULES.items()
             for number, line in enumerate(source.splitlines(), 1)
             if "clip_grad_norm" in line]
    assert len(lines) <= 3, lines


def test_the_config_imports_no_registry_of_tasks_or_callbacks():
    # (A task or callback file may then import any trainer module at its top.)
    probe = ("import sys, trainer.config; print(sorted(m for m in sys.modules if "
             "m.startswith(('trainer.tasks', 'trainer.callbacks', 'trainer.recipes'))))")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, text=True,
                           capture_output=True, env=dict(os.environ,
                                                         TF_CPP_MIN_LOG_LEVEL="3"))
    assert shown.returncode == 0, shown.stderr[-1000:]
    assert shown.stdout.strip() == "[]"
