"""Checkpoints and weights files in --model_dir: save, resume, and what to serve.

A run directory is one run; trainer/run_dir.py checks that a start may continue
it (its settings, in run_config.json and run_history.json) before anything here
writes; the file names are here.

A bad disk loses at most the checkpoint it broke: an unreadable newest checkpoint
(truncated by a crash during a copy, a full network disk) is named in a warning and
the run resumes from the newest readable one; a save that fails (no space, no
permission) leaves no temporary files and stops the run with one line naming the
directory and the last good checkpoint (CheckpointSaveError).
"""
import contextlib
import io
import os
import threading
import uuid
from typing import Iterator

from absl import logging
import tensorflow as tf

from data import files
from trainer import state as state_lib

RUN_CONFIG = "run_config.json"      # the settings, as the run started: never rewritten
RUN_HISTORY = "run_history.json"    # every start: what it changed, where it ran
METRICS_FILE = "metrics.json"       # (trainer/output/recorder.py writes it)
WEIGHTS_FILE = "model.weights.h5"       # the final (evaluated) weights
BEST_WEIGHTS_FILE = "best.weights.h5"   # the weights of the best evaluation


class CheckpointError(RuntimeError):
    """--model_dir cannot be used; the message says why and what to do."""


class CheckpointSaveError(files.WriteError):
    """A checkpoint could not be written; the earlier ones are intact."""


# What reading a truncated or corrupt checkpoint raises: any error of TensorFlow's
# reader (a zero-filled data file, what a crashed VM's file system leaves, gives the
# base OpError, "The length checksum does not match"; a cut one DataLossError or
# OutOfRangeError; a missing shard NotFoundError), and a short data file a Python
# IndexError, "Read less bytes than requested". A checkpoint of another model is
# not among them: restoring it raises AssertionError or ValueError.
UNREADABLE = (IndexError, tf.errors.OpError)


def written_by_a_run(name: str) -> bool:
    """Whether a run's commands write files of this name in its directory (their
    temporaries, `<name>.tmp-<hex>`, are the run's): its records (.json, log.csv),
    weights (.weights.h5), figures (.png) and lock. A user's `notes.tmp-<hex>` is
    not. tests/test_nothing_lost.py checks every file a finished run leaves."""
    return name in ("writer.lock", "log.csv") or name.endswith(
        (".json", ".weights.h5", ".png"))


def trained_nothing(model_dir: str) -> bool:
    """Whether no step of the run in model_dir was kept: no checkpoint and no
    weights file (its starts were stopped, or killed, before their first one). Such
    a directory is not yet a run: a start with other settings begins it afresh."""
    return not (tf.io.gfile.glob(os.path.join(model_dir, "ckpt-*.index"))
                or any(tf.io.gfile.exists(os.path.join(model_dir, name))
                       for name in (WEIGHTS_FILE, BEST_WEIGHTS_FILE)))


def finished_run(model_dir: str, total_steps: int) -> dict | None:
    """The final metrics of a run in model_dir that has trained `total_steps` steps
    or more (or was stopped early by a callback) and written its final outputs;
    None if there is none (or it is not finished): a rerun of a finished run
    changes nothing."""
    path = os.path.join(model_dir, METRICS_FILE)
    if not (tf.io.gfile.exists(path)
            and tf.io.gfile.exists(os.path.join(model_dir, WEIGHTS_FILE))):
        return None
    try:
        metrics = files.read_json(path, dict)
    except files.BadFileError:
        return None
    done = metrics.get("status") == "done" and (int(metrics.get("steps", -1)) >= total_steps
                                                or bool(metrics.get("stopped_early")))
    return metrics if done else None


def step_of(checkpoint_path: str) -> int:
    """The step of a checkpoint path (DIR/ckpt-300: 300)."""
    return int(checkpoint_path.rsplit("-", 1)[-1])


