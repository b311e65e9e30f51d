"""What ONE replica does with its slice of the global batch: the training math.

Edit this file to change how a step trains (a second pass, a new gradient
transformation, a new step setting); edit the run's task (trainer/tasks/) to change
what it optimizes and measures (the loss, the metrics, evaluation). A new step
setting is a field of `StepOptions` (filled from the Config field of the same name,
so add that too, with its help text: the flag comes from it) and its use below.
A new metric is one more key in the dict a step returns: the log line,
TensorBoard and metrics.json show every key. Check a changed step with
`python -m trainer.check_step`.

Batches are dicts from the data pipeline: "image", "label" (int; a task that reads
no labels ignores it), optionally "target" (soft targets [B, classes], from mixup)
and, in evaluation, "mask" (0 for padding).
Metrics are (total, weight) pairs summed over replicas and steps; what is shown is
total / weight, so sums over examples and per-step values (`per_step`) both come
out right.
"""
import dataclasses

import keras
import tensorflow as tf

from trainer import averaging, distributed, optimizers
from trainer.tasks import Task
from trainer.tasks.base import Metric  # (total, weight): shown as total / weight

SUM = tf.distribute.ReduceOp.SUM
STEP_METRICS = ("loss", "grad_norm", "skipped")  # the step's own


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The step's settings. Each field is filled from the Config field of the same
    name (see the flag help in trainer/config.py); the rest are derived."""
    batch_size: int                   # GLOBAL batch, summed over replicas
    clip_grad_norm: float = 0.0       # of the summed gradient; 0: off
    grad_accum_steps: int = 1         # micro-batches per replica batch
    sam_rho: float = 0.0              # SAM's step uphill; 0: off
    lookahead_every: int = 0          # pull to the slow weights every k steps; 0: off
    lookahead_decay: float = 0.95     # per step, compounded over k steps
    total_steps: int = 0              # of the run (the Lookahead's schedule)

    @classmethod
    def from_config(cls, config, **derived) -> "StepOptions":
        """Every field from the Config field of its name, or from `derived`."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(derived) - {n for n in names if hasattr(config, n)}
        if missing - {"total_steps"}:  # a typo would silently keep the default
            raise ValueError(f"StepOptions fields without a Config field of the same "
                             f"name: {sorted(missing)}; add them to trainer/config.py")
        return cls(**{**{n: getattr(config, n) for n in names if hasattr(config, n)},
                      **derived})


def per_step(value) -> Metric:
    """A metric that is one value per step, the same on every replica (computed
    after the all-reduce, like grad_norm): shown as that value, averaged over the
    steps of a log line. Python numbers are fine."""
    return tf.cast(value, tf.float32), tf.constant(1.0)


def _mean_over_global_batch(per_example_loss: tf.Tensor, options: StepOptions):
    # Divide by the GLOBAL batch, not this replica's share: the replicas' gradients
    # are summed, so the sum is the gradient of the global-batch mean.
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=options.batch_size)


