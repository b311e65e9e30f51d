"""Optimizers by name, and how the training step applies an update.

The step (trainer/step.py) sums the gradients over replicas itself, where a reader
sees it, so the optimizers made here apply the gradient they are given: Keras'
own cross-replica sum inside `apply` is switched off (`_SummedGradients`).
`optimizer.iterations` is the run's one step counter: the learning-rate schedule,
the data position, checkpoints and logs all read it, and a skipped update still
advances it (its batch was consumed).
"""
import fnmatch

import keras
import tensorflow as tf

NAMES = ("adam", "adamw", "sgd")


class _SummedGradients:
    """Mixin for a Keras optimizer whose gradients arrive already summed over the
    replicas: without it, `apply` inside a replica context would all-reduce them a
    second time (Keras 3 has no switch for this; the sum lives in one method).
    Also: per-variable learning-rate multipliers (`set_lr_multipliers`)."""

    _lr_multipliers: tuple[float, ...] = ()  # by variable index; () for all 1

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return grads_and_vars

    def set_lr_multipliers(self, multipliers: list[float]) -> None:
        """The learning rate of variable i (in build order) times multipliers[i].
        Decoupled weight decay is not multiplied (as in airbench)."""
        self._lr_multipliers = tuple(multipliers)

    def update_step(self, gradient, variable, learning_rate):
        if self._lr_multipliers:
            factor = self._lr_multipliers[self._get_variable_index(variable)]
            if factor != 1.0:
                learning_rate = learning_rate * factor
        return super().update_step(gradient, variable, learning_rate)


class Adam(_SummedGradients, keras.optimizers.Adam):
    pass


class AdamW(_SummedGradients, keras.optimizers.AdamW):
    pass


class SGD(_SummedGradients, keras.optimizers.SGD):
    pass


def parse_lr_multipliers(text: str) -> list[tuple[str, float]]:
    """'*/beta=64,whiten/*=0' -> [('*/beta', 64.0), ('whiten/*', 0.0)]; ValueError
    if malformed."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, _, factor = item.rpartition("=")
        try:
            pairs.append((pattern, float(factor)))
        except ValueError:
            pattern = ""
        if not pattern or pairs[-1][1] < 0:
            raise ValueError(f"--lr_multipliers: {item!r} is not PATTERN=FACTOR with a "
                             f"factor >= 0 (e.g. '*/beta=64')")
    return pairs


def lr_multipliers(variables: list, pairs: list[tuple[str, float]]) -> list[float]:
    """Each variable's multiplier: that of the first glob pattern matching its path
    (e.g. 'batch_normalization_3/beta'), else 1. A pattern matching nothing is a
    ValueError (a typo would silently change nothing)."""
    factors, used = [], set()
    for variable in variables:
        factor = 1.0
        for pattern, value in pairs:
            if fnmatch.fnmatchcase(variable.path, pattern):
                factor = value
                used.add(pattern)
                break
        factors.append(factor)
    unused = [pattern for pattern, _ in pairs if pattern not in used]
    if unused:
        raise ValueError(f"--lr_multipliers: {', '.join(unused)} match(es) no trainable "
                         f"variable; paths look like {variables[0].path!r}")
    return factors


def create(name: str, learning_rate, variables, weight_decay: float = 0.0,
           momentum: float = 0.9, precision: str = "float32",
           ema_decay: float = 0.0, lr_multipliers_text: str = ""
           ) -> keras.optimizers.Optimizer:
    """Builds and *builds* the optimizer (slot variables exist before the first step).

    Call inside `strategy.scope()`: Keras 3 optimizers must create their slots there,
    or the first distributed update fails (keras-team/keras#23085).
    Weight decay is decoupled (AdamW style) and skips 1-D variables: biases and
    batch-norm scales/offsets. ema_decay > 0 keeps a moving average of the weights
    (see trainer/averaging.py).
    """
    decay = weight_decay or None
    ema = dict(use_ema=ema_decay > 0, ema_momentum=ema_decay)
    if name == "adam":
        optimizer = Adam(learning_rate, weight_decay=decay, **ema)
    elif name == "adamw":
        optimizer = AdamW(learning_rate, weight_decay=weight_decay, **ema)
    elif name == "sgd":
        optimizer = SGD(learning_rate, momentum=momentum, nesterov=True,
                        weight_decay=decay, **ema)
    else:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(NAMES)}")
    if lr_multipliers_text:
        optimizer.set_lr_multipliers(
            lr_multipliers(variables, parse_lr_multipliers(lr_multipliers_text)))
    if weight_decay:
        optimizer.exclude_from_weight_decay(var_list=[v for v in variables
                                                      if len(v.shape) <= 1])
    if precision == "mixed_float16":
        # float16 gradients underflow: the loss is scaled up, the summed gradients
        # unscaled (`unscale`), and the scale adapts (`apply_or_skip`).
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(variables)
    return optimizer


def loss_scaled(optimizer: keras.optimizers.Optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def unscale(optimizer: keras.optimizers.Optimizer, gradients: list) -> list:
    """Gradients of the scaled loss -> gradients of the loss (mixed_float16)."""
    if not loss_scaled(optimizer):
        return gradients
    return [g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in gradients]


def apply_or_skip(optimizer: keras.optimizers.Optimizer, gradients: list, variables,
                  apply: tf.Tensor) -> None:
    """In a replica context: applies `gradients` (summed over replicas, unscaled) if
    `apply` (a bool that is the same on every replica), else leaves the weights and
    optimizer state alone. Either way optimizer.iterations advances by one. Under
    loss scaling the scale doubles after `dynamic_growth_steps` good steps and
    halves at a skipped one, as Keras' LossScaleOptimizer does.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)

    def update_loss_scale(apply):
        if inner is optimizer:
            return
        scale, counter = optimizer.dynamic_scale, optimizer.step_counter
        grow = tf.logical_and(apply, counter + 1 >= optimizer.dynamic_growth_steps)
        scale.assign(tf.where(apply, tf.where(grow, scale * 2.0, scale), scale / 2.0))
        counter.assign(tf.where(tf.logical_and(apply, tf.logical_not(grow)),
                                counter + 1, tf.zeros_like(counter)))

    def skip():
        inner.iterations.assign_add(1)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        # e.g. XLA on GPUs: no merge_call, a plain cond in the replica context.
        tf.cond(apply, lambda: inner.apply(gradients, variables), skip)
        update_loss_scale(apply)
        return

    # A cond whose branch updates mirrored variables must run in the cross-replica
    # context (a merge_call), each branch going back to the replicas to apply.
    def cross_replica(strategy, apply, gradients):
        apply = strategy.experimental_local_results(apply)[0]
        tf.cond(apply,
                lambda: strategy.extended.call_for_each_replica(
                    lambda grads: inner.apply(grads, variables), args=(gradients,)),
                skip)
        update_loss_scale(apply)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(apply, gradients))