def weights_to_serve(model_dir: str) -> tuple[str | None, str]:
    """Which weights predict and export serve, by the run's state: (file name, or
    None for the newest checkpoint; the line that says why). A finished run's
    model.weights.h5 (its metrics.json "done", no checkpoint newer); any other
    (stopped, diverged, failed, still training, resumed past its old end) its
    best.weights.h5, else its newest checkpoint, never an older finished file."""
    try:
        metrics = files.read_json(os.path.join(model_dir, METRICS_FILE), dict)
    except files.BadFileError:
        metrics = {}
    latest = tf.train.latest_checkpoint(model_dir)
    status, steps = metrics.get("status"), metrics.get("steps")
    has = lambda name: tf.io.gfile.exists(os.path.join(model_dir, name))  # noqa: E731
    if has(WEIGHTS_FILE) and (status == "done" or not metrics) and (
            latest is None or (isinstance(steps, int) and step_of(latest) <= steps)):
        return WEIGHTS_FILE, "" if status == "done" else (
            f"{WEIGHTS_FILE} (the run has no readable {METRICS_FILE} to say it finished)")
    if status == "done" and not has(WEIGHTS_FILE):
        why = f"the run has no {WEIGHTS_FILE}"
    else:
        state = (f"its {METRICS_FILE} says {status!r}" + (f" at step {steps}"
                 if isinstance(steps, int) and status != "done" else "")
                 if status else f"it has no readable {METRICS_FILE}")
        if status == "done" and latest:  # (a resumed run that wrote no "running")
            state += f", its newest checkpoint is step {step_of(latest)}'s"
        why = f"the run has not finished: {state}" + (
            f"; its {WEIGHTS_FILE} is an earlier end's" if has(WEIGHTS_FILE) else "")
    if has(BEST_WEIGHTS_FILE):
        best = metrics.get("best_step")
        return BEST_WEIGHTS_FILE, (f"{BEST_WEIGHTS_FILE} ("
                                   f"{f'step {best}; ' if best is not None else ''}{why})")
    return None, why


def weights_h5_bytes(model) -> bytes:
    """The bytes of `model.save_weights(path)`'s .weights.h5 file, made in memory:
    h5py writing straight to a full disk leaves half a file or crashes the process
    (exit 139). Keras' own writer, reached through its private saving_lib
    (tests/test_checkpoints.py fails loudly if an upgrade changes it)."""
    from keras.src.saving import saving_lib  # private, see above
    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    saving_lib._save_state(model, weights_store=store, assets_store=None,  # noqa: SLF001
                           inner_path="", visited_saveables=set())
    store.close()
    return buffer.getvalue()


class NonFiniteError(RuntimeError):
    """A weight is NaN or infinite: nothing was written (the loop: exit status 3)."""


def check_finite(named_variables: list, what: str, step: int | None = None) -> None:
    """NonFiniteError naming the first variables holding a NaN or an infinity, so
    that no checkpoint, weights file or export ever holds one."""
    bad = state_lib.nonfinite_names(named_variables)
    if bad:
        at = f" at step {step}" if step is not None else ""
        raise NonFiniteError(f"{len(bad)} variable(s) hold a NaN or an infinity{at} "
                             f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                             f"{what} not written")


def save_weights(model, path: str) -> None:
    """`model.save_weights(path)` whole or not at all (any gfile path): on failure
    WriteError names the file, and the previous file of that name is intact. A
    non-finite weight: NonFiniteError, nothing written."""
    check_finite([(v.path, v) for v in model.weights], os.path.basename(path))
    files.write_atomically(path, weights_h5_bytes(model))


def training_checkpoint(state, callbacks=None) -> tf.train.Checkpoint:
    """Everything needed to continue a run exactly: the whole TrainState
    (trainer/state.py): every model and its random-number generators' state
    (dropout), every optimizer's state, the extras, and the run's one step counter
    (also the data position, see data/pipeline.py); to save, also the run's
    callbacks' state (trainer/callbacks.py; restored by restore_callbacks, so a
    checkpoint from before they had any still restores the state)."""
    return tf.train.Checkpoint(**state.trackables(),
                               **({CALLBACKS: callbacks} if callbacks is not None else {}))


