"""A callback of my own (--callbacks=first_filters): the first convolution's
filters as a picture in TensorBoard (model_dir/filters) at every evaluation."""
import keras
import tensorflow as tf

from trainer import callbacks


@callbacks.register("first_filters")
class FirstFilters(callbacks.Callback):
    name = "first_filters"

    def on_train_begin(self, context):
        self.writer = context.summary_writer("filters")  # a no-op off the chief

    def on_eval(self, step, results, state):
        model = state.models["main"]
        conv = next((layer for layer in model.layers
                     if isinstance(layer, keras.layers.Conv2D)), None)
        if conv is None:
            return
        kernel = tf.convert_to_tensor(conv.kernel)[..., :3, :16]  # [k, k, 3, <=16]
        low, high = tf.reduce_min(kernel), tf.reduce_max(kernel)
        images = tf.transpose((kernel - low) / (high - low + 1e-12), [3, 0, 1, 2])
        with self.writer.as_default(step=step):
            tf.summary.image("first_filters", images, max_outputs=16)
        self.writer.flush()
