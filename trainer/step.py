"""What ONE replica does with its slice of the global batch. Edit these to change
the training math; distribution lives in trainer/distributed.py.

Both steps return *sums* (loss, correct predictions, examples) rather than means:
sums add up correctly across replicas and steps, and the reporting code divides
once at the end, so no replica count ever leaks into a reported loss.
"""
import keras
import tensorflow as tf

METRIC_KEYS = ("loss_sum", "correct", "count")
TRAIN_KEYS = METRIC_KEYS + ("skipped",)  # skipped: 1 if the update was dropped (NaN)


def _sums(per_example_loss: tf.Tensor, logits: tf.Tensor, labels: tf.Tensor,
          weights: tf.Tensor) -> dict[str, tf.Tensor]:
    hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels),
                   tf.float32)
    return {"loss_sum": tf.reduce_sum(per_example_loss * weights),
            "correct": tf.reduce_sum(hits * weights),
            "count": tf.reduce_sum(weights)}


def _loss(labels: tf.Tensor, logits: tf.Tensor, label_smoothing: float) -> tf.Tensor:
    """Per-example cross-entropy from logits; smoothing mixes the one-hot target with
    the uniform distribution (weight `label_smoothing`)."""
    if not label_smoothing:
        return keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                            from_logits=True)
    targets = tf.one_hot(labels, tf.shape(logits)[-1])
    return keras.losses.categorical_crossentropy(targets, logits, from_logits=True,
                                                 label_smoothing=label_smoothing)


def train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer,
               images: tf.Tensor, labels: tf.Tensor, global_batch_size: int,
               skip_nonfinite: bool = False,
               label_smoothing: float = 0.0) -> dict[str, tf.Tensor]:
    """Forward, loss, gradients, update, on one replica.

    skip_nonfinite: if the loss is NaN/inf on any replica, no replica applies the
    update (weights and optimizer state stay as they were) and `skipped` is 1.
    """
    with tf.GradientTape() as tape:
        # float32 logits for the loss, whatever the mixed-precision policy.
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example_loss = _loss(labels, logits, label_smoothing)
        # Divide by the GLOBAL batch size, not this replica's: the replicas' gradients
        # are summed below, so the sum is the gradient of the global-batch mean.
        loss = tf.nn.compute_average_loss(per_example_loss,
                                          global_batch_size=global_batch_size)
        if model.losses:  # weight regularizers: every replica adds them, so / replicas
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        # Identity, except under mixed_float16 (LossScaleOptimizer), where the loss is
        # scaled up so float16 gradients do not underflow.
        scaled_loss = optimizer.scale_loss(loss)
    gradients = tape.gradient(scaled_loss, model.trainable_variables)
    # The cross-replica all-reduce happens here: under a distribution strategy
    # apply_gradients sums the gradients over all replicas, then every replica
    # applies the same update to its copy of the weights.
    if not skip_nonfinite:
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return {**_sums(per_example_loss, logits, labels,
                        tf.ones_like(per_example_loss)), "skipped": tf.constant(0.0)}
    skipped = apply_if_finite(optimizer, gradients, model.trainable_variables, loss)
    kept = tf.cast(skipped == 0, tf.float32)  # a skipped step counts no examples
    return {**_sums(tf.where(kept > 0, per_example_loss, 0.0), logits, labels,
                    kept * tf.ones_like(per_example_loss)), "skipped": skipped}


def eval_step(model: keras.Model, images: tf.Tensor, labels: tf.Tensor,
              mask: tf.Tensor, tta_flip: bool = False,
              confusion_classes: int = 0) -> dict[str, tf.Tensor]:
    """Loss and accuracy sums on one replica; padded examples (mask 0) count 0.
    tta_flip: average the logits of each image and its mirror image.
    confusion_classes > 0: also a `confusion` matrix of counts [true, predicted]."""
    logits = tf.cast(model(images, training=False), tf.float32)
    if tta_flip:
        mirrored = tf.cast(model(tf.reverse(images, axis=[2]), training=False), tf.float32)
        logits = (logits + mirrored) / 2
    per_example_loss = keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True)
    mask = tf.cast(mask, tf.float32)
    sums = _sums(per_example_loss, logits, labels, mask)
    if confusion_classes:
        sums["confusion"] = tf.math.confusion_matrix(
            labels, tf.argmax(logits, -1, output_type=labels.dtype), confusion_classes,
            weights=mask, dtype=tf.float32)
    return sums


def apply_if_finite(optimizer: keras.optimizers.Optimizer, gradients, variables,
                    loss: tf.Tensor) -> tf.Tensor:
    """Applies the update unless the loss is non-finite on ANY replica; returns this
    replica's share of the skip count (1 / replicas if skipped: the sums over
    replicas then count the step once). The decision is all-reduced so every replica
    (and worker) agrees, and the cond runs in the cross-replica context, where a branch may all-reduce
    (as Keras' LossScaleOptimizer does)."""
    context = tf.distribute.get_replica_context()
    bad = context.all_reduce(tf.distribute.ReduceOp.SUM,
                             tf.cast(tf.logical_not(tf.math.is_finite(loss)), tf.float32))

    def cross_replica(strategy, bad, gradients):
        def apply(grads):
            optimizer.apply_gradients(zip(grads, variables))
        tf.cond(strategy.experimental_local_results(bad)[0] > 0, lambda: None,
                lambda: strategy.extended.call_for_each_replica(apply, args=(gradients,)))

    context.merge_call(cross_replica, args=(bad, gradients))
    return tf.cast(bad > 0, tf.float32) / context.num_replicas_in_sync
