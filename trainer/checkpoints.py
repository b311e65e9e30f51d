"""Checkpoints in --model_dir: save, resume, and refuse a directory of another run.

A run directory is one run. It records its settings in `run_config.json` beside
the checkpoints, once, and every start in `run_history.json` (what it changed, the
command, the code and versions, the host and devices). A new start on that
directory must train what the run trained: the same model on the same data with
the same settings, but for those that may change on a resume (train longer, log,
evaluate or save at other steps: config.MAY_CHANGE_ON_RESUME); else it stops with
one line listing each difference, before touching anything. --resume_with_changes
continues on purpose (recorded, run_config.json never rewritten). A folder that is
not a run, or a symbolic link inside one, is refused: nothing outside the run's
directory is written or deleted.

A bad disk loses at most the checkpoint it broke: an unreadable newest checkpoint
(truncated by a crash during a copy, a full network disk) is named in a warning and
the run resumes from the newest readable one; a save that fails (no space, no
permission) leaves no temporary files and stops the run with one line naming the
directory and the last good checkpoint (CheckpointSaveError).
"""
import dataclasses
import io
import json
import os

from absl import logging
import tensorflow as tf

from data import files
from trainer import config as config_lib, state as state_lib

RUN_CONFIG = "run_config.json"      # the settings, as the run started: never rewritten
RUN_HISTORY = "run_history.json"    # every start: what it changed, where it ran
METRICS_FILE = "metrics.json"       # (trainer/output/recorder.py writes it)
WEIGHTS_FILE = "model.weights.h5"       # the final (evaluated) weights
BEST_WEIGHTS_FILE = "best.weights.h5"   # the weights of the best evaluation
# What the checkpoint's variables depend on: another value would restore wrong
# slots (Keras numbers the optimizer's variables; the EMA's come first). Unset and
# empty are the same (runs older than a setting saved none).
_MUST_MATCH = ("task", "model", "model_size", "dataset", "optimizer", "model_options",
               "optimizer_options")
# Settings whose on/off (> 0 or not) decides whether their variables exist.
_MUST_MATCH_ON = ("ema_decay", "lookahead_every")
# What may be in a directory before its run_config.json: the lock (trainer/locks.py),
# other workers' checkpoint copies, the schedule plot (trainer.main --plot_schedule).
_NOT_A_RUNS_OWN = ("writer.lock", ".worker_tmp", "lr_schedule.png")


class CheckpointError(RuntimeError):
    """--model_dir cannot be used; the message says why and what to do."""


class CheckpointSaveError(files.WriteError):
    """A checkpoint could not be written; the earlier ones are intact."""


# What reading a truncated or corrupt checkpoint raises (a short data file gives a
# Python IndexError, "Read less bytes than requested").
UNREADABLE = (IndexError, tf.errors.DataLossError, tf.errors.OutOfRangeError,
               tf.errors.NotFoundError, tf.errors.InvalidArgumentError,
               tf.errors.UnknownError)


def prepare_model_dir(model_dir: str, run_config: dict, is_chief: bool = True,
                      provenance: dict | None = None) -> None:
    """Creates model_dir (if writable), checks any previous run in it
    (`check_previous_run`), and records this start: the settings in run_config.json
    the first time (never rewritten), and every start, with what it changed and
    where it ran (`provenance`), in run_history.json. Any TensorFlow filesystem works
    (a local path, gs://..., ram://...)."""
    try:
        tf.io.gfile.makedirs(model_dir)
    except tf.errors.OpError as err:
        reason = (err.message or "").rsplit(";", 1)[-1].strip()
        raise CheckpointError(f"cannot create --model_dir={model_dir}: {reason}; "
                              f"choose a writable directory") from err
    if "://" not in model_dir and not os.access(model_dir, os.W_OK | os.X_OK):
        raise CheckpointError(f"--model_dir={model_dir} is not writable; choose "
                              f"another directory")
    changes = check_previous_run(model_dir, run_config)
    if is_chief:  # atomic: other workers read it
        # What a killed writer left half-written (a ckpt-N_temp, a file's .tmp-...):
        # never a complete file. Safe: this process holds the directory (locks.py).
        removed = files.remove_stale_temporaries(model_dir, written_by_a_run)
        if removed:
            logging.info("removed %d temporary file(s) a killed run left in %s: %s",
                         len(removed), model_dir, ", ".join(sorted(removed)))
        config_path = os.path.join(model_dir, RUN_CONFIG)
        afresh = tf.io.gfile.exists(config_path) and trained_nothing(model_dir)
        if afresh:  # a start stopped or killed before its first checkpoint
            changed = _changes_listed(differences(read_run_config(model_dir), run_config))
            logging.info("%s holds the settings of start(s) that kept no step (no "
                         "checkpoint, no weights): this start begins the run afresh%s",
                         model_dir, f" with other settings ({changed})" if changed else "")
        if afresh or not tf.io.gfile.exists(config_path):
            files.write_json(config_path, run_config)
        history = [] if afresh else _read_history(model_dir)
        history.append({"start": len(history) + 1, **(provenance or {}),
                        "changed": {key: [before, now] for key, before, now in changes}})
        files.write_json(os.path.join(model_dir, RUN_HISTORY), history)


