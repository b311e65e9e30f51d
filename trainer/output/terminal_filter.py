"""The process between a training command and its terminal (trainer/output/console.py
starts it; standard library only, so it starts in a few milliseconds and survives
the command: a crash's last lines still arrive).

It reads everything the command writes to its stderr (fd 2: Python's lines and
TensorFlow's native C++ ones alike) and
- writes our lines to the terminal short: `14:38:30 message` (warnings and errors
  say so), wrapped at word boundaries to the terminal's width (`--short`, on a
  terminal; elsewhere as absl wrote them);
- keeps TensorFlow's native lines (grappler's "remapper failed" on a gradient of a
  gradient, libjpeg's "Premature end of JPEG data") off the terminal, except fatal
  ones (`--verbose`: all of them);
- passes everything else through as it comes (the live bar, tracebacks, `error:`
  lines), and after a terminal narrowed under a drawn bar line (which the terminal
  then reflowed onto two rows) clears that line's rows before the bar redraws;
- keeps every line, in absl's full format, in the run's log file: the control line
  CONTROL + b"LOG " + path names it (the run directory, once the command holds it;
  the lines before are kept until then, and a file already there is appended to).
  The file is rewritten whole (a temporary, then renamed) at most every
  WRITE_SECONDS while lines come, and at the end; a path with a scheme (gs://) is
  written through tf.io.gfile, imported only then.

    python trainer/output/terminal_filter.py [--short] [--verbose] < pipe
"""
import os
import re
import signal
import sys
import textwrap
import time
import uuid

CONTROL = b"\x1e"  # ASCII record separator: starts a control line from the command
WRITE_SECONDS = 2.0
# absl's and TensorFlow's log prefix: level, MMDD, time, thread id, file:line.
PREFIX = re.compile(rb"([IWEF])(\d{4}) (\d\d:\d\d:\d+)\.\d+ +\d+ ([\w.<>/-]+):\d+\] ")
_LEVEL_WORDS = {b"I": "", b"W": "warning: ", b"E": "error: ", b"F": "fatal: "}
_INDENT = " " * 9  # under the message, past `HH:MM:SS `


def is_native(line: bytes) -> bool:
    """A line of TensorFlow's C++ logging (its file is not a .py)."""
    match = PREFIX.match(line)
    return bool(match) and not match.group(4).endswith(b".py")


def short_form(line: bytes, width: int) -> str:
    """An absl line as `HH:MM:SS [warning: ]message`, wrapped to `width` columns."""
    match = PREFIX.match(line)
    text = line.decode("utf-8", "replace")
    if not match:
        return text
    message = line[match.end():].decode("utf-8", "replace")
    head = f"{match.group(3).decode()} {_LEVEL_WORDS[match.group(1)]}"
    if width < 40:
        return head + message
    return textwrap.fill(head + message, width - 1, subsequent_indent=_INDENT,
                         break_on_hyphens=False, drop_whitespace=True)


# The commands' own lines that are not log records: the last line of a failed or
# stopped run, wrapped on a terminal as the log records are.
ONE_LINERS = (b"error: ", b"stopped: ", b"warning: ")


def wrapped(line: bytes, width: int) -> str:
    """One of ONE_LINERS wrapped at word boundaries to `width` columns."""
    text = line.decode("utf-8", "replace")
    if width < 40:
        return text
    return textwrap.fill(text, width - 1, subsequent_indent="  ",
                         break_on_hyphens=False, break_long_words=False)


class LogFile:
    """The command's lines, rewritten whole to `path` once it is known."""

    def __init__(self):
        self.lines: list[bytes] = []
        self.path: str | None = None
        self.kept = b""  # the file's content before this command
        self.written_at, self.dirty = 0.0, False

    def add(self, line: bytes) -> None:
        self.lines.append(line + b"\n")
        self.dirty = True
        self.write(force=False)

    def open(self, path: str) -> None:
        self.path = path
        try:
            self.kept = _read(path)
        except Exception:  # (unreadable: it is rewritten with this command's lines)
            self.kept = b""
        self.dirty = True
        self.write(force=True)

    def write(self, force: bool) -> None:
        if self.path is None or not self.dirty:
            return
        if not force and time.monotonic() - self.written_at < WRITE_SECONDS:
            return
        try:
            _write_whole(self.path, self.kept + b"".join(self.lines))
        except Exception as err:  # a full disk: the terminal says it once
            _terminal(f"warning: the log file {self.path} could not be written "
                      f"({type(err).__name__}: {err}); the terminal has the lines\n"
                      .encode())
            self.path = None
        self.written_at, self.dirty = time.monotonic(), False


