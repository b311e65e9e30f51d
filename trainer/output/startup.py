"""What a run does before its first step, phase by phase: a line at least every
HEARTBEAT seconds while a phase runs (building a large model, filling the cache,
tracing, compiling: no one waits in silence), and the time each phase took, in
the line that reports the first steps."""
import contextlib
import threading
import time
from typing import Callable, Iterator

from absl import logging

import trainer

HEARTBEAT = 10.0  # seconds: the longest a phase runs without a line


class StartUp:
    """`with start_up.phase("building the run"): ...` around each phase;
    `start_up.describe()` lists them with their seconds."""

    def __init__(self, heartbeat: float = HEARTBEAT):
        self.heartbeat = heartbeat
        self.started = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase `name`; while it runs, a line every
        `heartbeat` seconds says what it is doing and for how long."""
        start = time.perf_counter()
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat):
                logging.info("... %s (%.0f s so far)", name, time.perf_counter() - start)

        # (a daemon: a block left by an exception cannot keep the process alive)
        thread = threading.Thread(target=beat, name="start-up heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.phases.append((name, time.perf_counter() - start))

    def first_call(self, first: bool, trace: Callable[[], object], start: int, stop: int,
                   xla: bool) -> contextlib.AbstractContextManager:
        """Around a training loop's call: the first one (`first`) is start-up's
        last phases, the trace (`trace()` traces the loop function without running
        it) and the call itself (the graph optimized or compiled with XLA, the
        first batch, steps start+1 to stop). Other calls: nothing."""
        if not first:
            return contextlib.nullcontext()
        logging.info("Tracing the step; the first steps follow")
        with self.phase("tracing the step"):
            trace()
        work = "compiling with XLA" if xla else "optimizing the graph"
        return self.phase(f"the first call ({work}, steps {start + 1}-{stop})")

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds (a phase run twice: its total)."""
        totals: dict[str, float] = {}
        for name, seconds in self.phases:
            totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def since_command(self) -> float:
        """Seconds since the command started (process_age), at least since this
        object was made."""
        return max(time.perf_counter() - self.started, process_age())

    def describe(self) -> str:
        """'loading Python and TensorFlow 9.8 s, setting up the devices 0.1 s, ...,
        the rest 0.4 s': from the command's start."""
        here = time.perf_counter() - self.started
        totals = self.seconds()
        other = here - sum(totals.values())
        before = self.since_command() - here
        return ", ".join([*([f"loading Python and TensorFlow {before:.1f} s"]
                            if before > 0 else []),
                          *(f"{name} {seconds:.1f} s" for name, seconds in totals.items()),
                          f"the rest {max(0.0, other):.1f} s"])


def process_age() -> float:
    """Seconds since the command started: since the trainer package was first
    imported, before TensorFlow (the interpreter's own start, tens of ms, aside)."""
    return time.perf_counter() - trainer.STARTED_AT