CALLBACKS = "callbacks"


def restore_callbacks(callbacks, path: str) -> bool:
    """The callbacks' state saved in checkpoint `path` (trainer/callbacks.py:
    `Callbacks.restored` says whether it held any); False with a warning if not
    (saved before they had any: they start afresh)."""
    tf.train.Checkpoint(**{CALLBACKS: callbacks}).restore(path).expect_partial()
    if not callbacks.restored:
        logging.warning("checkpoint %s holds no callback state; the callbacks (early "
                        "stopping, ...) start afresh", path)
    return callbacks.restored


def resume(state, callbacks, model_dir: str, keep: int, is_chief: bool = True,
           task_id: int = 0, asynchronous: bool = False):
    """The manager of the run's one checkpoint (the whole state and the callbacks'
    state), the newest readable checkpoint in model_dir restored into it, if any;
    with `asynchronous`, a BackgroundSaver over it. Call under the strategy's
    scope."""
    checkpoint = training_checkpoint(state, callbacks)
    # The state first, alone: a checkpoint from before the callbacks had state
    # still fits it; then the callbacks' state, if the file holds any.
    restored = restore_latest(training_checkpoint(state), model_dir, partial=True)
    if restored:
        logging.info("Resumed from %s at step %d", restored, int(state.step.numpy()))
        restore_callbacks(callbacks, restored)
    manager = make_manager(model_dir, checkpoint, keep, is_chief, task_id)
    return BackgroundSaver(manager, keep) if asynchronous else manager


def make_manager(model_dir: str, checkpoint: tf.train.Checkpoint, keep: int,
                 is_chief: bool = True, task_id: int = 0) -> tf.train.CheckpointManager:
    """A CheckpointManager following TF's multi-worker rules.

    Every worker must call save() (it is a collective), but only the chief's files
    are kept; the others write to a private temporary directory.
    """
    directory = model_dir if is_chief else os.path.join(
        model_dir, ".worker_tmp", f"worker_{task_id}")
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=keep)


def candidates(model_dir: str) -> list[str]:
    """The checkpoints listed in model_dir's index, newest first; the ckpt-N files
    themselves if the index is missing or unreadable (never start afresh over them)."""
    state = tf.train.get_checkpoint_state(model_dir)
    if state is None:
        paths = [p[:-len(".index")] for p in
                 tf.io.gfile.glob(os.path.join(model_dir, "ckpt-*.index"))]
    else:
        paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
        if state.model_checkpoint_path not in paths:
            paths.append(state.model_checkpoint_path)
    # The index may hold absolute paths of a directory that was moved: use names.
    paths = [os.path.join(model_dir, os.path.basename(p)) for p in paths]
    return sorted(paths, key=step_of, reverse=True)


def restore_latest(checkpoint: tf.train.Checkpoint, model_dir: str,
                   partial: bool = False) -> str | None:
    """Restores the newest readable checkpoint in model_dir, if any; returns its path.
    partial: `checkpoint` holds only part of the run's state (e.g. the output model
    to serve), and the rest of the file is not wanted (no warnings about it).

    An unreadable one is skipped with a warning naming it. A checkpoint of another
    model, or none readable at all, is a one-line CheckpointError.
    """
    paths = candidates(model_dir)
    for path in paths:
        try:
            status = checkpoint.restore(path)
            if partial:
                status.expect_partial()
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run's state "
                f"({_first_line(err)}); use another --model_dir (the checkpoint is left "
                f"untouched)") from err
        except UNREADABLE as err:
            logging.warning("checkpoint %s is unreadable (%s: %s); trying the one "
                            "before it", path, type(err).__name__,
                            str(err).splitlines()[0][:200] if str(err) else "")
            continue
        if path != paths[0]:
            logging.warning("%s is the newest readable checkpoint: using it", path)
        return path
    if paths:
        names = ", ".join(os.path.basename(p) for p in paths)
        raise CheckpointError(
            f"no checkpoint in {model_dir} is readable ({names}); restore them from a "
            f"backup, or use another --model_dir to start afresh")
    return None


