"""A run directory's settings and starts.

A run directory is one run. It records its settings in `run_config.json` beside
the checkpoints, once, and every start in `run_history.json` (what it changed, the
command, the code and versions, the host and devices). A new start on that
directory must train what the run trained: the same model on the same data with
the same settings, but for those that may change on a resume (train longer, log,
evaluate or save at other steps: each setting's `resume` rule, trainer/settings.py);
else it stops with one line listing each difference, before touching anything.
--resume_with_changes continues on purpose (recorded, run_config.json never
rewritten). A folder that is not a run, or a symbolic link inside one, is refused:
nothing outside the run's directory is written or deleted.
"""
import json
import os

from absl import logging
import tensorflow as tf

from data import files
from trainer import config as config_lib, run_settings
from trainer.output import console
from trainer.checkpoints import (RUN_CONFIG, RUN_HISTORY, CheckpointError,
                                 trained_nothing, written_by_a_run)

# What may be in a directory before its run_config.json: the lock (trainer/locks.py),
# other workers' checkpoint copies, the schedule plot (trainer.main --plot_schedule);
# and the workers' log files (trainer/output/console.py).
_NOT_A_RUNS_OWN = ("writer.lock", ".worker_tmp", "lr_schedule.png")


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
            changed = _changes_listed(run_settings.differences(read_run_config(model_dir), run_config))
            logging.info("%s holds the settings of start(s) that kept no step (no "
                         "checkpoint, no weights): this start begins the run afresh%s",
                         model_dir, f" with other settings ({changed})" if changed else "")
        if afresh or not tf.io.gfile.exists(config_path):
            files.write_json(config_path, run_config)
        history = [] if afresh else _read_history(model_dir)
        history.append({"start": len(history) + 1, **(provenance or {}),
                        "changed": {key: [before, now] for key, before, now in changes}})
        files.write_json(os.path.join(model_dir, RUN_HISTORY), history)


def check_previous_run(model_dir: str, run_config: dict
                       ) -> list[tuple[str, object, object]]:
    """CheckpointError (one line) unless model_dir is new or empty, or holds a run
    this one may continue: the same model, task, data and optimizer (what its
    checkpoints depend on), and the same value of every setting that changes what
    is trained (all but a setting's `resume` rule), unless this run says
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
                  if (files.final_name(n.rstrip("/")) not in (*_NOT_A_RUNS_OWN, RUN_CONFIG)
                      and not console.is_log_file(files.final_name(n.rstrip("/"))))
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
            # (What the checkpoint's variables depend on, config.NEVER_CHANGED; unset
            # and empty are the same: runs older than a setting saved none.)
            *((k, _value(run_config, k), _value(recorded, k))
              for k in config_lib.NEVER_CHANGED),
            *((f"{k} > 0", bool(run_config.get(k)), bool(recorded.get(k)))
              for k in config_lib.NEVER_SWITCHED)]:
        if now != before:
            raise CheckpointError(
                f"--model_dir={model_dir} holds a run with {key}="
                f"{files.shorter(repr(before), 60)}, not {files.shorter(repr(now), 60)}; "
                f"use another --model_dir (the existing checkpoint is left untouched)")
    changes = run_settings.differences(recorded, run_config)
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


def _value(run_config: dict, key: str):
    """A run_config.json value as JSON holds it; unset and empty are the same (runs
    from before a setting existed saved none: their task was classification)."""
    value = json.loads(json.dumps(run_config.get(key))) or None
    return value or ("classification" if key == "task" else None)
