"""A training command's terminal: short lines that fit it, TensorFlow's native
noise kept off it, and every line in the run directory's log file.

`start()` puts trainer/output/terminal_filter.py between the command and its stderr:
everything written to fd 2 (Python's lines and TensorFlow's C++ ones) goes
through that small process, which shortens and wraps our lines on a terminal, keeps
TensorFlow's native lines off it (`--verbosity=1`: on it) and writes every line,
in absl's full format, to the log file `log_to(path)` names. It is a process of
its own, not a thread: a crash's last lines (a fatal TensorFlow check, a
traceback) are in the pipe and still reach the terminal after the command is
gone. `stop()` closes the pipe and waits for the filter to finish writing.
"""
import atexit
import os
import subprocess
import sys

from data import quiet
from trainer.output import terminal_filter

LOG_FILE = "log.txt"  # in the run directory; another worker's: log-worker1.txt, ...

_filter: subprocess.Popen | None = None
_saved_stderr: int | None = None


def log_file_name(strategy) -> str:
    """The run directory's log file of this process: the chief's LOG_FILE, another
    worker's log-{task type}{task id}.txt."""
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    if not task_type:
        return LOG_FILE
    task_id = resolver.task_id or 0
    jobs = resolver.cluster_spec().as_dict()
    if task_type == "chief" or (task_type == "worker" and task_id == 0
                                and "chief" not in jobs):
        return LOG_FILE
    return f"log-{task_type}{task_id}.txt"


def is_log_file(name: str) -> bool:
    """A run's log file's name (trainer/run_dir.py: one of a run's own files)."""
    return name == LOG_FILE or (name.startswith("log-") and name.endswith(".txt"))


def start(verbose: bool) -> None:
    """From here on, fd 2 goes through the filter (once per process)."""
    global _filter, _saved_stderr
    if _filter is not None:
        return
    sys.stderr.flush()
    live = quiet.is_live_terminal(sys.stderr)
    saved = os.dup(2)
    try:
        _filter = subprocess.Popen(
            [sys.executable, terminal_filter.__file__,
             *(["--short"] if live else []), *(["--verbose"] if verbose else [])],
            stdin=subprocess.PIPE, stdout=saved, stderr=saved, close_fds=True,
            start_new_session=True)  # (Ctrl-C and a closed window: for the command)
    except OSError:
        os.close(saved)
        return  # no filter: the lines go to the terminal as they are
    _saved_stderr = saved
    if live:
        quiet.set_terminal(saved)  # the live bar's checks: the real terminal
    os.dup2(_filter.stdin.fileno(), 2)
    atexit.register(stop)  # (an exit without trainer.main's _leave: a traceback's)


def log_to(path: str) -> None:
    """The filter writes every line, those before too, to `path` (appended to what
    the file holds: a resumed run's log continues)."""
    if _filter is not None:
        sys.stderr.flush()
        os.write(2, terminal_filter.CONTROL + b"LOG " + path.encode() + b"\n")


def stop(timeout: float = 10.0) -> None:
    """Gives fd 2 back to the terminal and waits (at most `timeout` s) for the
    filter to write its last lines and the log file."""
    global _filter, _saved_stderr
    if _filter is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(_saved_stderr, 2)
    quiet.set_terminal(None)
    _filter.stdin.close()
    try:
        _filter.wait(timeout)
    except subprocess.TimeoutExpired:  # (a child process holds the pipe open)
        pass
    os.close(_saved_stderr)
    _filter = _saved_stderr = None
