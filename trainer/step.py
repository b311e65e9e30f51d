"""What ONE replica does with its slice of the global batch: the training math.

Edit this file to change training. A new step setting is a field of `StepOptions`
(filled from the Config field of the same name, so add that too, with its help
text: the flag comes from it) and its use below; nothing else needs to change. A new
metric is one more key in the dict a step returns: the log line, TensorBoard and
metrics.json show every key. Check a changed step with `python -m trainer.check_step`.

Batches are dicts: "image", "label" (int class), optionally "target" (soft targets
[B, classes], e.g. from mixup) and, in evaluation, "mask" (0 for padding).
A model returns logits, or a dict with "logits" (and e.g. "aux_logits").
Metrics are (total, weight) pairs summed over replicas and steps; what is shown is
total / weight, so sums over examples and per-step values both come out right.
"""
import dataclasses
from typing import Any

import keras
import tensorflow as tf

from trainer import averaging, optimizers

Metric = tuple[tf.Tensor, tf.Tensor]  # (total, weight): shown as total / weight
SUM = tf.distribute.ReduceOp.SUM


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The step's settings. Each field is filled from the Config field of the same
    name (see the flag help in trainer/config.py); the rest are derived."""
    batch_size: int                   # GLOBAL batch, summed over replicas
    label_smoothing: float = 0.0
    clip_grad_norm: float = 0.0       # of the summed gradient; 0: off
    grad_accum_steps: int = 1         # micro-batches per replica batch
    aux_loss_weight: float = 0.3      # for a model's "aux_logits" output
    lookahead_every: int = 0          # pull to the slow weights every k steps; 0: off
    lookahead_decay: float = 0.95     # per step, compounded over k steps
    total_steps: int = 0              # of the run (the Lookahead's schedule)
    tta_flip: bool = False            # evaluation: average with the mirror image
    tta_translate: bool = False       # ... and the 1-pixel shifted views
    confusion_classes: int = 0        # evaluation: a confusion matrix if > 0

    @classmethod
    def from_config(cls, config, **derived) -> "StepOptions":
        """Every field from the Config field of its name, or from `derived`."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(derived) - {n for n in names if hasattr(config, n)}
        if missing - {"confusion_classes", "total_steps"}:  # a typo would silently keep the default
            raise ValueError(f"StepOptions fields without a Config field of the same "
                             f"name: {sorted(missing)}; add them to trainer/config.py")
        return cls(**{**{n: getattr(config, n) for n in names if hasattr(config, n)},
                      **derived})


def logits_of(outputs) -> tf.Tensor:
    """The main head's float32 logits, whatever the model returns."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
    return tf.cast(logits, tf.float32)


def loss_fn(batch: dict, outputs, options: StepOptions) -> tf.Tensor:
    """Per-example loss: cross-entropy of the logits against the targets (soft
    targets if the batch has them, else the labels), plus the weighted loss of an
    auxiliary head if the model has one."""
    logits = logits_of(outputs)
    targets = batch.get("target")
    if targets is None and not options.label_smoothing:
        return _cross_entropy(batch["label"], logits, 0.0, outputs, options)
    if targets is None:
        targets = tf.one_hot(batch["label"], tf.shape(logits)[-1])
    return _cross_entropy(targets, logits, options.label_smoothing, outputs, options)


def _cross_entropy(targets, logits, smoothing, outputs, options):
    def one_head(logits):
        if targets.dtype.is_integer:
            return keras.losses.sparse_categorical_crossentropy(targets, logits,
                                                                from_logits=True)
        return keras.losses.categorical_crossentropy(targets, logits, from_logits=True,
                                                     label_smoothing=smoothing)
    loss = one_head(logits)
    if isinstance(outputs, dict) and "aux_logits" in outputs:
        loss += options.aux_loss_weight * one_head(tf.cast(outputs["aux_logits"],
                                                           tf.float32))
    return loss


def _mean_over_global_batch(per_example_loss: tf.Tensor, options: StepOptions):
    # Divide by the GLOBAL batch, not this replica's share: the replicas' gradients
    # are summed, so the sum is the gradient of the global-batch mean.
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=options.batch_size)


def _forward_backward(model, optimizer, batch: dict, options: StepOptions):
    """This replica's gradient of its part of the global mean loss, and its metrics."""
    with tf.GradientTape() as tape:
        outputs = model(batch["image"], training=True)
        per_example_loss = loss_fn(batch, outputs, options)
        loss = _mean_over_global_batch(per_example_loss, options)
        if model.losses:  # weight regularizers: every replica and micro-batch adds them
            loss += tf.nn.scale_regularization_loss(
                tf.add_n(model.losses)) / options.grad_accum_steps
        # Identity, except under mixed_float16: scaled up so float16 gradients do not
        # underflow (unscaled after the sum, below).
        scaled_loss = optimizer.scale_loss(loss)
    gradients = tape.gradient(scaled_loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return gradients, _sums(per_example_loss, logits_of(outputs), batch["label"])


def _sums(per_example_loss, logits, labels, weights=None) -> dict[str, Metric]:
    """Loss and accuracy (against the hard label) summed over the examples."""
    weights = tf.ones_like(per_example_loss) if weights is None else weights
    hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels),
                   tf.float32)
    count = tf.reduce_sum(weights)
    return {"loss": (tf.reduce_sum(per_example_loss * weights), count),
            "accuracy": (tf.reduce_sum(hits * weights), count)}


def moving_statistics(model: keras.Model) -> list:
    """The non-trainable float state a forward pass updates (batch-norm's moving
    mean and variance); not the random generators' state."""
    return [v for v in model.non_trainable_variables
            if v.dtype.startswith("float") and "seed_generator" not in v.path]


