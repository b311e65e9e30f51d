"""Weight averaging: an exponential moving average of the trainable weights
(--ema_decay, evaluated instead of the weights), and Lookahead (--lookahead_every,
which pulls the weights themselves back to a slow average).

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

from trainer.settings import ConfigError


def _averaging_optimizer(optimizer: keras.optimizers.Optimizer):
    """The optimizer holding the average (inside a LossScaleOptimizer, if any)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return inner if getattr(inner, "use_ema", False) else None


def enabled(optimizer: keras.optimizers.Optimizer) -> bool:
    return _averaging_optimizer(optimizer) is not None


def _optimizers(state_or_optimizer) -> list:
    """The optimizers of a TrainState, or [the optimizer]."""
    found = getattr(state_or_optimizer, "optimizers", None)
    if found is None:
        return [state_or_optimizer]
    return [o for o in found.values() if o is not None]


@contextlib.contextmanager
def averaged_weights(state_or_optimizer):
    """Within the block the trainable weights of every optimizer with averaging (of
    a TrainState, or one optimizer) hold their average; after it, exactly
    (bitwise) the raw weights again. A no-op without averaging."""
    with contextlib.ExitStack() as stack:
        for optimizer in _optimizers(state_or_optimizer):
            stack.enter_context(_averaged_weights(optimizer))
        yield


@contextlib.contextmanager
def _averaged_weights(optimizer: keras.optimizers.Optimizer):
    """Within the block the optimizer's trainable weights hold their average; after
    it, exactly (bitwise) the raw weights again. A no-op without averaging.

    Runs eagerly in the cross-replica context: an assign there writes every
    replica's copy, and no variable is created.
    """
    inner = _averaging_optimizer(optimizer)
    if inner is None or int(inner.iterations.numpy()) == 0:
        # (Keras fills the average at an optimizer's first update: before it, zeros.
        # An optimizer a schedule has not run yet, a backbone's in a head phase, is
        # evaluated with its raw weights, which are its initial ones.)
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


def evaluate_raw_and_averaged(evaluate: Callable[[], dict], state_or_optimizer) -> dict:
    """`evaluate()` of the averaged weights, plus `test_<metric>_raw` for the raw
    ones' scalar metrics, so a run shows what the averaging gained. Without
    averaging: `evaluate()`."""
    if not any(enabled(o) for o in _optimizers(state_or_optimizer)):
        return evaluate()
    raw = evaluate()
    with averaged_weights(state_or_optimizer):
        averaged = evaluate()
    return {**averaged, **{f"{key}_raw": value for key, value in raw.items()
                           if key.startswith("test_") and key != "test_examples"
                           and isinstance(value, float)}}


# --- Lookahead (airbench's scheduled averaging) -------------------------------------

def add_lookahead(optimizer: keras.optimizers.Optimizer, variables: list) -> None:
    """Gives the optimizer a slow copy of each of `variables` (the trainable weights
    and batch-norm statistics), starting equal to them: optimizer variables, so the
    checkpoint saves them with the optimizer. Call under the strategy's scope."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    slow = []
    for variable in variables:
        copy = inner.add_variable_from_reference(variable, "lookahead")
        copy.assign(variable)
        slow.append(copy)
    inner._lookahead = _Pairs(list(zip(variables, slow)))  # noqa: SLF001


class _Pairs:
    """The (fast, slow) pairs, held where Keras' attribute tracking cannot see them:
    a plain list would make the model's weights the optimizer's variables too."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs


def lookahead_decay(step: tf.Tensor, every: int, decay_per_step: float,
                    total_steps: int) -> tf.Tensor:
    """The slow weights' decay at `step`: decay_per_step ** every * (step / total)^3,
    which grows from 0 (the slow weights follow the fast ones early) to ~0.77 for
    airbench's (5, 0.95)."""
    progress = tf.cast(step, tf.float32) / float(total_steps)
    return decay_per_step ** every * progress ** 3


def lookahead_step(optimizer: keras.optimizers.Optimizer, every: int,
                   decay_per_step: float, total_steps: int) -> None:
    """After the update of the run's step t (counted from 1: the run's step counter,
    which the wrapper advances after the step, plus one; without one, the
    optimizer's own update count), in a replica context:
    every `every` steps, slow <- slow + (1 - decay) (fast - slow), and the fast
    weights jump to it; at the last step they take the slow weights (as airbench).
    Each replica pulls its own copies, no all-reduce: the weights are equal on all
    replicas, and batch-norm statistics are each replica's own, as in training."""
    if total_steps <= 0:
        raise ConfigError("lookahead needs the run's total_steps (the decay grows as "
                         "(step / total_steps)^3); StepOptions.total_steps is 0")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    run_step = getattr(inner, "_run_step", None)  # (optimizers.create sets it)
    step = run_step.value + 1 if run_step is not None else inner.iterations
    on_schedule = tf.equal(step % every, 0)
    due = tf.logical_or(on_schedule, step >= total_steps)
    decay = tf.where(on_schedule, lookahead_decay(step, every, decay_per_step,
                                                  total_steps), 1.0)

    def pull() -> tf.Tensor:
        for fast, slow in inner._lookahead.pairs:  # noqa: SLF001
            pulled = slow + (1.0 - tf.cast(decay, slow.dtype)) * (fast - slow)
            slow.assign(pulled)
            fast.assign(pulled)
        return tf.constant(True)

    with tf.name_scope("lookahead"):  # so the profile's optimizer row counts it
        tf.cond(due, pull, lambda: tf.constant(False))
