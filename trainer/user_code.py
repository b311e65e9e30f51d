"""Code of your own, outside this project: models, tasks and callbacks in a package
of yours, brought in by `--import=MODULE[,MODULE]` or by an entry point of your
installed package, for every command (training, check_step, evaluate, predict,
export, the benchmark, lr_find).

- `--import=my_research.models,my_research.tasks`: each module is imported before
  the command defines its flags (so a task of yours has its settings as flags);
  its folder must be importable (the current directory is, with `python -m`; else
  PYTHONPATH or `pip install -e` your package). The run records the modules in
  run_config.json ("imports"): evaluate, predict and export on the run import them
  themselves, without --import.
- An entry point of your package, in its pyproject.toml:
      [project.entry-points."tfloop.plugins"]
      my_research = "my_research.register"
  is imported by every command, once the package is installed.

Modules register with `models.register_keras(...)` / `@models.register`,
`@tasks.register` (trainer/tasks/base.py) and `@trainer.callbacks.register`.
"""
import importlib
import importlib.metadata
import sys

import trainer

# The import names this project's distribution installs (trainer/__init__.py).
OWN_NAMES = ("trainer", *trainer.OWN_PACKAGES)
OWN_ROOT = trainer.PACKAGES_ROOT  # (the folder holding all three)

ENTRY_POINT_GROUP = "tfloop.plugins"
FLAG = "import"  # --import (the Config field is `imports`: `import` is a keyword)


class UserCodeError(ValueError):
    """A module of the user's could not be imported; the message says which and why."""


def names_of(text: str) -> tuple[str, ...]:
    """'a.b, c' -> ('a.b', 'c')."""
    return tuple(filter(None, (part.strip() for part in (text or "").split(","))))


def import_modules(text: str) -> tuple[str, ...]:
    """Imports the modules 'MODULE[,MODULE]' (those imported already are not run
    again); returns their names. UserCodeError, one line, if one cannot be."""
    for name in names_of(text):
        if name in OWN_NAMES:  # (already imported: the framework's own, not theirs)
            raise UserCodeError(f"--{FLAG}={name}: `{name}` is the framework's own "
                                f"package, imported from {OWN_ROOT} wherever the "
                                f"command runs; give your module another name "
                                f"(e.g. my_{name}) and import that")
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            where = ("" if err.name != name.split(".")[0] else
                     " (is its folder the current directory, on PYTHONPATH, or "
                     "the package installed?)")
            raise UserCodeError(f"--{FLAG}={name}: no module named {err.name!r}"
                                f"{where}") from err
        except Exception as err:  # their code: say where it failed, in one line
            raise UserCodeError(f"--{FLAG}={name} failed: {type(err).__name__}: "
                                f"{str(err).splitlines()[0][:300] if str(err) else ''}"
                                ) from err
    return names_of(text)


def import_entry_points() -> tuple[str, ...]:
    """Imports the modules installed packages declare as "tfloop.plugins" entry
    points; returns their names."""
    loaded = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        import_modules(point.value.split(":")[0])
        loaded.append(point.value)
    return tuple(loaded)


def modules_in_argv(argv: list[str]) -> str:
    """The value of --import in a command line ('--import=a,b' or '--import a,b';
    the last one given wins, as absl's parsing would have it)."""
    value = ""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{FLAG}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{FLAG}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def import_for_command(argv: list[str]) -> None:
    """What a command does first, before it defines its flags: the installed
    entry points, then --import's modules. A module that cannot be imported is
    one `error:` line and exit status 2."""
    try:
        import_entry_points()
        import_modules(modules_in_argv(argv))
    except UserCodeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
