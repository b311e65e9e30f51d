"""Faults a run survives: a stop signal (preemption, Ctrl-C, a closed terminal) and
a non-finite loss.

A stop signal (SIGTERM, SIGINT, SIGHUP): a command installs the watcher right after
its flags are parsed (before that, trainer/cli.py's start-up handlers answer).
Before training starts the signal stops the process at once (StoppedAtStartUp, a
BaseException like KeyboardInterrupt, so that no library's `except Exception`
swallows it; every file a run writes is whole or absent, so nothing is
half-written) with STOPPED_EXIT_CODE. Once training has started it only asks the
run to stop, and is answered at once, whatever the main thread is doing: a thread
woken by the signal itself (signal.set_wakeup_fd; Python's own handlers wait until
TensorFlow returns to the interpreter, minutes on a slow step loop) prints one line
saying what will happen and sets `flag`, a variable the in-graph loop reads before
every step (trainer/distributed.py): the loop ends at the next step boundary, the
run saves a checkpoint of that step and exits with STOPPED_EXIT_CODE; the same
command resumes from there. A second signal stops at once (the last checkpoint is
kept). With several workers the flag is summed across workers before every step,
so every worker stops and saves at the same step (a worker stopping alone would
leave the others waiting in a collective).
"""
import contextlib
import os
import re
import signal
import sys
import threading
import time
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


