"""Faults a run survives: preemption (SIGTERM) and a non-finite loss.

Preemption: SIGTERM only sets a flag. The loop notices it after the current
in-graph loop returns, saves a checkpoint of that step and exits with
PREEMPTED_EXIT_CODE; the same command resumes from there. With several workers the
flag is summed across workers inside the train loop, so every worker stops and
saves at the same step (a worker stopping alone would leave the others waiting in
a collective).
"""
import signal
import threading

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


class SigtermWatcher:
    """`with SigtermWatcher() as watcher:` ... `watcher.requested` turns True on SIGTERM.

    Installs the handler only in the main thread (signals cannot be caught
    elsewhere) and restores the previous handler on exit.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        del frame
        if not self.requested:
            logging.warning("Signal %d: saving a checkpoint at the end of the current "
                            "loop, then exiting with status %d", signum,
                            PREEMPTED_EXIT_CODE)
        self.requested = True

    def __enter__(self) -> "SigtermWatcher":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
