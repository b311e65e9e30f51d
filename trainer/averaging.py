"""Weight averaging (an exponential moving average of the trainable weights).

The optimizer keeps the average (Keras' `use_ema`, updated after every applied
step, under any distribution strategy) and the checkpoint saves it with the
optimizer. Training always continues from the raw weights; evaluation and the
final `model.weights.h5` use the average, swapped in only for that moment.

Batch-norm running statistics are not averaged: with the fast recipe's low
batch-norm momentum they track the last few hundred images of the raw weights,
which are close to the average at the end of a decaying schedule.
"""
import contextlib
from typing import Callable

import keras
import tensorflow as tf


def _averaging_optimizer(optimizer: keras.optimizers.Optimizer):
    """The optimizer holding the average (inside a LossScaleOptimizer, if any)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return inner if getattr(inner, "use_ema", False) else None


def enabled(optimizer: keras.optimizers.Optimizer) -> bool:
    return _averaging_optimizer(optimizer) is not None


@contextlib.contextmanager
def averaged_weights(optimizer: keras.optimizers.Optimizer):
    """Within the block the model's trainable weights hold their average; after
    it, exactly (bitwise) the raw weights again. A no-op without averaging.

    Runs eagerly in the cross-replica context: an assign there writes every
    replica's copy, and no variable is created.
    """
    inner = _averaging_optimizer(optimizer)
    if inner is None:
        yield
        return
    # Keras private attributes, also used by its own SwapEMAWeights callback.
    pairs = [(var, average) for var, average in zip(
        inner._trainable_variables, inner._model_variables_moving_average)  # noqa: SLF001
        if average is not None]
    raw = [tf.identity(var.value) for var, _ in pairs]
    for var, average in pairs:
        var.assign(average.value)
    try:
        yield
    finally:
        for (var, _), value in zip(pairs, raw):
            var.assign(value)


def evaluate_raw_and_averaged(evaluate: Callable[[], dict],
                              optimizer: keras.optimizers.Optimizer) -> dict:
    """`evaluate()` of the averaged weights, plus `*_raw` keys for the raw ones, so
    a run shows what the averaging gained. Without averaging: `evaluate()`."""
    if not enabled(optimizer):
        return evaluate()
    raw = evaluate()
    with averaged_weights(optimizer):
        averaged = evaluate()
    return {**averaged, "test_accuracy_raw": raw["test_accuracy"],
            "test_loss_raw": raw["test_loss"]}