def lost_peer(error: Exception) -> str:
    """What a surviving worker says of a peer failure: the worker that stopped
    sending heartbeats (the coordination service names it), else the error."""
    text = str(error)
    tasks = sorted(set(re.findall(r"/job:\w+/replica:\d+/task:(\d+)", text)))
    if "stopped sending heartbeats" in text and tasks:
        return (f"worker {', '.join(tasks)} stopped answering (no heartbeat for "
                f"--worker_timeout seconds: paused, or its machine is gone)")
    first = text.splitlines()[0][:200] if text else ""
    return f"lost another worker ({type(error).__name__}: {first})"


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
                state, last_checkpoint: str | None, counted: int | None = None) -> None:
    """TrainingDivergedError if steps `first`..`last` left a weight non-finite
    (`nonfinite_at`: the step; no copy undoes it: stop before anything is saved),
    or skipped `skipped` updates for a non-finite loss or gradient under
    --on_nan=stop; the step counter (`counted`, as the loop call returned it; None:
    read from the state) must have advanced once a step."""
    if nonfinite_at:
        raise diverged(f"step {nonfinite_at} left a weight non-finite "
                       f"({', '.join(state.nonfinite()[:3])})", last_checkpoint,
                       "lower the learning rate, or check the step's arithmetic")
    if skipped and on_nan == "stop":
        raise diverged(f"non-finite loss or gradient at {skipped} step(s) in steps "
                       f"{first}-{last} (those updates were not applied)",
                       last_checkpoint, "lower the learning rate, or pass "
                       "--on_nan=skip_step")
    if counted is None:
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
    `stop.signal` names it) and sets `stop.flag` to 1, at once (see the module's
    docstring); a second one exits at once (128 + its number). Installs the
    handlers only in the main thread (signals cannot be caught elsewhere) and
    restores the previous ones on exit.
    """

    def __init__(self):
        self.requested = False
        self.signal = ""
        self.training = False
        self.at_step: Callable[[], int] | None = None
        self._previous: dict[int, object] = {}
        self._flag: tf.Variable | None = None
        self._lock = threading.Lock()
        self._received = 0
        self._wakeup: tuple[int, int] | None = None  # (read end, write end)
        self.signals_seen = 0  # by the watcher thread
        self._maintenance: MaintenanceWatcher | None = None
        self._previous_wakeup = -1
        self.stopped_at_start_up: StoppedAtStartUp | None = None

    @property
    def flag(self) -> tf.Variable:
        """The stop request as the in-graph loop reads it (1.0: stop), on the host."""
        if self._flag is None:
            with tf.init_scope(), tf.device("/cpu:0"):
                flag = tf.Variable(0.0, trainable=False, name="stop_requested")
            self._flag = flag
            if self.requested:  # (asked before the flag was there)
                flag.assign(1.0)
        return self._flag

    def _handle(self, signum, frame) -> None:
        """Python's handler, in the main thread once it runs bytecode again."""
        del frame
        if not self.training:
            # Kept: raised where the program is, it may land inside C code that turns
            # it into a SystemError (seen in TensorFlow's tracing), or in a library's
            # `except Exception`; __exit__ and while_training raise it again.
            self.stopped_at_start_up = StoppedAtStartUp(
                f"{signal_name(signum)} during start-up, before any training step; "
                f"nothing was left half-written: run the same command to start")
            raise self.stopped_at_start_up
        if self._wakeup is None:  # (no watcher thread: answer here)
            self._stop_requested(signum)

    def _stop_requested(self, signum: int) -> None:
        """A stop signal in training: the first asks the run to stop (one line, the
        flag set); the second stops the process at once."""
        name = signal_name(signum)
        with self._lock:
            self._received += 1
            second = self._received > 1
        if second:  # now, without waiting for the save
            print(f"stopped: a second {name}: stopped at once; the last checkpoint in "
                  f"the run directory is kept (rerun the same command to resume)",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.request_stop(name, again=" (again to stop at once)")

    def request_stop(self, why: str, again: str = "") -> None:
        """Asks the run to stop after the current step, as a first stop signal does
        (`why`: what asked, e.g. a VM's maintenance notice); once."""
        with self._lock:
            if self.requested:
                return
            self.requested, self.signal = True, why
        at = f" (the run is past step {self.at_step()})" if self.at_step else ""
        logging.warning("%s: stopping after the current step%s: a checkpoint of it will "
                        "be saved, then exit status %d%s", why, at, STOPPED_EXIT_CODE,
                        again)
        if self._flag is not None:
            self._flag.assign(1.0)

    def _watch(self, read_end: int) -> None:
        """The watcher thread: each signal number the C-level handler writes, read
        as it arrives (the main thread may be inside TensorFlow for minutes)."""
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                data = b""
            if not data:  # (__exit__ closed the write end)
                os.close(read_end)
                return
            for signum in data:
                # (before training the main thread's handler answers: a signal
                # then stops the program)
                if self.training and signum in STOP_SIGNALS:
                    self._stop_requested(signum)
                self.signals_seen += 1

    def _install(self) -> None:
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        if self._wakeup is None:
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)  # (the C handler must never block)
            try:
                self._previous_wakeup = signal.set_wakeup_fd(write_end,
                                                             warn_on_full_buffer=False)
            except ValueError:  # (not the main thread, after all)
                os.close(read_end)
                os.close(write_end)
                return
            self._wakeup = read_end, write_end
            threading.Thread(target=self._watch, args=(read_end,), daemon=True,
                             name="stop-signals").start()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._install()
        return self

    def __exit__(self, exc_type=None, exc=None, traceback=None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if isinstance(exc, Exception) and self.stopped_at_start_up is not None:
            # (the signal's exception, mangled by the code it landed in)
            raise self.stopped_at_start_up from exc
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            write_end = self._wakeup[1]
            self._wakeup = None
            os.close(write_end)  # (the watcher's read ends: it closes its end)

    def poll(self, alone: bool) -> Callable[[], bool]:
        """What an evaluation asks between its steps: whether to stop now. Only a
        worker that can stop `alone`: one of several cannot (the others would wait
        in a collective; they stop together at the end of the loop)."""
        return (lambda: self.requested) if alone else (lambda: False)

    @contextlib.contextmanager
    def while_training(self, at_step: Callable[[], int] | None = None
                       ) -> Iterator["StopSignals"]:
        """From here a stop signal only sets `requested` (also after the block: the
        final outputs are written whole, then the command exits 75). Installs the
        handlers for the block if no command did (the loop called directly).
        at_step: the run's step, as the line that answers a signal names it."""
        if self.stopped_at_start_up is not None:  # (swallowed on its way: again)
            raise self.stopped_at_start_up
        self.at_step = at_step
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
        if self._maintenance is None and on_google_cloud():
            self._maintenance = MaintenanceWatcher(self.request_stop)
            self._maintenance.start()
        try:
            yield self
        finally:
            if installed_here:
                self.__exit__()


# A Google Cloud VM's own notices, from its metadata server: a host maintenance that
# will stop it (Compute Engine and TPU VMs), and a Spot/preemptible VM's
# preemption. The server's address is METADATA_HOST_ENV's, as TensorFlow's own GCE
# termination watcher reads it (tests point it at a stand-in on 127.0.0.1).
METADATA_HOST_ENV = "GCE_METADATA_IP"
NOTICES = {"instance/maintenance-event": lambda value: value.startswith("TERMINATE"),
           "instance/preempted": lambda value: value.strip().upper() == "TRUE"}


def on_google_cloud() -> bool:
    """Whether this is a Google Cloud VM (or a metadata server is named): its
    DMI product name, read locally (no network off Google Cloud)."""
    if os.environ.get(METADATA_HOST_ENV):
        return True
    try:
        with tf.io.gfile.GFile("/sys/class/dmi/id/product_name") as f:
            return "Google" in f.read()
    except (OSError, tf.errors.OpError):
        return False


class MaintenanceWatcher:
    """One daemon thread per notice in NOTICES: waits on the metadata server for
    the value to change (`wait_for_change`, so one request a minute while nothing
    happens) and calls `on_notice(why)` once one says the VM will stop. A server
    that does not answer is asked again every 10 s; nothing here blocks the run."""

    def __init__(self, on_notice: Callable[[str], None], host: str | None = None):
        self.on_notice = on_notice
        self.host = host or os.environ.get(METADATA_HOST_ENV) or "metadata.google.internal"
        self.noticed = threading.Event()

    def start(self) -> None:
        for key in NOTICES:
            threading.Thread(target=self._watch, args=(key,), daemon=True,
                             name=f"watch {key}").start()
        logging.info("Watching this VM's maintenance and preemption notices (%s)",
                     self.host)

    def _get(self, key: str, etag: str | None) -> tuple[str, str | None]:
        import urllib.request
        url = f"http://{self.host}/computeMetadata/v1/{key}"
        if etag:
            url += f"?wait_for_change=true&timeout_sec=60&last_etag={etag}"
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=90) as response:
            return response.read().decode(errors="replace"), response.headers.get("ETag")

    def _watch(self, key: str) -> None:
        etag = None
        while not self.noticed.is_set():
            try:
                value, new_etag = self._get(key, etag)
            except Exception:  # noqa: BLE001 (no server, a timeout: ask again later)
                time.sleep(10)
                continue
            if NOTICES[key](value) and not self.noticed.is_set():
                self.noticed.set()
                self.on_notice(f"{key.split('/')[-1]} {value.strip()} (the VM's notice)")
                return
            if new_etag is None or new_etag == etag:
                time.sleep(1)  # (a server that does not wait for a change)
            etag = new_etag