def _first_line(error: BaseException) -> str:
    """What an unmatched restore says, short: the variables the checkpoint lacks."""
    text = str(error)
    missing = [line.strip() for line in text.splitlines() if "<tf.Variable" in line
               or "Unresolved object" in line]
    if missing:
        names = [line.split("'")[1] if "'" in line else line for line in missing[:3]]
        return (f"it lacks {len(missing)} of the state's variables, e.g. "
                f"{', '.join(names)}: a task, model or setting that adds state")
    return text.splitlines()[0][:300] if text else type(error).__name__


def check_same_step(strategy: tf.distribute.Strategy, step: int) -> None:
    """Every worker restored the same step (one may have fallen back past a checkpoint
    it could not read): else a one-line CheckpointError on every worker, instead of
    collectives that no longer match."""
    mine = tf.constant([float(step)])  # float32 is exact to 16.7M steps
    steps = strategy.gather(strategy.run(lambda: tf.identity(mine)), axis=0).numpy()
    if steps.min() != steps.max():
        raise CheckpointError(
            f"the workers resumed from different checkpoints (this one at step {step}; "
            f"a checkpoint may be unreadable for some of them); check the warnings and "
            f"rerun the same command")


def save(manager, step: int, state=None, wait: bool = False) -> None:
    """Saves a checkpoint of `step` with the run's manager (a CheckpointManager, or
    a BackgroundSaver, which writes it in the background unless `wait`), given the
    state only if every value in it is finite: else NonFiniteError, nothing
    written. On failure (no space, no permission, ...) the half-written files are
    removed and CheckpointSaveError names the directory and the last good
    checkpoint, which is untouched."""
    if state is not None:
        check_finite(state.compared_variables(), f"the checkpoint of step {step}", step)
    if isinstance(manager, BackgroundSaver):
        manager.save(step)
        if wait:
            manager.finish()
        return
    try:
        manager.save(checkpoint_number=step)
    except (tf.errors.OpError, OSError) as err:
        raise _save_failed(manager.directory, step, files.reason_of(err),
                           manager.latest_checkpoint) from err


def _save_failed(directory: str, step: int, reason: str, last: str | None
                 ) -> CheckpointSaveError:
    """The error of a failed save of `step`, its temporaries removed (a
    CheckpointManager's `ckpt-N_temp`, a BackgroundSaver's `ckpt-N.*.tmp-<hex>`:
    only this writer writes ckpt-N in its directory)."""
    for name in tf.io.gfile.listdir(directory) if tf.io.gfile.isdir(directory) else []:
        name = name.rstrip("/")
        if name == f"ckpt-{step}_temp" or (name.startswith(f"ckpt-{step}.")
                                           and ".tmp-" in name):
            path = os.path.join(directory, name)
            (tf.io.gfile.rmtree if tf.io.gfile.isdir(path) else tf.io.gfile.remove)(path)
    # "{{function_node ...}} /dir/ckpt-4_temp/...; File too large" -> the cause
    return CheckpointSaveError(
        f"could not save the checkpoint of step {step} in {directory} ({reason}); "
        f"the last good checkpoint is {last or 'none'}: free space or fix the "
        f"permissions, then rerun the same command to resume from it")


