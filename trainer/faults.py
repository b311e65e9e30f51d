"""Faults a run survives: a stop signal (preemption, Ctrl-C, a closed terminal) and
a non-finite loss.

A stop signal (SIGTERM, SIGINT, SIGHUP): a command installs the watcher right after
its flags are parsed. Before training starts the signal stops the process at once
(StoppedAtStartUp, a BaseException like KeyboardInterrupt, so that no library's
`except Exception` swallows it; every file a run writes is whole or absent, so
nothing is half-written) with STOPPED_EXIT_CODE. Once training has started it only
sets a flag: the loop notices it after the current in-graph loop (or evaluation
chunk) returns, saves a checkpoint of that step and exits with STOPPED_EXIT_CODE;
the same command resumes from there. A second signal stops at once (the last
checkpoint is kept). With several workers the flag is summed across workers inside
the train loop, so every worker stops and saves at the same step (a worker stopping
alone would leave the others waiting in a collective).
"""
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from absl import logging
import tensorflow as tf

from trainer import cli

# EX_TEMPFAIL: "try again", the run resumes where it stopped (after SIGTERM, SIGINT
# and SIGHUP alike: a checkpoint of the current step was saved). Defined in cli,
# which handles them while TensorFlow loads (before this module is imported).
STOPPED_EXIT_CODE, STOP_SIGNALS = cli.STOPPED_EXIT_CODE, cli.STOP_SIGNALS


# What a surviving worker sees when a peer dies mid-collective.
PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                 tf.errors.CancelledError, tf.errors.AbortedError,
                 tf.errors.InternalError)


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def diverged(what: str, last_checkpoint: str | None, advice: str
             ) -> TrainingDivergedError:
    """The error of a run that diverged: what happened, which checkpoint is kept
    (none was saved yet: the run's start is), and what to try."""
    kept = (f"the last good checkpoint, {last_checkpoint}, is kept" if last_checkpoint
            else "no checkpoint was saved before it (a rerun starts from step 0)")
    return TrainingDivergedError(f"{what}; stopped without saving: {kept} ({advice})")


def check_steps(nonfinite_at: int, skipped: int, on_nan: str, first: int, last: int,
                state, last_checkpoint: str | None) -> None:
    """TrainingDivergedError if steps `first`..`last` left a weight non-finite
    (`nonfinite_at`: the step; no copy undoes it: stop before anything is saved),
    or skipped `skipped` updates for a non-finite loss or gradient under
    --on_nan=stop; the step counter must have advanced once a step."""
    if nonfinite_at:
        raise diverged(f"step {nonfinite_at} left a weight non-finite "
                       f"({', '.join(state.nonfinite()[:3])})", last_checkpoint,
                       "lower the learning rate, or check the step's arithmetic")
    if skipped and on_nan == "stop":
        raise diverged(f"non-finite loss or gradient at {skipped} step(s) in steps "
                       f"{first}-{last} (those updates were not applied)",
                       last_checkpoint, "lower the learning rate, or pass "
                       "--on_nan=skip_step")
    counted = int(state.step.numpy())
    if counted != last:
        raise RuntimeError(f"the step counter must advance once per step, by the "
                           f"wrapper alone (at step {last} it is {counted}): a task's "
                           f"step must not assign state.step")


class Preempted(RuntimeError):
    """A stop signal arrived; a checkpoint of the current step was saved."""


class StoppedAtStartUp(BaseException):
    """A stop signal before training started: the command stopped at once. A
    BaseException, as KeyboardInterrupt: code that catches Exception (AutoGraph's
    conversion fallback, a library's retry) must not swallow it."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """`with StopSignals() as stop:` right after a command's flags are parsed.

    Until `while_training()` a stop signal raises StoppedAtStartUp where the
    program is; from then on it only turns `stop.requested` True (and
    `stop.signal` names it); a second one exits at once (128 + its number).
    Installs the handlers only in the main thread (signals cannot be caught
    elsewhere) and restores the previous ones on exit.
    """

    def __init__(self):
        self.requested = False
        self.signal = ""
        self.training = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        del frame
        name = signal_name(signum)
        if not self.training:
            raise StoppedAtStartUp(f"{name} during start-up, before any training step; "
                                   f"nothing was left half-written: run the same "
                                   f"command to start")
        if self.requested:  # the second: now, without waiting for the save
            print(f"stopped: a second {name}: stopped at once; the last checkpoint in "
                  f"the run directory is kept (rerun the same command to resume)",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        logging.warning("%s: saving a checkpoint at the end of the current loop, then "
                        "exiting with status %d (again to stop at once)", name,
                        STOPPED_EXIT_CODE)
        self.requested, self.signal = True, name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def poll(self, alone: bool) -> Callable[[], bool]:
        """What an evaluation asks between its steps: whether to stop now. Only a
        worker that can stop `alone`: one of several cannot (the others would wait
        in a collective; they stop together at the end of the loop)."""
        return (lambda: self.requested) if alone else (lambda: False)

    @contextlib.contextmanager
    def while_training(self) -> Iterator["StopSignals"]:
        """From here a stop signal only sets `requested` (also after the block: the
        final outputs are written whole, then the command exits 75). Installs the
        handlers for the block if no command did (the loop called directly)."""
        installed_here = not self._previous
        if installed_here:
            self.__enter__()
        elif threading.current_thread() is threading.main_thread():
            # Again: a multi-worker strategy's coordination service installs its own
            # SIGTERM handler (in C++, unseen by signal.getsignal) as it starts, and
            # SIGTERM to a worker was then ignored (the run trained on to its end).
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handle)
        self.training = True
        try:
            yield self
        finally:
            if installed_here:
                self.__exit__()
