"""One writer per run directory: `<dir>/writer.lock`.

A trainer (or an evaluator on its --output_dir) holds the lock from before it
writes anything until it exits, whatever the exit; a second one on the same
directory stops with one line naming the holder (host, pid, since when). In a
multi-worker job the chief holds it for the job.

The lock is a small JSON file, so it works on any tf.io.gfile filesystem (gs://
has no flock). A holder killed with -9, or a machine that was lost, leaves it
behind; it is stale, and taken over without anyone deleting it, when
- the holder ran on this host and its process is gone, or its pid now belongs to
  another process (the record holds the process's start: boot id and start time),
  the rerun's own pid included; a live holder on this host is never taken over,
  however long it has been frozen (kill -STOP) past its lease;
- the holder ran on another host and has not renewed its lease (every
  RENEW_SECONDS) for LEASE_SECONDS: a machine that was lost.
A holder checks the lock is still its own before every checkpoint and final output
(`check_held`); one that finds it taken over stops with LockLost before writing
again. "In use" is exit status 75 for the commands (EX_TEMPFAIL: a scheduler
retries), not the bad-input 2.
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
    """Another live process holds the directory (the commands: exit status 75,
    try again later)."""


class LockLost(RuntimeError):
    """Another process took this run's directory over (its holder looked dead: a
    frozen machine past its lease); this one stopped before writing again (exit
    status 6)."""


IN_USE_EXIT_CODE = 75   # EX_TEMPFAIL
LOCK_LOST_EXIT_CODE = 6
_HELD: dict[str, "Lock"] = {}  # the lock file's path -> this process's Lock


def process_start(pid: int) -> str | None:
    """What tells a process from a later one with its pid: the boot id and its
    start time in clock ticks (Linux's /proc); None where that is unknown. (Plain
    open: /proc is this machine's process table, not a run's file, and gfile reads
    its zero-size files as empty.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{start}"
    except (OSError, IndexError):
        return None


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


def _stale(record: dict, path: str) -> bool:
    if record.get("token") == "unreadable":
        return True
    lease_over = time.time() - float(record.get("renewed", 0)) > LEASE_SECONDS
    if record.get("host") != socket.gethostname():
        return lease_over  # elsewhere: the lease tells
    pid = int(record.get("pid", -1))
    if not _alive(pid):
        return True
    if pid == os.getpid():  # this process: stale unless it holds it now
        return path not in _HELD or _HELD[path].record["token"] != record.get("token")
    started, now = record.get("started"), process_start(pid)
    if started and now:  # the same process, alive (frozen or not), or its pid reused
        return started != now
    return lease_over  # (a record without the start, or no /proc: the lease)


def writer_record() -> dict:
    """Who this process is (host, pid, its start), for a file that a later process
    asks `writer_gone` about."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": process_start(pid),
            "renewed": time.time()}


def writer_gone(record: dict) -> bool:
    """Whether the process of a `writer_record` has ended (on another host: after
    LEASE_SECONDS), as a stale lock is judged."""
    return _stale(record, "")


def _describe(record: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("since", 0)))
    return (f"{record.get('command', 'a process')} (host {record.get('host')}, pid "
            f"{record.get('pid')}, since {since})")


class Lock:
    """A held lock; renews its lease in a daemon thread until `release()`."""

    def __init__(self, path: str, record: dict, made_directory: bool = False):
        self.path, self.record = path, record
        self.made_directory = made_directory
        _HELD[path] = self
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

    def check(self) -> None:
        """LockLost unless the lock is still this process's (before every write)."""
        holder = _read(self.path) or {}
        if holder.get("token") != self.record["token"]:
            taken = (f"by {_describe(holder)}" if holder.get("token") else
                     "(its lock is gone)")
            raise LockLost(f"{os.path.dirname(self.path)} was taken over {taken}; this "
                           f"process stopped before writing to it again (its checkpoints"
                           f" there are the other process's now)")

    def release(self) -> None:
        """Removes the lock if it is still this process's."""
        _HELD.pop(self.path, None)
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
        try:
            with tf.io.gfile.GFile(tmp, "w") as f:
                f.write(text)
            os.link(tmp, path)  # fails if the lock exists: never two holders
            return True
        except FileExistsError:
            return False
        finally:
            if tf.io.gfile.exists(tmp):  # also when the disk was full
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
        reason = files.reason_of(err)
        raise files.WriteError(f"cannot create {directory} ({reason}); "
                               f"{files.what_to_do(reason)}") from err
    path = os.path.join(directory, LOCK_FILE)
    record = {**writer_record(), "token": uuid.uuid4().hex, "command": command,
              "since": time.time()}
    for _ in range(3):
        try:
            if _create(path, record):
                return Lock(path, record, made_directory)
        except (files.WriteError, OSError, tf.errors.OpError) as err:
            reason = files.reason_of(err)  # (a full disk, a read-only mount, chattr +i)
            raise files.WriteError(f"cannot write {path} ({reason}); "
                                   f"{files.what_to_do(reason)}") from err
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile: try again
        if not _stale(holder, path):
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


def check_held(directory: str) -> None:
    """LockLost if this process held `directory` and another has taken it over
    since; nothing if this process does not hold it (a non-chief worker, a loop
    called without a command)."""
    lock = _HELD.get(os.path.join(directory, LOCK_FILE))
    if lock is not None:
        lock.check()


@contextlib.contextmanager
def held(directory: str, command: str, enabled: bool = True, run_dir: str = "",
         flag: str = "--model_dir") -> Iterator[None]:
    """`with held(dir, "trainer.main"):` ... the lock is released on every exit
    (an exception, SIGTERM's Preempted, sys.exit). enabled=False: no lock (the
    non-chief workers of a multi-worker job). First, for every worker, the guard
    of every writer: files.LinkError if a symbolic link lies on the way from
    `run_dir` (the run the directory is part of, if any) to `directory` or inside
    it, before the lock or anything else is written or deleted there."""
    files.refuse_links(directory, (run_dir,), flag)
    if not enabled:
        yield
        return
    lock = acquire(directory, command)
    try:
        yield
    finally:
        lock.release()
