"""What every command does about logs before and after parsing its flags: a
quiet TensorFlow start-up and a quiet default log (`--verbosity=1` shows all).
The flags themselves are parsed by each command (helpers in trainer/main.py)."""
import logging as std_logging
import os
import sys
from absl import logging

_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_PROJECT, package) + os.sep
              for package in ("trainer", "data", "models"))


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
    saved, muted = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(muted, 2)
    try:
        import tensorflow as tf
        tf.config.list_physical_devices()  # the device probing prints here
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(muted)


class _QuietFilter(std_logging.Filter):
    """Our own records, and other libraries' warnings and errors; not their INFO
    lines (TFDS's "Load dataset info" at every evaluation, TF's "Sharding callback
    duration" at every checkpoint)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or record.pathname.startswith(_OURS)


def quiet_library_logs(verbosity: int) -> None:
    """The default log: our lines and the warnings that mean something. A command's
    --verbosity=1 brings everything back."""
    if verbosity >= 1:
        return
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _QuietFilter) for f in handler.filters):
        handler.addFilter(_QuietFilter())
