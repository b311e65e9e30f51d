"""What the serving and tools commands share on the command line (absl flags).

Each command declares its flags in `define_flags()`, called from its
`if __name__ == "__main__":` (and by tests), never at import time: absl flags are
global per process, and trainer.main's flags (one per trainer.config.Config field)
share names such as --model_dir with them.
"""
import logging as std_logging
import os
import sys
from typing import Any, Callable

from absl import flags, logging

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

# Flags defined through `define` belong to the command calling it (--helpshort,
# and --helpfull's grouping by module), not to this module.
flags.disclaim_key_flags()


def define(flag_values: flags.FlagValues, definer: Callable, name: str, default: Any,
           help: str, **kwargs: Any) -> bool:  # noqa: A002 (absl's word for it)
    """Defines one flag unless `flag_values` has one of that name (a command's
    define_flags run twice, or beside trainer.main's in one test process, reuses
    it). Returns whether it defined the flag."""
    if name in flag_values:
        return False
    definer(name, default, help=help, flag_values=flag_values, **kwargs)
    return True


def parse_flags(argv: list[str]) -> list[str]:
    """`app.run`'s flags_parser for these commands, whose output is what they print:
    - absl's parsing, but an unknown, malformed or missing required flag is one
      `error: ...` line on stderr and exit status 2, like every other user error;
    - library logs (e.g. TF's SavedModel writer at INFO) only from WARNING unless
      --verbosity is given, each record once (TF's own stderr handler would repeat
      what absl's prints).
    Returns the arguments left after the flags."""
    try:
        argv = flags.FLAGS(argv)
    except flags.Error as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("tensorflow").handlers.clear()
    return argv
