"""What a command shows on the console: a quiet TensorFlow start-up, and whether a
person watches the stream (a live bar) or it goes to a log (plain lines).

In data/ so that data.make_tfrecords can use it without importing trainer/; the
trainer's commands use it through trainer/cli.py and trainer/output/progress_bar.py.
Imports nothing heavy: it runs before TensorFlow is imported.
"""
import contextlib
import os
import sys
from typing import IO, Iterator


def wants_all_logs(argv: list[str]) -> bool:
    """--verbosity=1 (or -v 1, or more) on the command line: show every library log."""
    for i, arg in enumerate(argv):
        for name in ("--verbosity", "-v"):
            value = (arg[len(name) + 1:] if arg.startswith(name + "=") else
                     argv[i + 1] if arg == name and i + 1 < len(argv) else None)
            if value is not None:
                try:
                    return int(value) >= 1
                except ValueError:
                    return False
    return False


def set_native_log_level(argv: list[str]) -> None:
    """Call before TensorFlow is imported: its C++ warnings (a cache "not fully
    read" at every evaluation, "GeneratorDatasetOp will not be optimized" every
    epoch) only with --verbosity=1; errors always. TensorFlow's start-up lines
    (oneDNN notice, CUDA probing on a machine without GPUs), which no log level
    hides, are dropped by importing it with the native stderr muted."""
    verbose = wants_all_logs(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    if verbose or "tensorflow" in sys.modules:
        return
    with native_stderr_muted():
        import tensorflow as tf
        tf.config.list_physical_devices()  # the device probing prints here


@contextlib.contextmanager
def native_stderr_muted(unless_verbose: bool = False) -> Iterator[None]:
    """The process's native stderr (file descriptor 2: C++ lines, which no log level
    hides) to /dev/null for the block. unless_verbose: not when TF_CPP_MIN_LOG_LEVEL
    is 0 (--verbosity=1)."""
    if unless_verbose and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") == "0":
        yield
        return
    sys.stderr.flush()
    saved, muted = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(muted, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(muted)


def is_live_terminal(stream: IO) -> bool:
    """A bar only where a person watches: a TTY that is not a dumb terminal or CI."""
    try:
        tty = os.isatty(terminal_fd(stream))
    except (AttributeError, OSError, ValueError):  # no fd (a test's StringIO)
        tty = hasattr(stream, "isatty") and stream.isatty()
    return tty and os.environ.get("TERM") != "dumb" and not os.environ.get("CI")


# The real terminal while trainer/output/console.py filters fd 2 (a pipe then).
_terminal_fd: int | None = None


def set_terminal(fd: int | None) -> None:
    """fd 2's terminal is `fd` (None: fd 2 itself again): is_live_terminal and
    terminal_fd ask it."""
    global _terminal_fd
    _terminal_fd = fd


def terminal_fd(stream: IO) -> int:
    """The fd whose terminal `stream` ends on (fd 2's real one while filtered)."""
    fd = stream.fileno()
    return _terminal_fd if fd == 2 and _terminal_fd is not None else fd