def written_by_a_run(name: str) -> bool:
    """Whether a run's commands write files of this name in its directory (their
    temporaries, `<name>.tmp-<hex>`, are the run's): its records (.json, log.csv),
    weights (.weights.h5), figures (.png) and lock. A user's `notes.tmp-<hex>` is
    not. tests/test_nothing_lost.py checks every file a finished run leaves."""
    return name in ("writer.lock", "log.csv") or name.endswith(
        (".json", ".weights.h5", ".png"))


def comparable_settings(run_config: dict) -> dict:
    """Every setting of a run, flat (its task's own too), as JSON holds them: the
    defaults of those an older run_config.json lacks filled in."""
    try:
        config = config_lib.from_dict(run_config)
        values = {**config.as_dict(), **dataclasses.asdict(config.task_options())}
    except (ValueError, TypeError, RuntimeError):  # (ConfigError: a task unknown here)
        values = {**run_config, **(run_config.get("task_settings") or {})}
    values.pop("task_settings", None)
    return json.loads(json.dumps(values))


def differences(recorded: dict, run_config: dict) -> list[tuple[str, object, object]]:
    """(setting, recorded value, this run's value) for each setting that differs,
    the task's own settings included."""
    before, now = comparable_settings(recorded), comparable_settings(run_config)
    return [(key, before.get(key), now.get(key)) for key in dict.fromkeys([*before, *now])
            if before.get(key) != now.get(key)]


def check_previous_run(model_dir: str, run_config: dict
                       ) -> list[tuple[str, object, object]]:
    """CheckpointError (one line) unless model_dir is new or empty, or holds a run
    this one may continue: the same model, task, data and optimizer (what its
    checkpoints depend on), and the same value of every setting that changes what
    is trained (all but config.MAY_CHANGE_ON_RESUME), unless this run says
    resume_with_changes. A folder of other files (no run_config.json) is refused.
    Returns the settings this start changes. Reads only: called before the
    expensive set-up, and again before writing."""
    files.refuse_links(model_dir, flag="--model_dir")  # (before anything is read)
    if not tf.io.gfile.exists(os.path.join(model_dir, RUN_CONFIG)):
        # (A temporary of run_config.json: the chief writing it as this worker
        # looks; a new run, as the chief's. Seen in the suite: "holds files that
        # are not a run's (run_config.json.tmp-...)"; the 2-worker run failed.)
        others = [n.rstrip("/") for n in (tf.io.gfile.listdir(model_dir)
                                          if tf.io.gfile.isdir(model_dir) else [])
                  if files.final_name(n.rstrip("/")) not in (*_NOT_A_RUNS_OWN, RUN_CONFIG)
                  or n.rstrip("/") == RUN_CONFIG]
        if RUN_CONFIG not in others:  # (else another worker, the chief, wrote it
            if others:  # between the two looks: it is checked as any run's below)
                listed = ", ".join(sorted(others)[:4]) + (", ..." if len(others) > 4
                                                          else "")
                raise CheckpointError(
                    f"--model_dir={model_dir} holds files that are not a run's "
                    f"({listed}) and no {RUN_CONFIG}; give a new or empty directory "
                    f"(nothing in it was touched)")
            return []
    if trained_nothing(model_dir):  # (its settings are replaced: prepare_model_dir)
        return []
    recorded = read_run_config(model_dir)
    for key, now, before in [
            *((k, _value(run_config, k), _value(recorded, k)) for k in _MUST_MATCH),
            *((f"{k} > 0", bool(run_config.get(k)), bool(recorded.get(k)))
              for k in _MUST_MATCH_ON)]:
        if now != before:
            raise CheckpointError(
                f"--model_dir={model_dir} holds a run with {key}="
                f"{files.shorter(repr(before), 60)}, not {files.shorter(repr(now), 60)}; "
                f"use another --model_dir (the existing checkpoint is left untouched)")
    changes = differences(recorded, run_config)
    trained = [c for c in changes if c[0] not in config_lib.MAY_CHANGE_ON_RESUME]
    if trained and not run_config.get("resume_with_changes"):
        listed = _changes_listed(trained)
        raise CheckpointError(
            f"--model_dir={model_dir} holds a run trained with other settings ({listed});"
            f" use another --model_dir (without --model_dir each setting gets its own), "
            f"or add --resume_with_changes to continue this run with them (recorded in "
            f"{RUN_HISTORY}; nothing was touched)")
    return changes


