"""Files written whole or not at all, through tf.io.gfile (local, gs://, ram://).

Every file a run or a data writer leaves goes to a temporary name unique to its
writer (`<name>.tmp-<32 hex>`), then is renamed over the final name: a crash, a
kill -9 or a full disk leaves the previous complete file or none, never half of
one. A temporary left by a killed writer is recognised by its name and what it
holds, and removed at the next start (`remove_stale_temporaries`).
"""
import contextlib
import json
import os
import re
from typing import Callable, Iterator
from typing import Iterable
import uuid

import tensorflow as tf

# <name>.tmp-<uuid hex>: ours; <ckpt-N>_temp[...]: TensorFlow's checkpoint writer's.
_TEMPORARY = re.compile(r"(\.tmp-[0-9a-f]{32}$)|(^ckpt-\d+_temp)")
_OUR_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}$")
# What TensorFlow's writer puts in ckpt-N_temp/ (the shards, and their files while
# being written) before it moves them beside it.
_CHECKPOINT_PART = re.compile(r"^part-\d+-of-\d+\.(index|data-\d+-of-\d+)(\.tempstate\d+)?$")


class WriteError(OSError):
    """A file could not be written (no space, no permission); the previous complete
    file of that name, if any, is intact. The message names the file."""


def temporary_name(path: str) -> str:
    """A name beside `path` that no other writer uses."""
    return f"{path}.tmp-{uuid.uuid4().hex}"


def is_temporary(name: str) -> bool:
    """Whether a directory entry is a writer's temporary (ours or TF's checkpoints')."""
    return bool(_TEMPORARY.search(os.path.basename(name.rstrip("/"))))


def final_name(name: str) -> str:
    """The name a temporary of ours (`<name>.tmp-<hex>`) will be renamed to; any
    other name as it is."""
    return _OUR_SUFFIX.sub("", name)


def reason_of(err: Exception) -> str:
    """The cause in an OS or TensorFlow error, one short line ("No space left on
    device"), without TF's '{{function_node ...}}' prefix and path."""
    message = (getattr(err, "message", None) or str(err) or type(err).__name__)
    message = message.splitlines()[0] if message.strip() else type(err).__name__
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return message.split("}}")[-1].rsplit(";", 1)[-1].strip()[:160]


def what_to_do(reason: str) -> str:
    """The advice for a write that failed with `reason` (reason_of's): free space
    for a full disk, another place for a permission or a read-only file system."""
    if "space" in reason.lower() or "quota" in reason.lower():
        return "free space there or choose another directory"
    return "choose a directory you can write to"


def parent_of(path: str) -> str:
    """The directory holding `path`, or "" for none to make: the working directory
    (`name`), or a file system's root (`ram://name`: os.path.dirname would say
    "ram:", a local folder of that name)."""
    path = path.rstrip("/")
    scheme, separator, rest = path.partition("://")
    if separator:
        return f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else ""
    return os.path.dirname(path)


def make_parent(path: str, flag: str) -> None:
    """Creates the directories above `path` that are missing, as `mkdir -p` (a
    command's output path, `flag`, may name a new place); WriteError with the
    cause (permission, read-only file system, no space) if they cannot be."""
    parent = parent_of(path)
    if not parent or tf.io.gfile.isdir(parent):
        return
    try:
        tf.io.gfile.makedirs(parent)
    except (tf.errors.OpError, OSError) as err:
        raise WriteError(f"{flag}={path}: cannot create {parent} ({reason_of(err)}); "
                         f"choose a place you can write to") from err


def _remove_quietly(path: str) -> None:
    try:
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        elif tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
    except (tf.errors.OpError, OSError):
        pass  # (the disk that failed the write may fail this too; the name is unique)


class LinkError(ValueError):
    """A path a command would write or delete goes through a symbolic link; the
    message names the link and says what to do. Nothing was touched."""


def links_on(path: str, within: Iterable[str] = ()) -> list[str]:
    """The symbolic links that writing or deleting at `path` could pass: every
    folder from the outermost of `within` (the run directories) that holds `path`
    down to `path` itself, and everything below `path` (not followed). The folder
    a user names (the run directory, an --output_dir outside it) may itself be a
    link: it is where they put their run; nothing inside it may be. A filesystem
    without links (gs://, ram://) has none."""
    if "://" in path:
        return []
    path = os.path.abspath(path)
    roots = [os.path.abspath(r) for r in within if r and "://" not in r]
    holders = [r for r in roots if path == r or path.startswith(r.rstrip(os.sep) + os.sep)]
    root = min(holders, key=len) if holders else path
    found, folder = [], root
    for part in ([] if path == root else os.path.relpath(path, root).split(os.sep)):
        folder = os.path.join(folder, part)
        if os.path.islink(folder):
            return [folder]  # (what is beyond it is the link's target's)
    for top, folders, names in os.walk(path):  # (followlinks=False)
        found += [os.path.join(top, n) for n in sorted(folders + names)
                  if os.path.islink(os.path.join(top, n))]
    return found


def refuse_links(path: str, within: Iterable[str] = (), flag: str = "") -> None:
    """LinkError (one line, naming the first links and their targets) if writing or
    deleting at `path` could reach outside it through a symbolic link
    (`links_on`): the one guard of every command that writes under a run
    directory, called before it writes or deletes anything."""
    links = links_on(path, within)
    if links:
        shown = ", ".join(f"{shorter(link, 120)} -> {shorter(os.readlink(link), 80)}"
                          for link in links[:3]) + (", ..." if len(links) > 3 else "")
        named = f"{flag}={shorter(path, 120)}" if flag else shorter(path, 120)
        raise LinkError(
            f"{named} goes through symbolic link(s) ({shown}); a command writes and "
            f"deletes only inside a run's own folders: remove the link(s)"
            f"{f' or give another {flag}' if flag else ''} (nothing was touched)")


