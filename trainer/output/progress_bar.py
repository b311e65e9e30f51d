"""The live progress bar on a terminal: one tqdm bar per epoch showing step, every
metric the step returns, learning rate, images/sec and the ETA of the epoch and of the whole run.

The line fits the terminal's width, read at every update (a resized window too):
the fields after the bar each have a priority, and the least important drop first
(the ETA stays longest), so the line is never cut by the terminal or by tqdm.
tqdm (already a dependency of tensorflow-datasets) handles the redraw rate. Off a terminal
(a log file, CI) there is no bar: the loop logs one plain line every --log_every
steps instead (see reporting.Progress).
"""
import contextlib
import logging
import os
import shutil
from typing import IO, Callable, Sequence

import tqdm

# In data/ so data.make_tfrecords shares it; the loop calls progress_bar.is_live_terminal.
from data import quiet
from data.quiet import is_live_terminal  # noqa: F401


# The ETAs are ours (training time at this epoch's rate), among the fields.
_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar:%d}| {elapsed}  {fields}"
_BAR_WIDTHS = (6, 20)  # the bar's, as the room left after the fields allows
Field = tuple[int, str | tuple[str, ...]]  # (priority, text or its forms, longest first)


class _Bar(tqdm.tqdm):
    """A tqdm bar whose text after the bar is `fields` as given (tqdm's own postfix
    starts with a comma)."""
    fields = ""

    @property
    def format_dict(self) -> dict:
        return {**super().format_dict, "fields": self.fields}


def terminal_width(stream: IO) -> int:
    """The columns of the terminal `stream` writes to (else of the process's
    terminal, $COLUMNS or 80)."""
    try:
        return os.get_terminal_size(quiet.terminal_fd(stream)).columns
    except (AttributeError, OSError, ValueError):  # not a real terminal's stream
        return shutil.get_terminal_size().columns


class EpochBars:
    """Opens a bar for each epoch as steps arrive; a finished epoch's bar stays on
    screen as that epoch's summary line. `width`: the columns to fit in (default:
    the terminal's, read at every update)."""

    def __init__(self, total_steps: int, steps_per_epoch: int, stream: IO,
                 width: int | None = None):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.stream, self.width = stream, width
        self.num_epochs = -(-total_steps // steps_per_epoch)
        self._bar, self._epoch = None, -1

    def update(self, step: int, fields: Sequence[Field]) -> None:
        """Moves the bar to `step` (steps done in the run) and shows as many of
        `fields` ((priority, text or its shorter forms) in display order; priority
        0 is kept longest) as fit in the terminal's width."""
        epoch = (step - 1) // self.steps_per_epoch  # the epoch the last step was in
        if epoch != self._epoch:
            self.close()
            self._open(epoch)
        width = self.width or terminal_width(self.stream)
        bar, done = self._bar, step - epoch * self.steps_per_epoch
        bar.ncols = width  # tqdm cuts at it: only if even the ETA does not fit
        shortest, longest = _BAR_WIDTHS

        def line_length(text: str) -> int:
            return len(bar.format_meter(**{**bar.format_dict, "n": done, "ncols": None,
                                           "fields": text, "bar_format": _FORMAT % shortest}))
        room = width - 1  # (a terminal may wrap a line that fills its last column)
        bar.fields = _fitting(fields, line_length, room)
        bar.bar_format = _FORMAT % max(shortest, min(longest, shortest + room
                                                     - line_length(bar.fields)))
        bar.update(done - bar.n)

    def _open(self, epoch: int) -> None:
        first = epoch * self.steps_per_epoch
        self._epoch = epoch
        self._bar = _Bar(
            total=min(self.steps_per_epoch, self.total_steps - first),
            initial=0, desc=f"epoch {epoch + 1}/{self.num_epochs}", unit="step",
            file=self.stream, leave=True, mininterval=0.5, bar_format=_FORMAT % _BAR_WIDTHS[1],
            ncols=self.width or terminal_width(self.stream))

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


def _fitting(fields: Sequence[Field], line_length: Callable[[str], int], width: int
             ) -> str:
    """The fields, most important first (each in its longest form that fits), as
    long as the line (`line_length` of their text) fits in `width`, joined in their
    display order."""
    kept: dict[int, str] = {}
    join = lambda chosen: "  ".join(chosen[i] for i in sorted(chosen))  # noqa: E731
    for index in sorted(range(len(fields)), key=lambda i: fields[i][0]):
        forms = fields[index][1]
        fitting = [form for form in ((forms,) if isinstance(forms, str) else forms)
                   if line_length(join({**kept, index: form})) <= width]
        if not fitting:
            break
        kept[index] = fitting[0]
    return join(kept)


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
