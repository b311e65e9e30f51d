"""The training framework: config, devices, the step, the loop."""
import os as _os
import signal as _signal
import sys as _sys

# trainer/faults.py's status for a stop signal (EX_TEMPFAIL: "try again").
STOPPED_EXIT_CODE = 75
STOP_SIGNALS = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)
# The commands that are programs with a start-up worth a line (TensorFlow loads).
_COMMANDS = ("trainer.main", "trainer.evaluate", "trainer.tools.lr_find")


def stop_at_once_on_signals() -> None:
    """Until a command's own handlers take over (trainer/faults.py, after its flags
    are parsed), a stop signal (SIGTERM, SIGINT, SIGHUP) while the program starts
    (Python, then TensorFlow, loading) is one line and exit STOPPED_EXIT_CODE at
    once (nothing has been written yet), not a KeyboardInterrupt traceback.
    Installed by this package's first line when a command is the program
    (`python -m trainer.main`: its start-up window is then Python's own alone)."""
    stderr = _os.dup(2)  # (TensorFlow is imported with fd 2 muted: data/quiet.py)

    def stop(signum, frame):
        del frame
        _os.write(stderr, f"stopped: {_signal.Signals(signum).name} during start-up, "
                          f"before anything was written: run the same command to "
                          f"start\n".encode())
        _os._exit(STOPPED_EXIT_CODE)
    for signum in STOP_SIGNALS:
        _signal.signal(signum, stop)


# `python -m trainer.main`: Python imports this package first, with sys.argv[0]
# "-m" while it finds the module (never so under pytest or an `import trainer`).
if _sys.argv[:1] == ["-m"] and any(name in getattr(_sys, "orig_argv", [])[1:3]
                                   for name in _COMMANDS):
    stop_at_once_on_signals()