def _read(path: str) -> bytes:
    """The file's bytes, b"" if there is none."""
    gfile = _gfile(path)
    if gfile is not None:
        if not gfile.exists(path):
            return b""
        with gfile.GFile(path, "rb") as f:
            return f.read()
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _write_whole(path: str, data: bytes) -> None:
    """Written to a temporary named as data/files.py's temporary_name names them
    (so a killed writer's is known as one and removed), then renamed over `path`;
    on failure the temporary is removed and the previous file stays."""
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    gfile = _gfile(path)
    opened, rename, remove = ((gfile.GFile, lambda a, b: gfile.rename(a, b, overwrite=True),
                               gfile.remove) if gfile is not None else
                              (open, os.replace, os.remove))
    try:
        with opened(temporary, "wb") as f:
            f.write(data)
        rename(temporary, path)
    except Exception:
        try:
            remove(temporary)
        except Exception:  # (never made, or the file system refuses that too)
            pass
        raise


def _gfile(path: str):
    """tf.io.gfile for a path with a scheme (gs://, ram://), imported only then;
    None for a local path, written with os: the filter starts in milliseconds
    without TensorFlow (this departs from the project's every-path-through-gfile
    rule for local files alone, deliberately)."""
    if "://" not in path:
        return None
    import tensorflow as tf
    return tf.io.gfile


_OUT = 1  # our stdout: the command's terminal (or file)


def _terminal(data: bytes) -> None:
    try:
        os.write(_OUT, data)
    except OSError:  # the terminal went away (its window closed): the log file stays
        pass


def _width() -> int:
    try:
        return os.get_terminal_size(_OUT).columns
    except OSError:
        return 0


class Screen:
    """What is on the terminal's last row: the live bar's text since its last \\r,
    and the width it was drawn at."""

    def __init__(self):
        self.shown, self.drawn_at = 0, _width()

    def write(self, data: bytes) -> None:
        width = _width()
        if self.shown and width and width < self.drawn_at and self.shown > width - 1:
            rows = (self.shown - 1) // width  # the rows the terminal reflowed it onto
            _terminal(b"\r" + (b"\x1b[%dA" % rows if rows else b"") + b"\x1b[J")
        self.drawn_at = width or self.drawn_at
        _terminal(data)
        tail = data.rsplit(b"\n", 1)[-1].rsplit(b"\r", 1)
        text = tail[-1].decode("utf-8", "replace")
        self.shown = len(text) if (len(tail) > 1 or b"\n" in data) else self.shown + len(text)


def main(argv: list[str]) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)  # it ends when the command's fd 2 closes
    short, verbose = "--short" in argv, "--verbose" in argv
    log, screen = LogFile(), Screen()
    pending = b""  # what came after the last newline, not shown yet
    partial = b""  # the text, since its last \r, of a line shown before its end (the bar)

    def on_line(line: bytes) -> None:
        nonlocal partial
        last = line.rsplit(b"\r", 1)[-1]
        cleared = line[:len(line) - len(last)]  # (the bar cleared: \r   \r)
        if last.startswith(CONTROL):
            if last[1:].startswith(b"LOG "):
                log.open(last[5:].decode())
            screen.write(cleared)
            return
        if partial and not cleared and not PREFIX.match(last):
            log.add(partial + last)  # the end of the line shown in part (the bar's)
            screen.write(line + b"\n")
            partial = b""
            return
        log.add(last)
        if is_native(last) and not verbose and not last.startswith(b"F"):
            screen.write(cleared)
            return
        if short and PREFIX.match(last) and not is_native(last):
            start = cleared or (b"\r\x1b[K" if partial else b"")  # (a line under the bar)
            screen.write(start + short_form(last, _width()).encode() + b"\n")
        elif short and last.startswith(ONE_LINERS) and not partial:
            screen.write(cleared + wrapped(last, _width()).encode() + b"\n")
        else:
            screen.write(line + b"\n")
        partial = b""  # (the bar's row now holds this line: it redraws below)

    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            on_line(line)
        last = pending.rsplit(b"\r", 1)[-1]
        if pending and not (re.match(rb"[IWEF]\d{0,4}$", last) or PREFIX.match(last)
                            or last.startswith(CONTROL)):
            screen.write(pending)  # a partial line (the live bar): show it now
            partial = last if b"\r" in pending else partial + last
            pending = b""
        log.write(force=False)
    if pending:
        on_line(pending)
    elif partial:
        log.add(partial)
    log.write(force=True)


if __name__ == "__main__":
    main(sys.argv[1:])
