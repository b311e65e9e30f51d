"""What ONE replica does with its slice of the global batch. Edit these to change
the training math; distribution lives in trainer/distributed.py.

Both steps return *sums* (loss, correct predictions, examples) rather than means:
sums add up correctly across replicas and steps, and the reporting code divides
once at the end, so no replica count ever leaks into a reported loss.
"""
import keras
import tensorflow as tf

METRIC_KEYS = ("loss_sum", "correct", "count")


def _sums(per_example_loss: tf.Tensor, logits: tf.Tensor, labels: tf.Tensor,
          weights: tf.Tensor) -> dict[str, tf.Tensor]:
    hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels),
                   tf.float32)
    return {"loss_sum": tf.reduce_sum(per_example_loss * weights),
            "correct": tf.reduce_sum(hits * weights),
            "count": tf.reduce_sum(weights)}


def train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer,
               images: tf.Tensor, labels: tf.Tensor,
               global_batch_size: int) -> dict[str, tf.Tensor]:
    """Forward, loss, gradients, update, on one replica."""
    with tf.GradientTape() as tape:
        # float32 logits for the loss, whatever the mixed-precision policy.
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example_loss = keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True)
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
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return _sums(per_example_loss, logits, labels, tf.ones_like(per_example_loss))


def eval_step(model: keras.Model, images: tf.Tensor, labels: tf.Tensor,
              mask: tf.Tensor) -> dict[str, tf.Tensor]:
    """Loss and accuracy sums on one replica; padded examples (mask 0) count 0."""
    logits = tf.cast(model(images, training=False), tf.float32)
    per_example_loss = keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True)
    return _sums(per_example_loss, logits, labels, tf.cast(mask, tf.float32))