def _micro_batch_gradients(model, optimizer, batch: dict, options: StepOptions):
    """The gradient over this replica's batch, in grad_accum_steps micro-batches."""
    steps = options.grad_accum_steps
    if steps == 1:
        return _forward_backward(model, optimizer, batch, options)
    micro = {key: tf.reshape(t, [steps, -1, *t.shape[1:]]) for key, t in batch.items()}
    gradients, sums = _forward_backward(
        model, optimizer, {key: t[0] for key, t in micro.items()}, options)
    for i in tf.range(1, steps):  # a graph loop: one micro-batch in memory at a time
        more, more_sums = _forward_backward(
            model, optimizer, {key: t[i] for key, t in micro.items()}, options)
        gradients = [g + m for g, m in zip(gradients, more)]
        sums = tf.nest.map_structure(tf.add, sums, more_sums)
    return gradients, sums


def train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer, batch: dict,
               options: StepOptions) -> dict[str, Metric]:
    """Forward, backward, the cross-replica sum, one update; on one replica."""
    # Batch-norm updates its moving statistics in the forward pass, before anyone
    # knows whether the gradient is finite: keep them, to undo a skipped step's.
    statistics = moving_statistics(model)
    kept_statistics = [tf.identity(v) for v in statistics]
    gradients, sums = _micro_batch_gradients(model, optimizer, batch, options)

    # THE all-reduce. After this line every replica holds the same gradient: that of
    # the global-batch mean loss. Anything that must see the whole batch's gradient
    # (unscaling, its norm, clipping, the finite check) comes after it.
    replica = tf.distribute.get_replica_context()
    gradients = replica.all_reduce(SUM, gradients)
    gradients = optimizers.unscale(optimizer, gradients)  # mixed_float16 only
    grad_norm = tf.linalg.global_norm(gradients)
    finite = tf.math.is_finite(grad_norm)  # the same on every replica
    if options.clip_grad_norm:
        gradients, _ = tf.clip_by_global_norm(gradients, options.clip_grad_norm,
                                              use_norm=grad_norm)

    # One update, the same on every replica (the optimizer does not sum again), or
    # none for a non-finite gradient; optimizer.iterations counts the step either way.
    optimizers.apply_or_skip(optimizer, gradients, model.trainable_variables, finite)
    for variable, kept in zip(statistics, kept_statistics):
        variable.assign(tf.where(finite, variable, kept))
    if options.lookahead_every:  # airbench: every k steps, back to the slow weights
        averaging.lookahead_step(optimizer, options.lookahead_every,
                                 options.lookahead_decay, options.total_steps)

    applied = tf.cast(finite, tf.float32)
    skipped = 1.0 - applied
    if optimizers.loss_scaled(optimizer):  # an overflow at a finite loss is the loss
        loss_total = replica.all_reduce(SUM, sums["loss"][0])  # scale's business
        skipped *= 1.0 - tf.cast(tf.math.is_finite(loss_total), tf.float32)
    # A skipped step's examples are not counted in the loss and accuracy.
    return {**{key: (tf.where(finite, total, 0.0), weight * applied)
               for key, (total, weight) in sums.items()},
            "grad_norm": (tf.where(finite, grad_norm, 0.0), applied),
            "skipped": (skipped, tf.constant(1.0))}


def tta_of(settings: Any) -> dict[str, bool]:
    """The test-time augmentation settings of a Config or a run_config.json dict,
    as keyword arguments of `predict_logits`."""
    get = settings.get if isinstance(settings, dict) else lambda k: getattr(settings, k)
    return {name: bool(get(name)) for name in ("tta_flip", "tta_translate")}


def predict_logits(model: keras.Model, images: tf.Tensor, tta_flip: bool = False,
                   tta_translate: bool = False) -> tf.Tensor:
    """float32 logits of the main head; with tta_flip, averaged with the mirror
    image's; with tta_translate too, airbench's multi-crop: half that, half the
    mean of the same for the image shifted one pixel up-left and down-right
    (reflect-padded). Evaluation, predict and export all use this."""
    def flip_averaged(images):
        logits = logits_of(model(images, training=False))
        if tta_flip:
            logits = (logits + logits_of(model(tf.reverse(images, axis=[2]),
                                               training=False))) / 2
        return logits

    logits = flip_averaged(images)
    if tta_translate:
        height, width = tf.shape(images)[1], tf.shape(images)[2]  # (serving: any size)
        padded = tf.pad(images, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
        shifted = [padded[:, :height, :width], padded[:, 2:height + 2, 2:width + 2]]
        logits = 0.5 * logits + 0.25 * (flip_averaged(shifted[0])
                                        + flip_averaged(shifted[1]))
    return logits


def eval_step(model: keras.Model, batch: dict, options: StepOptions) -> dict[str, Metric]:
    """Loss and accuracy on one replica; padded examples (mask 0) count 0. With
    options.confusion_classes, also `confusion`: counts [true, predicted]."""
    logits = predict_logits(model, batch["image"], options.tta_flip,
                            options.tta_translate)
    per_example_loss = keras.losses.sparse_categorical_crossentropy(
        batch["label"], logits, from_logits=True)
    mask = tf.cast(batch["mask"], tf.float32)
    sums = _sums(per_example_loss, logits, batch["label"], mask)
    if options.confusion_classes:
        sums["confusion"] = (tf.math.confusion_matrix(
            batch["label"], tf.argmax(logits, -1, output_type=batch["label"].dtype),
            options.confusion_classes, weights=mask, dtype=tf.float32),
            tf.reduce_sum(mask))
    return sums