def shorter(value, limit: int = 200) -> str:
    """`value` as text, cut to about `limit` characters with its full length said
    ('abc... (10,000,000 characters)'): what an error line echoes of a value."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class BadFileError(ValueError):
    """A state file is unreadable, half written or of the wrong shape; the message
    names it and says what is wrong (the caller adds what to do)."""


def read_json(path: str, shape: type = dict, keys: tuple[str, ...] = ()):
    """The JSON value in `path`, which must be a `shape` (dict or list) and, for a
    dict, have `keys`. BadFileError otherwise, also for a half-written file."""
    try:
        with tf.io.gfile.GFile(path) as f:
            value = json.load(f)
    except tf.errors.NotFoundError as err:
        raise BadFileError(f"{path} not found") from err
    except (tf.errors.OpError, ValueError) as err:  # (UnicodeDecodeError too)
        raise BadFileError(f"{path} is not valid JSON ({reason_of(err)[:80]})") from err
    if not isinstance(value, shape):
        raise BadFileError(f"{path} holds a JSON {type(value).__name__}, not "
                           f"{'an object' if shape is dict else 'a list'}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise BadFileError(f"{path} has no {', '.join(map(repr, missing))}")
    return value


@contextlib.contextmanager
def written_whole(path: str) -> Iterator[str]:
    """`with written_whole(path) as tmp:` write the file (or directory) `tmp`; at
    the end it is renamed to `path`, replacing a file (or an empty directory) of
    that name. Directories above `path` that are missing are made first (an output
    path may name a new place). On failure the temporary is removed and WriteError
    names `path` and the cause; the previous file stays. The one mechanism every
    writer here uses."""
    tmp = temporary_name(path.rstrip("/"))
    try:
        parent = parent_of(path)
        if parent and not tf.io.gfile.isdir(parent):  # a new place: as mkdir -p
            tf.io.gfile.makedirs(parent)
        yield tmp
        if tf.io.gfile.isdir(path) and not tf.io.gfile.listdir(path):
            tf.io.gfile.rmtree(path)  # (an empty directory made beforehand)
        tf.io.gfile.rename(tmp, path, overwrite=True)
    except (tf.errors.OpError, OSError) as err:
        _remove_quietly(tmp)
        raise WriteError(f"could not write {path} ({reason_of(err)}); the previous "
                         f"file of that name, if any, is intact") from err
    except BaseException:  # e.g. a SIGTERM's exception during start-up
        _remove_quietly(tmp)
        raise


def write_atomically(path: str, data: bytes | str) -> None:
    """Writes `data` to `path` whole or not at all (`written_whole`)."""
    with written_whole(path) as tmp:
        with tf.io.gfile.GFile(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)


def write_json(path: str, values) -> None:
    """`write_atomically` of `values` as indented JSON."""
    write_atomically(path, json.dumps(values, indent=2, sort_keys=True))


def copy_atomically(source: str, path: str) -> None:
    """Copies `source` to `path` whole or not at all."""
    with tf.io.gfile.GFile(source, "rb") as f:
        write_atomically(path, f.read())


def remove_stale_temporaries(directory: str, final_names: Callable[[str], bool]
                             ) -> list[str]:
    """Removes what a killed writer left directly in `directory` and in its
    `.worker_tmp` (other workers' checkpoint copies); returns the names removed.
    Recognised by what the writers here write, not by the name alone: a
    `<name>.tmp-<hex>` whose <name> is one the directory's writers write
    (`final_names(name)`), and TensorFlow's `ckpt-N_temp/` holding only checkpoint
    parts. A symbolic link is never one (nor followed). Call it only while no other
    writer uses the directory (trainer/locks.py)."""
    removed = []
    for folder in (directory, os.path.join(directory, ".worker_tmp")):
        if not tf.io.gfile.isdir(folder) or _is_link(folder):
            continue
        names = tf.io.gfile.listdir(folder)
        if folder != directory:  # .worker_tmp/worker_N/ckpt-M_temp
            names = [os.path.join(n.rstrip("/"), m) for n in names
                     if tf.io.gfile.isdir(os.path.join(folder, n))
                     and not _is_link(os.path.join(folder, n))
                     for m in tf.io.gfile.listdir(os.path.join(folder, n))]
        for name in names:
            path = os.path.join(folder, name.rstrip("/"))
            if _left_by_a_writer(path, final_names):
                _remove_quietly(path)
                removed.append(os.path.relpath(path, directory)
                               if "://" not in directory else name.rstrip("/"))
    return removed


def _is_link(path: str) -> bool:
    return "://" not in path and os.path.islink(path)


def _left_by_a_writer(path: str, final_names: Callable[[str], bool]) -> bool:
    name = os.path.basename(path)
    if not is_temporary(name) or _is_link(path):
        return False
    suffix = _OUR_SUFFIX.search(name)
    if suffix:
        return final_names(name[:suffix.start()])
    if not tf.io.gfile.isdir(path):  # (TensorFlow's is a folder)
        return False
    return all(_CHECKPOINT_PART.match(part.rstrip("/")) and not _is_link(
        os.path.join(path, part.rstrip("/"))) for part in tf.io.gfile.listdir(path))