def _forward_backward(model, optimizer, task: Task, batch: dict, options: StepOptions):
    """This replica's gradient of its part of the global mean loss, and its metrics."""
    with tf.GradientTape() as tape:
        outputs = model(batch["image"], training=True)
        per_example_loss, metrics = task.loss(batch, outputs)
        loss = _mean_over_global_batch(per_example_loss, options)
        if model.losses:  # weight regularizers: every replica and micro-batch adds them
            loss += tf.nn.scale_regularization_loss(
                tf.add_n(model.losses)) / options.grad_accum_steps
        # Identity, except under mixed_float16: scaled up so float16 gradients do not
        # underflow (unscaled after the sum, below).
        scaled_loss = optimizer.scale_loss(loss)
    gradients = tape.gradient(scaled_loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    count = tf.reduce_sum(tf.ones_like(per_example_loss))
    metrics = distributed.summable(metrics, f"task {task.name}'s loss", STEP_METRICS)
    return gradients, {"loss": (tf.reduce_sum(per_example_loss), count), **metrics}


def moving_statistics(model: keras.Model) -> list:
    """The non-trainable float state a forward pass updates (batch-norm's moving
    mean and variance); not the random generators' state."""
    return [v for v in model.non_trainable_variables
            if v.dtype.startswith("float") and "seed_generator" not in v.path]


def replica_gradients(model, optimizer, task: Task, batch: dict, options: StepOptions):
    """THIS replica's gradient of its part of the global mean loss (not summed
    over replicas yet), in grad_accum_steps micro-batches, and its metric sums."""
    steps = options.grad_accum_steps
    if steps == 1:
        return _forward_backward(model, optimizer, task, batch, options)
    micro = {key: tf.reshape(t, [steps, -1, *t.shape[1:]]) for key, t in batch.items()}
    gradients, sums = _forward_backward(
        model, optimizer, task, {key: t[0] for key, t in micro.items()}, options)
    for i in tf.range(1, steps):  # a graph loop: one micro-batch in memory at a time
        more, more_sums = _forward_backward(
            model, optimizer, task, {key: t[i] for key, t in micro.items()}, options)
        gradients = [g + m for g, m in zip(gradients, more)]
        sums = tf.nest.map_structure(tf.add, sums, more_sums)
    return gradients, sums


def summed_gradients(model, optimizer, task: Task, batch: dict, options: StepOptions):
    """(gradient of the GLOBAL batch's mean loss, this replica's metric sums).

    THE all-reduce. After it every replica holds the same gradient; anything that
    must see the whole batch's gradient (its norm, clipping, the finite check, a
    second pass) comes after it."""
    gradients, sums = replica_gradients(model, optimizer, task, batch, options)
    gradients = tf.distribute.get_replica_context().all_reduce(SUM, gradients)
    return optimizers.unscale(optimizer, gradients), sums  # (mixed_float16 only)


def gradient_at_offset(model, optimizer, task: Task, batch: dict, options: StepOptions,
                       offsets: list, finite: tf.Tensor) -> list:
    """The summed gradient at the weights + `offsets` (one per trainable variable):
    a second forward and backward pass, for steps that take a gradient at perturbed
    weights (SAM and its family). Afterwards the weights are bitwise what they were
    and batch-norm's moving statistics hold only the first pass's update. Where
    `finite` (the first gradient's) is false no offset is applied, so no NaN
    reaches the weights and the step stays skippable."""
    weights, statistics = model.trainable_variables, moving_statistics(model)
    kept_weights = [tf.identity(w) for w in weights]
    kept_statistics = [tf.identity(v) for v in statistics]
    for weight, offset in zip(weights, offsets):
        weight.assign_add(tf.where(finite, tf.cast(offset, weight.dtype),
                                   tf.zeros_like(weight)))
    gradients, _ = summed_gradients(model, optimizer, task, batch, options)
    for variable, kept in zip(weights + statistics, kept_weights + kept_statistics):
        variable.assign(kept)
    return gradients


def sam_gradient(model, optimizer, task: Task, batch: dict, options: StepOptions,
                 gradients: list, grad_norm: tf.Tensor, finite: tf.Tensor):
    """Sharpness-aware minimization (Foret et al. 2021): the summed gradient at
    w + rho * g / ||g||, with g the summed gradient and its GLOBAL norm, so every
    replica moves its weights alike. Returns (that gradient, its norm: what
    clipping and the log see, whether both gradients are finite)."""
    scale = options.sam_rho / (grad_norm + 1e-12)
    gradients = gradient_at_offset(model, optimizer, task, batch, options,
                                   [scale * g for g in gradients], finite)
    grad_norm = tf.linalg.global_norm(gradients)
    return gradients, grad_norm, tf.logical_and(finite, tf.math.is_finite(grad_norm))


def all_finite(variables: list) -> tf.Tensor:
    """Whether every value of every variable is finite (one bool)."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])


def train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer, task: Task,
               batch: dict, options: StepOptions) -> dict[str, Metric]:
    """Forward, backward, the cross-replica sum, one update; on one replica."""
    # Batch-norm updates its moving statistics in the forward pass, before anyone
    # knows whether the gradient is finite: keep them, to undo a skipped step's.
    statistics = moving_statistics(model)
    kept_statistics = [tf.identity(v) for v in statistics]
    gradients, sums = summed_gradients(model, optimizer, task, batch, options)
    grad_norm = tf.linalg.global_norm(gradients)
    finite = tf.math.is_finite(grad_norm)  # the same on every replica

    if options.sam_rho:  # SAM: the gradient again, at the weights moved rho uphill
        gradients, grad_norm, finite = sam_gradient(model, optimizer, task, batch,
                                                    options, gradients, grad_norm, finite)

    if options.clip_grad_norm:
        gradients, _ = tf.clip_by_global_norm(gradients, options.clip_grad_norm,
                                              use_norm=grad_norm)
    # One update, the same on every replica (the optimizer does not sum again), or
    # none for a non-finite gradient; optimizer.iterations counts the step either way.
    # A finite gradient can still overflow a weight (a huge learning rate): then the
    # whole update is undone too, so no checkpoint ever holds a non-finite weight.
    state = model.trainable_variables + optimizers.float_state(optimizer)
    kept_state = [tf.identity(v) for v in state]
    optimizers.apply_or_skip(optimizer, gradients, model.trainable_variables, finite)
    gradient_finite, finite = finite, tf.logical_and(finite, all_finite(state))
    for variable, kept in zip(state + statistics, kept_state + kept_statistics):
        variable.assign(tf.where(finite, variable, kept))
    if options.lookahead_every:  # airbench: every k steps, back to the slow weights
        averaging.lookahead_step(optimizer, options.lookahead_every,
                                 options.lookahead_decay, options.total_steps)

    applied = tf.cast(finite, tf.float32)
    skipped = 1.0 - applied
    if optimizers.loss_scaled(optimizer):  # a gradient overflow at a finite loss is
        loss_total = tf.distribute.get_replica_context().all_reduce(  # the loss
            SUM, sums["loss"][0])                                     # scale's business
        scale_only = tf.logical_and(tf.logical_not(gradient_finite),
                                    tf.math.is_finite(loss_total))
        skipped *= 1.0 - tf.cast(scale_only, tf.float32)
    # A skipped step's examples are not counted in the metrics.
    return {**{key: (tf.where(finite, total, tf.zeros_like(total)),
                     weight * tf.cast(applied, weight.dtype))
               for key, (total, weight) in sums.items()},
            "grad_norm": (tf.where(finite, grad_norm, tf.zeros_like(grad_norm)), applied),
            "skipped": per_step(skipped)}


def eval_step(model: keras.Model, task: Task, batch: dict) -> dict[str, Metric]:
    """The task's evaluation metrics on one replica; padded examples (mask 0)
    count 0."""
    predictions = task.predict(model, batch["image"])
    return task.eval_metrics(batch, predictions, tf.cast(batch["mask"], tf.float32))
