"""The distribution wrapper: run the per-replica steps on every replica, N at a time.

One `tf.function` call runs up to `num_steps` steps in an in-graph loop (fewer
Python round trips; on a TPU, one host call per loop instead of per step).
`num_steps` is a tensor, so a shorter last loop does not retrace.
"""
from typing import Callable

import tensorflow as tf

from trainer import step

Sums = dict[str, tf.Tensor]
SUM = tf.distribute.ReduceOp.SUM


def _make_loop(strategy: tf.distribute.Strategy, replica_fn: Callable,
               shapes: dict[str, tuple], jit_compile: bool, training: str = "") -> Callable:
    """shapes: the shape of each sum replica_fn returns (() for scalars).
    training: "" (evaluation), "skip_step" or "stop_on_nonfinite" (return right
    after a non-finite loss). Training loops also sum the stop-request flag across
    workers; evaluation needs neither."""
    if jit_compile:  # XLA-compile the replica's step, as Keras' own fit() does
        replica_fn = tf.function(replica_fn, jit_compile=True)

    @tf.function
    def loop(iterator, num_steps: tf.Tensor, stop_flag: tf.Tensor = 0.0) -> Sums:
        totals = {key: tf.zeros(shape) for key, shape in shapes.items()}
        steps_run = tf.constant(0)
        for _ in tf.range(num_steps):
            per_replica = strategy.run(replica_fn, args=next(iterator))
            # SUM, not MEAN: every replica returned sums over its own examples.
            totals = {key: totals[key] + strategy.reduce(SUM, per_replica[key], axis=None)
                      for key in shapes}
            steps_run += 1
            # Every worker sees the same reduced loss, so all of them stop together.
            if training == "stop_on_nonfinite" and not tf.math.is_finite(
                    totals["loss_sum"]):
                break
        if not training:
            return {**totals, "steps": steps_run}
        # A stop request (SIGTERM) on any worker reaches every worker via this sum.
        stop = strategy.reduce(SUM, strategy.run(lambda: tf.identity(stop_flag)),
                               axis=None)
        return {**totals, "steps": steps_run, "stop_requested": stop}

    return loop


def make_train_loop(strategy: tf.distribute.Strategy, model, optimizer,
                    global_batch_size: int, jit_compile: bool,
                    on_nan: str = "stop", label_smoothing: float = 0.0) -> Callable:
    """Returns train_loop(iterator, num_steps) -> metric sums and `steps` run.

    on_nan="stop": the loop returns right after a step with a non-finite loss (its
    update was applied; the caller keeps the last checkpoint). "skip_step": such a
    step's update is dropped on every replica and counted in `skipped`.
    """
    skip = on_nan == "skip_step"

    def replica_fn(images, labels):
        return step.train_step(model, optimizer, images, labels, global_batch_size,
                               skip_nonfinite=skip, label_smoothing=label_smoothing)
    return _make_loop(strategy, replica_fn, dict.fromkeys(step.TRAIN_KEYS, ()), jit_compile,
                      training="skip_step" if skip else "stop_on_nonfinite")


def make_eval_loop(strategy: tf.distribute.Strategy, model, jit_compile: bool,
                   tta_flip: bool = False, confusion_classes: int = 0) -> Callable:
    """Returns eval_loop(iterator, num_steps) -> masked metric sums (and the summed
    `confusion` matrix if confusion_classes > 0)."""
    def replica_fn(images, labels, mask):
        return step.eval_step(model, images, labels, mask, tta_flip, confusion_classes)
    shapes = dict.fromkeys(step.METRIC_KEYS, ())
    if confusion_classes:
        shapes["confusion"] = (confusion_classes, confusion_classes)
    return _make_loop(strategy, replica_fn, shapes, jit_compile)
