"""The distribution wrapper: run the per-replica steps on every replica, N at a time.

One `tf.function` call runs `num_steps` steps in an in-graph loop (fewer Python
round trips; on a TPU, one host call per loop instead of per step). `num_steps` is
a tensor, so a shorter last loop does not retrace.
"""
from typing import Callable

import tensorflow as tf

from trainer import step

Sums = dict[str, tf.Tensor]


def _zeros() -> Sums:
    return {key: tf.constant(0.0) for key in step.METRIC_KEYS}


def _run_and_sum(strategy: tf.distribute.Strategy, replica_fn: Callable,
                 batch, totals: Sums) -> Sums:
    per_replica = strategy.run(replica_fn, args=batch)
    # SUM, not MEAN: every replica returned sums over its own examples.
    return {key: totals[key] + strategy.reduce(tf.distribute.ReduceOp.SUM,
                                               per_replica[key], axis=None)
            for key in step.METRIC_KEYS}


def _make_loop(strategy: tf.distribute.Strategy, replica_fn: Callable,
               jit_compile: bool) -> Callable:
    if jit_compile:  # XLA-compile the replica's step, as Keras' own fit() does
        replica_fn = tf.function(replica_fn, jit_compile=True)

    @tf.function
    def loop(iterator, num_steps: tf.Tensor) -> Sums:
        totals = _zeros()
        for _ in tf.range(num_steps):
            totals = _run_and_sum(strategy, replica_fn, next(iterator), totals)
        return totals

    return loop


def make_train_loop(strategy: tf.distribute.Strategy, model, optimizer,
                    global_batch_size: int, jit_compile: bool) -> Callable:
    """Returns train_loop(iterator, num_steps) -> metric sums over those steps."""
    def replica_fn(images, labels):
        return step.train_step(model, optimizer, images, labels, global_batch_size)
    return _make_loop(strategy, replica_fn, jit_compile)


def make_eval_loop(strategy: tf.distribute.Strategy, model,
                   jit_compile: bool) -> Callable:
    """Returns eval_loop(iterator, num_steps) -> masked metric sums."""
    def replica_fn(images, labels, mask):
        return step.eval_step(model, images, labels, mask)
    return _make_loop(strategy, replica_fn, jit_compile)
