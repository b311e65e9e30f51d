"""One writer per run directory: `<dir>/writer.lock`.

A trainer (or an evaluator on its --output_dir) holds the lock from before it
writes anything until it exits, whatever the exit; a second one on the same
directory stops with one line naming the holder (host, pid, since when). In a
multi-worker job the chief holds it for the job.

The lock is a small JSON file, so it works on any tf.io.gfile filesystem (gs://
has no flock). A holder killed with -9, or a machine that was lost, leaves it
behind; it is stale, and taken over without anyone deleting it, when
- the holder ran on this host and its process is gone, or
- it has not renewed its lease (every RENEW_SECONDS) for LEASE_SECONDS: a holder
  on another machine that was lost, or a pid reused by another process here.
Creating the file is exclusive on a local disk (the whole record hard-linked to
the name, which fails if it exists); elsewhere the writer writes its token, waits
SETTLE_SECONDS and reads it back (the last writer wins).
"""
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Iterator

from absl import logging
import tensorflow as tf

from data import files
from trainer.checkpoints import CheckpointError

LOCK_FILE = "writer.lock"
RENEW_SECONDS = 30.0
LEASE_SECONDS = 300.0  # 10 missed renewals: a holder that slow has lost its disk
SETTLE_SECONDS = 1.0


class DirectoryInUse(CheckpointError):
    """Another live process holds the directory (exit status 2)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _read(path: str) -> dict | None:
    """The lock's record; None if there is none. A lock that is not a record (every
    writer here writes it whole: a damaged file) counts as stale."""
    if not tf.io.gfile.exists(path):
        return None
    try:
        return files.read_json(path)
    except files.BadFileError:  # (also: removed between the two calls)
        return None if not tf.io.gfile.exists(path) else {"token": "unreadable"}


def _stale(record: dict) -> bool:
    if record.get("token") == "unreadable":
        return True
    if record.get("host") == socket.gethostname() and not _alive(int(record.get("pid", -1))):
        return True
    # Elsewhere, or a pid now used by another process: the lease tells.
    return time.time() - float(record.get("renewed", 0)) > LEASE_SECONDS


def _describe(record: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("since", 0)))
    return (f"{record.get('command', 'a process')} (host {record.get('host')}, pid "
            f"{record.get('pid')}, since {since})")


class Lock:
    """A held lock; renews its lease in a daemon thread until `release()`."""

    def __init__(self, path: str, record: dict, made_directory: bool = False):
        self.path, self.record = path, record
        self.made_directory = made_directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name="lock-lease")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            if (_read(self.path) or {}).get("token") != self.record["token"]:
                logging.error("%s no longer holds this process's token: another "
                              "process took the directory over", self.path)
                return
            try:
                files.write_json(self.path, {**self.record, "renewed": time.time()})
            except files.WriteError as err:  # the run's own writes will say more
                logging.warning("could not renew %s: %s", self.path, err)

    def release(self) -> None:
        """Removes the lock if it is still this process's."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            if (_read(self.path) or {}).get("token") == self.record["token"]:
                tf.io.gfile.remove(self.path)
            directory = os.path.dirname(self.path)
            if self.made_directory and not tf.io.gfile.listdir(directory):
                tf.io.gfile.rmtree(directory)  # refused before writing: leave nothing
        except tf.errors.OpError as err:
            logging.warning("could not remove %s (%s); the next run will find it "
                            "stale", self.path, files.reason_of(err))


def _create(path: str, record: dict) -> bool:
    """Writes the lock if there is none; whether this process now holds it."""
    text = json.dumps(record, indent=2)
    if "://" not in path:  # a local disk: the whole record, linked in exclusively
        tmp = files.temporary_name(path)
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        try:
            os.link(tmp, path)  # fails if the lock exists: never two holders
            return True
        except FileExistsError:
            return False
        finally:
            tf.io.gfile.remove(tmp)
    if tf.io.gfile.exists(path):
        return False
    files.write_atomically(path, text)
    time.sleep(SETTLE_SECONDS)  # a writer racing us has written by now: who won?
    return (_read(path) or {}).get("token") == record["token"]


def acquire(directory: str, command: str) -> Lock:
    """Holds `directory` (created if needed) for this process, or DirectoryInUse
    naming the live holder. A stale lock is taken over, with a warning."""
    made_directory = not tf.io.gfile.isdir(directory)
    try:
        tf.io.gfile.makedirs(directory)
    except tf.errors.OpError as err:
        raise CheckpointError(f"cannot create {directory}: {files.reason_of(err)}; "
                              f"choose a writable directory") from err
    path = os.path.join(directory, LOCK_FILE)
    pid = os.getpid()
    record = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": pid,
              "command": command,
              "since": time.time(), "renewed": time.time()}
    for _ in range(3):
        try:
            if _create(path, record):
                return Lock(path, record, made_directory)
        except (files.WriteError, OSError) as err:
            raise CheckpointError(f"cannot write {path} ({files.reason_of(err)}); "
                                  f"choose a writable directory") from err
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile: try again
        if not _stale(holder):
            raise DirectoryInUse(
                f"{directory} is in use by {_describe(holder)}; wait for it to end, "
                f"stop it, or use another directory")
        logging.warning("taking over the stale lock of %s in %s", _describe(holder),
                        directory)
        if (_read(path) or {}).get("token") == holder.get("token"):  # not renewed
            try:  # meanwhile by a racer: remove it, then create ours
                tf.io.gfile.remove(path)
            except tf.errors.NotFoundError:
                pass
    raise DirectoryInUse(f"{directory}: could not take its lock ({path}) after three "
                         f"tries; another process is starting there")


@contextlib.contextmanager
def held(directory: str, command: str, enabled: bool = True) -> Iterator[None]:
    """`with held(dir, "trainer.main"):` ... the lock is released on every exit
    (an exception, SIGTERM's Preempted, sys.exit). enabled=False: a no-op (the
    non-chief workers of a multi-worker job)."""
    if not enabled:
        yield
        return
    lock = acquire(directory, command)
    try:
        yield
    finally:
        lock.release()
