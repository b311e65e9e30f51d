"""Faults a run survives: preemption (SIGTERM) and a non-finite loss.

Preemption: a command installs the SIGTERM watcher right after its flags are
parsed. Before training starts a SIGTERM stops the process at once
(StoppedAtStartUp; every file a run writes is whole or absent, so nothing is
half-written) with PREEMPTED_EXIT_CODE. Once training has started it only sets a
flag: the loop notices it after the current in-graph loop returns, saves a
checkpoint of that step and exits with PREEMPTED_EXIT_CODE; the same command
resumes from there. With several workers the
flag is summed across workers inside the train loop, so every worker stops and
saves at the same step (a worker stopping alone would leave the others waiting in
a collective).
"""
import contextlib
import signal
import threading
from typing import Iterator

from absl import logging
import tensorflow as tf

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", the run resumes where it stopped


# What a surviving worker sees when a peer dies mid-collective.
PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                 tf.errors.CancelledError, tf.errors.AbortedError,
                 tf.errors.InternalError)


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint of the current step was saved."""


class StoppedAtStartUp(Exception):
    """SIGTERM before training started: the command stopped at once."""


class SigtermWatcher:
    """`with SigtermWatcher() as watcher:` right after a command's flags are parsed.

    Until `while_training()` a SIGTERM raises StoppedAtStartUp where the program
    is; from then on it only turns `watcher.requested` True. Installs the handler
    only in the main thread (signals cannot be caught elsewhere) and restores the
    previous handler on exit.
    """

    def __init__(self):
        self.requested = False
        self.training = False
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        del frame
        if not self.training:
            raise StoppedAtStartUp(f"signal {signum} during start-up, before any "
                                   f"training step; nothing was left half-written: "
                                   f"run the same command to start")
        if not self.requested:
            logging.warning("Signal %d: saving a checkpoint at the end of the current "
                            "loop, then exiting with status %d", signum,
                            PREEMPTED_EXIT_CODE)
        self.requested = True

    def __enter__(self) -> "SigtermWatcher":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    @contextlib.contextmanager
    def while_training(self) -> Iterator["SigtermWatcher"]:
        """From here a SIGTERM only sets `requested` (also after the block: the
        final outputs are written whole, then the command exits 75). Installs the
        handler for the block if no command did (the loop called directly)."""
        installed_here = not self._installed
        if installed_here:
            self.__enter__()
        self.training = True
        try:
            yield self
        finally:
            if installed_here:
                self.__exit__()
