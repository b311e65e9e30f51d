"""Where a run came from: the command line, the code (the project's version and git
commit), the versions of Python, TensorFlow and Keras, the host and the devices.
Recorded at every start in run_history.json and with the final metrics."""
import datetime
import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
import sys

import keras
import tensorflow as tf

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(directory: str = PROJECT_DIR) -> str | None:
    """The checkout's commit, with '+changes' if files differ from it; None outside
    a git checkout (an installed package) or without git."""
    try:
        commit = subprocess.run(["git", "-C", directory, "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", directory, "status", "--porcelain",
                                 "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def _version() -> str | None:
    try:
        return importlib.metadata.version("tfloop")
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(devices: str) -> dict:
    """This process's provenance; `devices` describes what the run runs on."""
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "version": _version(), "git_commit": git_commit(),
        "python": platform.python_version(), "tensorflow": tf.__version__,
        "keras": keras.__version__, "host": socket.gethostname(), "devices": devices,
    }
