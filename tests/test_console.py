"""The terminal of a training command (trainer/output/console.py and its filter
process, trainer/output/terminal_filter.py): short lines that fit, TensorFlow's
native noise in the log file only, a clean redraw after the window narrows, and
every line in the run directory's log file."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

from trainer.output import console, terminal_filter

OURS = (b"I1207 14:38:29.389794 140309262703488 run_flags.py:69] Recipe for cifar_cnn: "
        + b" ".join(b"setting_%d=%d" % (i, i) for i in range(9)) + b"\n")
WARNING = b"W1207 14:38:30.1 140309262703488 faults.py:12] a warning of ours\n"
REMAPPER = (b"E0000 00:00:1796654556.329133   28505 meta_optimizer.cc:967] remapper "
            b"failed: INVALID_ARGUMENT: Mutation::Apply error: fanout 'x' LeakyReluGrad\n")
LIBJPEG = b"W0000 00:00:1796654556.5   28505 jpeg_mem.cc:100] Premature end of JPEG data\n"
FATAL = b"F0000 00:00:1796654556.6   28505 tensor.cc:1] Check failed: a fatal one\n"
PLAIN = (b"error: one line of ours, wrapped at word boundaries on a terminal: "
         + b"/a/long/path/to/a/file.tfrec " * 4 + b"\n")


def _set_width(fd: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))


def _filter_on_a_terminal(columns: int, *args: str):
    """The filter writing to a pseudo-terminal of `columns`: (process, its
    terminal's reading end)."""
    reader, terminal = pty.openpty()
    _set_width(terminal, columns)
    process = subprocess.Popen([sys.executable, terminal_filter.__file__, *args],
                               stdin=subprocess.PIPE, stdout=terminal, stderr=terminal)
    os.close(terminal)
    return process, reader


def _read_all(reader: int, process: subprocess.Popen) -> bytes:
    out = b""
    while True:
        ready, _, _ = select.select([reader], [], [], 10)
        try:
            chunk = os.read(reader, 65536) if ready else b""
        except OSError:  # (the pseudo-terminal's other end closed)
            chunk = b""
        if not chunk:
            break
        out += chunk
    process.wait(10)
    return out.replace(b"\r\n", b"\n")


def test_our_lines_are_short_and_fit_native_noise_goes_to_the_log_file(tmp_path):
    log_file = tmp_path / "log.txt"
    log_file.write_bytes(b"a line of the run's start before\n")  # (a resume appends)
    process, reader = _filter_on_a_terminal(80, "--short")
    process.stdin.write(OURS + REMAPPER + terminal_filter.CONTROL + b"LOG "
                        + str(log_file).encode() + b"\n" + WARNING + LIBJPEG + PLAIN
                        + FATAL)
    process.stdin.close()
    shown = _read_all(reader, process).decode()
    lines = shown.splitlines()
    assert lines[0].startswith("14:38:29 Recipe for cifar_cnn: setting_0=0"), shown
    assert all(len(line) < 80 for line in lines), shown  # (wrapped by the filter)
    assert len([line for line in lines if line.startswith("   ")]) == 1, shown  # 2 rows
    assert "14:38:30 warning: a warning of ours" in lines, shown
    assert PLAIN.decode().split() == " ".join(  # (its words, on 3 rows that fit)
        line for line in lines if line.startswith(("error: ", "  /"))).split(), shown
    assert "remapper" not in shown and "JPEG" not in shown, shown  # the noise: not here
    assert "Check failed: a fatal one" in shown  # (but a fatal one is)
    assert "140309262703488" not in shown and "run_flags.py" not in shown
    kept = log_file.read_bytes()
    assert kept == (b"a line of the run's start before\n" + OURS + REMAPPER + WARNING
                    + LIBJPEG + PLAIN + FATAL), kept  # absl's full format, all of it
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_verbose_shows_the_native_lines_and_a_log_keeps_the_full_format(tmp_path):
    process = subprocess.Popen([sys.executable, terminal_filter.__file__, "--verbose"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    shown, _ = process.communicate(OURS + REMAPPER + LIBJPEG, timeout=30)
    assert shown == OURS + REMAPPER + LIBJPEG  # (not a terminal: as absl wrote them)


def test_the_bar_redraws_cleanly_after_the_window_narrows():
    """A bar line drawn at 120 columns, which a terminal reflows onto two rows when
    the window narrows to 80: before the next draw, the filter goes up a row and
    clears to the end of the screen, so no stale half-line stays."""
    process, reader = _filter_on_a_terminal(120, "--short")
    bar = b"\repoch 1/50 20/49 |" + "\u2588".encode() * 20 + b"| 00:14  " + b"x" * 70
    process.stdin.write(bar)
    process.stdin.flush()
    time.sleep(0.5)  # (drawn at 120)
    _set_width(reader, 80)
    narrow = b"\repoch 1/50 30/49 |" + "\u2588".encode() * 10 + b"| 00:20  loss 2.3"
    process.stdin.write(narrow + b"\n" + OURS)
    process.stdin.close()
    shown = _read_all(reader, process)
    assert b"\r\x1b[1A\x1b[J" + narrow in shown, shown[-400:]
    assert shown.count(b"\x1b[1A") == 1, shown  # (only after the narrowing)


def test_a_bar_line_with_native_noise_under_it_stays_whole():
    """TensorFlow's native lines arrive on fd 2 at any time, also while the bar is
    drawn without a newline: they leave the bar as it is."""
    process, reader = _filter_on_a_terminal(100, "--short")
    process.stdin.write(b"\repoch 1/1 5/9 |##  | 00:01")
    process.stdin.flush()
    time.sleep(0.3)
    process.stdin.write(REMAPPER + b"\repoch 1/1 6/9 |### | 00:02\n")
    process.stdin.close()
    shown = _read_all(reader, process)
    assert shown == b"\repoch 1/1 5/9 |##  | 00:01\repoch 1/1 6/9 |### | 00:02\n", shown


def test_the_log_file_is_named_for_the_chief_or_the_worker():
    class Resolver:
        def __init__(self, task_type, task_id, jobs):
            self.task_type, self.task_id, self.jobs = task_type, task_id, jobs

        def cluster_spec(self):
            class Spec:
                as_dict = lambda _: {job: ["x"] for job in self.jobs}  # noqa: E731
            return Spec()

    class Strategy:
        def __init__(self, resolver):
            self.cluster_resolver = resolver
    assert console.log_file_name(object()) == "log.txt"
    assert console.log_file_name(Strategy(Resolver("worker", 0, ["worker"]))) == "log.txt"
    assert console.log_file_name(Strategy(Resolver("worker", 1, ["worker"]))) == (
        "log-worker1.txt")
    assert console.log_file_name(Strategy(Resolver("worker", 0, ["chief", "worker"]))
                                 ) == "log-worker0.txt"
    assert console.is_log_file("log-worker1.txt") and not console.is_log_file("log.csv")
    assert re.fullmatch(r"\d\d:\d\d:\d\d ", terminal_filter.short_form(OURS, 200)[:9])
