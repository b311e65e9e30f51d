"""Checkpoints in --model_dir: save, resume, and refuse a directory of another run.

A run records its config in `run_config.json` beside the checkpoints. A new run on
that directory must train the same model on the same data, or it stops before
touching anything: a user's checkpoint is never overwritten by a different model.
"""
import json
import os

import tensorflow as tf

RUN_CONFIG = "run_config.json"
_MUST_MATCH = ("model", "model_size", "dataset")


class CheckpointError(RuntimeError):
    """--model_dir cannot be used; the message says why and what to do."""


def prepare_model_dir(model_dir: str, run_config: dict, is_chief: bool = True) -> None:
    """Creates model_dir (if writable) and checks any previous run in it matches."""
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create --model_dir={model_dir}: {err.strerror}; "
                              f"choose a writable directory") from err
    if not os.access(model_dir, os.W_OK | os.X_OK):
        raise CheckpointError(f"--model_dir={model_dir} is not writable; choose "
                              f"another directory")
    path = os.path.join(model_dir, RUN_CONFIG)
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        for key in _MUST_MATCH:
            if previous.get(key) != run_config.get(key):
                raise CheckpointError(
                    f"--model_dir={model_dir} holds a run with {key}="
                    f"{previous.get(key)!r}, not {run_config.get(key)!r}; use another "
                    f"--model_dir (the existing checkpoint is left untouched)")
    if is_chief:
        with open(path, "w") as f:
            json.dump(run_config, f, indent=2, sort_keys=True)


def training_checkpoint(model, optimizer) -> tf.train.Checkpoint:
    """Everything needed to continue a run exactly: weights, optimizer state with
    `optimizer.iterations`, the run's one step counter (also the data position, see
    data/pipeline.py), and the state of the model's random-number generators
    (dropout), which Keras 3 keeps in variables that a tf.train.Checkpoint of the
    model alone does not save."""
    rng_states = [v.value for v in model.variables if "seed_generator_state" in v.path]
    return tf.train.Checkpoint(model=model, optimizer=optimizer, rng=rng_states)


def make_manager(model_dir: str, checkpoint: tf.train.Checkpoint, keep: int,
                 is_chief: bool = True, task_id: int = 0) -> tf.train.CheckpointManager:
    """A CheckpointManager following TF's multi-worker rules.

    Every worker must call save() (it is a collective), but only the chief's files
    are kept; the others write to a private temporary directory.
    """
    directory = model_dir if is_chief else os.path.join(
        model_dir, ".worker_tmp", f"worker_{task_id}")
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=keep)


def restore_latest(checkpoint: tf.train.Checkpoint, model_dir: str) -> str | None:
    """Restores the newest checkpoint in model_dir, if any; returns its path."""
    path = tf.train.latest_checkpoint(model_dir)
    if path is None:
        return None
    try:
        checkpoint.restore(path).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({str(err).splitlines()[0]}); "
            f"use another --model_dir (the checkpoint is left untouched)") from err
    return path
