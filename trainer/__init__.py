"""The training framework: config, devices, the step, the loop."""
import os as _os
import signal as _signal
import sys as _sys
import time as _time

# trainer/faults.py's status for a stop signal (EX_TEMPFAIL: "try again").
# When the package was first imported: the start of a command, before TensorFlow
# loads (trainer/output/startup.py counts the time to the first step from it).
STARTED_AT = _time.perf_counter()
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


# The TensorFlow versions this code runs on (.ci/run tests both), and the
# distributions a TensorFlow build comes as.
SUPPORTED_TENSORFLOW = ((2, 20), (2, 21))
TENSORFLOW_BUILDS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tensorflow-intel",
                     "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")


def tensorflow_problem() -> str | None:
    """What is wrong with the installed TensorFlow, in one line (None: nothing):
    none installed, a version this code was not tested on, or two builds at once
    (`pip install -e .[cpu]` on a TPU VM puts the CPU wheel's files over
    tensorflow-tpu's). Reads the installed distributions' metadata only."""
    from importlib import metadata
    found = {}
    for name in TENSORFLOW_BUILDS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    supported = " or ".join(f"{a}.{b}" for a, b in SUPPORTED_TENSORFLOW)
    if not found:
        return (f"TensorFlow is not installed: pip install -e \".[cpu]\" (or [gpu], "
                f"[tpu]: docs/accelerators.md); this code runs on TensorFlow {supported}")
    if len(found) > 1:
        builds = " and ".join(f"{name} {version}" for name, version in found.items())
        keep = "tensorflow-tpu" if "tensorflow-tpu" in found else next(iter(found))
        return (f"two TensorFlow builds are installed ({builds}), whose files overwrite "
                f"each other's: uninstall all but {keep}, then reinstall it "
                f"(pip install --force-reinstall --no-deps {keep}=={found[keep]})")
    (name, version), = found.items()
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor not in SUPPORTED_TENSORFLOW:
        return (f"{name} {version} is installed; this code runs on TensorFlow "
                f"{supported}: pip install \"{name}>=2.20,<2.22\"")
    return None


# The distribution installs three import names, `trainer`, `models` and `data`,
# that a researcher's own repository very often holds too (a models.py, a data/
# package): with `python -m`, the working directory comes first on sys.path and
# theirs would be imported in place of ours ("module 'models' has no attribute
# 'LOGITS'"). The framework's own two are therefore always imported from beside
# this package, wherever the command runs; theirs stay importable under another
# name (docs/own-code.md).
OWN_PACKAGES = ("models", "data")
PACKAGES_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _OwnPackagesFirst:
    """A sys.meta_path finder: `models` and `data` (and so their submodules) from
    PACKAGES_ROOT, before sys.path is searched."""

    def find_spec(self, fullname, path=None, target=None):
        del path, target
        if fullname not in OWN_PACKAGES:
            return None
        from importlib import machinery
        return machinery.PathFinder.find_spec(fullname, [PACKAGES_ROOT])


def _import_own_packages_first() -> None:
    """Installs _OwnPackagesFirst. A `models` or `data` of someone else's imported
    before this package (a script of theirs that imports its own `models`, then
    trainer) cannot be undone: one ImportError saying so."""
    for name in OWN_PACKAGES:
        module = _sys.modules.get(name)
        where = _os.path.abspath(getattr(module, "__file__", None) or "?")
        if module is not None and not where.startswith(PACKAGES_ROOT + _os.sep):
            raise ImportError(
                f"{where} was imported as `{name}` before trainer, whose own `{name}` "
                f"package it needs: give yours another name (e.g. my_{name}), or "
                f"import trainer first")
    if not any(isinstance(finder, _OwnPackagesFirst) for finder in _sys.meta_path):
        _sys.meta_path.insert(0, _OwnPackagesFirst())


_import_own_packages_first()

# `python -m trainer.main`: Python imports this package first, with sys.argv[0]
# "-m" while it finds the module (never so under pytest or an `import trainer`).
_program = getattr(_sys, "orig_argv", [])[1:3]
if _sys.argv[:1] == ["-m"] and any(name.startswith("trainer.") for name in _program):
    if any(name in _program for name in _COMMANDS):
        stop_at_once_on_signals()
    _problem = tensorflow_problem()
    if _problem:
        print(f"error: {_problem}", file=_sys.stderr)
        _sys.exit(2)