class BackgroundSaver:
    """--async_checkpoints: a save copies the state into host memory (a checkpoint
    written to TensorFlow's `ram://` file system, while the steps wait), and a
    thread of its own copies those files into the run directory while the next
    steps run: each file to a temporary name of its own, then renamed, the data
    before the index, so a checkpoint is listed only whole; then the index file
    lists it and the oldest beyond `keep` are removed. At most one write is in
    flight: the next save, and `finish()`, wait for it, and a write that failed
    is raised there as the CheckpointSaveError of its own step (its temporaries
    removed; the checkpoints before it intact). Every worker saves at the same
    step, as with the manager (the copy to memory is the same collective save)."""

    def __init__(self, manager: tf.train.CheckpointManager, keep: int):
        self.manager, self.keep = manager, keep
        self.directory = manager.directory
        self._stage = f"ram://tfloop-checkpoints-{os.getpid()}-{id(self):x}"
        self._thread: threading.Thread | None = None
        self._writing: int | None = None  # the step of the write in flight
        self._error: BaseException | None = None

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint saved or being saved (its files may still be
        being written: `finish()` first to read it)."""
        if self._writing is not None:
            return os.path.join(self.directory, f"ckpt-{self._writing}")
        return tf.train.latest_checkpoint(self.directory)

    def save(self, step: int) -> None:
        self.finish()
        checkpoint = self.manager.checkpoint
        checkpoint.save_counter.assign_add(1)  # (as the manager's save: restore reads it)
        staged = checkpoint.write(f"{self._stage}/ckpt-{step}")
        self._writing = step
        self._thread = threading.Thread(target=self._persist, args=(staged, step),
                                        daemon=True, name=f"write ckpt-{step}")
        self._thread.start()

    def finish(self) -> None:
        """Waits for the write in flight; its failure is raised here."""
        if self._thread is None:
            return
        self._thread.join()
        step, error = self._writing, self._error
        self._thread, self._writing, self._error = None, None, None
        if error is not None:
            raise _save_failed(self.directory, step, files.reason_of(error),
                               tf.train.latest_checkpoint(self.directory)) from error

    def _persist(self, staged: str, step: int) -> None:
        try:
            names = [os.path.basename(p) for p in tf.io.gfile.glob(staged + ".*")]
            tf.io.gfile.makedirs(self.directory)
            for name in sorted(names, key=lambda n: n.endswith(".index")):  # index last
                final = os.path.join(self.directory, name)
                temporary = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
                tf.io.gfile.copy(os.path.join(self._stage, name), temporary)
                tf.io.gfile.rename(temporary, final, overwrite=True)
            self._list(step)
        except BaseException as err:  # noqa: BLE001 (raised by finish, in the loop)
            self._error = err
        finally:
            for path in tf.io.gfile.glob(staged + ".*"):
                tf.io.gfile.remove(path)

    def _list(self, step: int) -> None:
        """The index file lists the newest `keep` checkpoints (written whole,
        atomically, by TensorFlow); then the older ones' files are removed."""
        steps = sorted({step_of(p[:-len(".index")]) for p in
                        tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*.index"))})
        kept = [os.path.join(self.directory, f"ckpt-{s}") for s in steps[-self.keep:]]
        tf.compat.v1.train.update_checkpoint_state(self.directory, kept[-1], kept)
        for old in steps[:-self.keep]:
            for path in tf.io.gfile.glob(os.path.join(self.directory, f"ckpt-{old}.*")):
                tf.io.gfile.remove(path)


def finish_writes(manager) -> None:
    """No background write left in flight (a BackgroundSaver's: its failure is
    raised here); a CheckpointManager has none."""
    if isinstance(manager, BackgroundSaver):
        manager.finish()


@contextlib.contextmanager
def writes_finished(manager) -> Iterator[None]:
    """A block after which no background write is left running. Left by an error,
    a write that failed too is only logged: the first error is the one to see."""
    try:
        yield
    except BaseException:
        try:
            finish_writes(manager)
        except CheckpointSaveError as err:
            logging.warning("%s", err)
        raise
    finish_writes(manager)
