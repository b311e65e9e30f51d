"""The README's front page stays true: the line counts of "The path of a step"
are the files' own (a stale count is a failing test, not a quiet lie)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path: str) -> int:
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def test_the_readmes_line_counts_are_the_files():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    counted = re.findall(r"\[`(trainer/[\w/]+\.py)`\]\([^)]*\) \((\d+)\)", readme)
    assert len(counted) >= 8, counted
    for path, count in counted:
        assert int(count) == _lines(path), f"README.md says {path} has {count} lines"
    tasks = re.search(r"\[`trainer/tasks/`\]\(trainer/tasks/\) \(([^)]*)\)", readme).group(1)
    for name, count in re.findall(r"(\w+) (\d+)", tasks):
        assert int(count) == _lines(f"trainer/tasks/{name}.py"), f"tasks/{name}.py"
