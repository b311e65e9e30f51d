"""The distribution wrapper: run a per-replica step on every replica, N steps per call.

It runs whatever per-replica function it is given (`fn(batch) -> {name: (total,
weight)}`, see trainer/step.py) and knows nothing of what the step computes. One
`tf.function` call runs `num_steps` steps in an in-graph loop (fewer Python round
trips; on a TPU one host call per loop); `num_steps` is a tensor, so a shorter last
loop does not retrace.
"""
from typing import Callable

import numpy as np
import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM
Sums = dict[str, tuple[tf.Tensor, tf.Tensor]]


def _run_steps(strategy: tf.distribute.Strategy, replica_fn: Callable, iterator,
               num_steps: tf.Tensor) -> Sums:
    """`num_steps` steps; every (total, weight) summed over replicas and steps."""
    def one_step():
        per_replica = strategy.run(replica_fn, args=(next(iterator),))
        # SUM over replicas: each returned totals over its own share of the batch.
        return tf.nest.map_structure(lambda t: strategy.reduce(SUM, t, axis=None),
                                     per_replica)

    totals = one_step()  # the first step fixes the structure the step returns
    for _ in tf.range(num_steps - 1):
        totals = tf.nest.map_structure(tf.add, totals, one_step())
    return totals


def _maybe_jit(replica_fn: Callable, jit_compile: bool) -> Callable:
    # XLA-compile the replica's step, as Keras' own fit() does. (On a TPU the whole
    # loop is compiled anyway: callers pass False there.)
    return tf.function(replica_fn, jit_compile=True) if jit_compile else replica_fn


def make_train_loop(strategy: tf.distribute.Strategy, replica_fn: Callable,
                    jit_compile: bool = False) -> Callable:
    """Returns train_loop(iterator, num_steps, stop_flag) -> (sums, stop_requested).

    stop_flag (a float tensor, 1.0 after SIGTERM on this worker) is summed across
    workers, so a stop request on any worker reaches every worker and all of them
    stop at the same step (a worker stopping alone would hang the others).
    """
    replica_fn = _maybe_jit(replica_fn, jit_compile)

    @tf.function
    def train_loop(iterator, num_steps: tf.Tensor, stop_flag: tf.Tensor):
        sums = _run_steps(strategy, replica_fn, iterator, num_steps)
        stop = strategy.reduce(SUM, strategy.run(lambda: tf.identity(stop_flag)),
                               axis=None)
        return sums, stop

    return train_loop


def make_eval_loop(strategy: tf.distribute.Strategy, replica_fn: Callable,
                   jit_compile: bool = False) -> Callable:
    """Returns eval_loop(iterator, num_steps) -> sums."""
    replica_fn = _maybe_jit(replica_fn, jit_compile)

    @tf.function
    def eval_loop(iterator, num_steps: tf.Tensor) -> Sums:
        return _run_steps(strategy, replica_fn, iterator, num_steps)

    return eval_loop


def means(sums: Sums) -> dict[str, float]:
    """total / weight of every scalar metric (0 where nothing was counted)."""
    return {key: float(total) / float(weight) if float(weight) else 0.0
            for key, (total, weight) in sums.items() if np.size(total) == 1}
