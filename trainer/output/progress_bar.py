"""The live progress bar on a terminal: one tqdm bar per epoch showing step, every
metric the step returns, learning rate, images/sec and the ETA of the epoch and of the whole run.

tqdm (already a dependency of tensorflow-datasets) handles terminal width, redraw
rate and the ETA arithmetic better than a hand-written bar would. Off a terminal
(a log file, CI) there is no bar: the loop logs one plain line every --log_every
steps instead (see reporting.Progress).
"""
import contextlib
import logging
from typing import IO

import tqdm

# In data/ so data.make_tfrecords shares it; the loop calls progress_bar.is_live_terminal.
from data.quiet import is_live_terminal  # noqa: F401


class EpochBars:
    """Opens a bar for each epoch as steps arrive; a finished epoch's bar stays on
    screen as that epoch's summary line."""

    def __init__(self, total_steps: int, steps_per_epoch: int, stream: IO):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.stream = stream
        self.num_epochs = -(-total_steps // steps_per_epoch)
        self._bar, self._epoch = None, -1

    def update(self, step: int, postfix: str) -> None:
        """Moves the bar to `step` (steps done in the run) and shows `postfix`."""
        epoch = (step - 1) // self.steps_per_epoch  # the epoch the last step was in
        if epoch != self._epoch:
            self.close()
            self._open(epoch)
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(step - epoch * self.steps_per_epoch - self._bar.n)

    def _open(self, epoch: int) -> None:
        first = epoch * self.steps_per_epoch
        self._epoch = epoch
        self._bar = tqdm.tqdm(
            total=min(self.steps_per_epoch, self.total_steps - first),
            initial=0, desc=f"epoch {epoch + 1}/{self.num_epochs}", unit="step",
            file=self.stream, dynamic_ncols=True, leave=True, mininterval=0.5,
            # The ETAs are ours (training time at this epoch's rate), in the postfix.
            bar_format="{desc} {n_fmt}/{total_fmt} |{bar:20}| {elapsed} {postfix}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @contextlib.contextmanager
    def above_the_bar(self):
        """Within the block, log records print above the bar instead of through it."""
        root = logging.getLogger()
        originals = list(root.handlers)
        root.handlers = [_AboveTheBar(handler, self) for handler in originals]
        try:
            yield self
        finally:
            root.handlers = originals
            self.close()


class _AboveTheBar(logging.Handler):
    """Clears the live bar, lets the real handler write the record, redraws."""

    def __init__(self, inner: logging.Handler, bars: EpochBars):
        super().__init__(inner.level)
        self.inner, self.bars = inner, bars

    def emit(self, record: logging.LogRecord) -> None:
        bar = self.bars._bar  # noqa: SLF001 (same module)
        if bar is not None:
            bar.clear()
        self.inner.handle(record)
        if bar is not None:
            bar.refresh()