def _changes_listed(changes: list[tuple[str, object, object]]) -> str:
    """'--learning_rate: 0.001 -> 0.01, ...', each value cut to 60 characters."""
    return ", ".join(f"--{key}: {_shown(before)} -> {_shown(now)}"
                     for key, before, now in changes)


def _shown(value) -> str:
    return "(unset)" if value is None else files.shorter(str(value), 60)


def trained_nothing(model_dir: str) -> bool:
    """Whether no step of the run in model_dir was kept: no checkpoint and no
    weights file (its starts were stopped, or killed, before their first one). Such
    a directory is not yet a run: a start with other settings begins it afresh."""
    return not (tf.io.gfile.glob(os.path.join(model_dir, "ckpt-*.index"))
                or any(tf.io.gfile.exists(os.path.join(model_dir, name))
                       for name in (WEIGHTS_FILE, BEST_WEIGHTS_FILE)))


def _read_history(model_dir: str) -> list:
    path = os.path.join(model_dir, RUN_HISTORY)
    if not tf.io.gfile.exists(path):
        return []
    try:
        return files.read_json(path, list)
    except files.BadFileError as err:
        raise CheckpointError(f"{err}; restore it from a backup, or use another "
                              f"--model_dir") from err


def read_run_config(model_dir: str, flag: str = "--model_dir") -> dict:
    """The settings of a run directory: run_config.json (as the run started) with
    the changes later starts made (--resume_with_changes, longer training; in
    run_history.json). CheckpointError (one line) if it is missing, half written or
    not a run's config (no model, dataset)."""
    path = os.path.join(model_dir, RUN_CONFIG)
    try:
        settings = files.read_json(path, dict, keys=("model", "dataset"))
    except files.BadFileError as err:
        advice = (f"{flag} must be a training run's directory" if "not found" in str(err)
                  else f"restore it from a backup, or use another {flag}")
        raise CheckpointError(f"{err}; {advice}") from err
    for start in _read_history(model_dir):
        for key, (_, now) in (start.get("changed") or {}).items():
            if key in config_lib.FLAG_FIELDS:
                settings[key] = now
            else:  # one of the task's own
                settings["task_settings"] = {**(settings.get("task_settings") or {}),
                                             key: now}
    return settings


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


def _value(run_config: dict, key: str):
    """A run_config.json value as JSON holds it; unset and empty are the same (runs
    from before a setting existed saved none: their task was classification)."""
    value = json.loads(json.dumps(run_config.get(key))) or None
    return value or ("classification" if key == "task" else None)


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


def make_manager(model_dir: str, checkpoint: tf.train.Checkpoint, keep: int,
                 is_chief: bool = True, task_id: int = 0) -> tf.train.CheckpointManager:
    """A CheckpointManager following TF's multi-worker rules.

    Every worker must call save() (it is a collective), but only the chief's files
    are kept; the others write to a private temporary directory.
    """
    directory = model_dir if is_chief else os.path.join(
        model_dir, ".worker_tmp", f"worker_{task_id}")
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=keep)


def _candidates(model_dir: str) -> list[str]:
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
    candidates = _candidates(model_dir)
    for path in candidates:
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
        if path != candidates[0]:
            logging.warning("resuming from %s, the newest readable checkpoint", path)
        return path
    if candidates:
        names = ", ".join(os.path.basename(p) for p in candidates)
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


def save(manager: tf.train.CheckpointManager, step: int, state=None) -> None:
    """Saves a checkpoint of `step` (given the state, only if every value in it is
    finite: else NonFiniteError, nothing written). On failure (no space, no
    permission, ...) the half-written `*_temp` directory is removed and
    CheckpointSaveError names the directory and the last good checkpoint, which is
    untouched."""
    if state is not None:
        check_finite(state.compared_variables(), f"the checkpoint of step {step}", step)
    try:
        manager.save(checkpoint_number=step)
    except (tf.errors.OpError, OSError) as err:
        directory = manager.directory
        for name in tf.io.gfile.listdir(directory) if tf.io.gfile.isdir(directory) else []:
            if name.rstrip("/").endswith(f"ckpt-{step}_temp"):  # this save's, not a
                tf.io.gfile.rmtree(os.path.join(directory, name))  # peer's
        last = manager.latest_checkpoint
        # "{{function_node ...}} /dir/ckpt-4_temp/...; File too large" -> the cause
        reason = files.reason_of(err)
        raise CheckpointSaveError(
            f"could not save the checkpoint of step {step} in {directory} ({reason}); "
            f"the last good checkpoint is {last or 'none'}: free space or fix the "
            f"permissions, then rerun the same command to resume from it") from err
