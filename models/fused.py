"""Batch normalization and GELU in few kernels (issue 20: on airbench's step they
took 41% of the op time, against the PyTorch peer's 15%).

`BatchNormalization`: one TensorFlow op each way (FusedBatchNormV3 and its
gradient, which oneDNN runs on the CPU and cuDNN on a GPU) instead of Keras 3's
unfused float32 ops (a cast, the moments, the normalization and a cast back, each a
pass over the activations, and as many again backward).

The layer *is* Keras' BatchNormalization: the same class name, weights, variables
and config, so a model's `.weights.h5` and training checkpoints are interchangeable
with the built-in layer's (Keras names saved layers by their class name). It falls
back to Keras' own computation where the fused op does not apply (not 4-D
channels-last, a mask, renorm, synchronized statistics, float64).

One convention differs, on purpose: the moving variance is updated with the
unbiased batch variance (n / (n - 1) times the biased one, n = batch x height x
width), as FusedBatchNormV3 returns it and as PyTorch and Keras 2's fused layer
keep it; Keras 3's unfused layer uses the biased one. Normalizing a training batch
uses the biased variance in both.
"""
import keras
from keras import layers
import tensorflow as tf

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@keras.saving.register_keras_serializable(package="tfloop")
def gelu(x):
    """The exact GELU, x * Phi(x), as `keras.activations.gelu(x, approximate=False)`
    (to 1e-6), in float32 whatever x's dtype, as one XLA kernel forward and one
    backward, the backward from the saved x (Phi(x) + x * phi(x)). Keras' own is
    three to five elementwise passes each way (Mul, Erfc, Exp, in bfloat16 on the
    CPU): on airbench's six BN+GELU of a 1024 batch 173 ms against 87 with this
    (BUILD.md)."""
    return _gelu_kernel(x)


@tf.custom_gradient
def _gelu(x):
    x32 = tf.cast(x, tf.float32)
    cdf = 0.5 * (1.0 + tf.math.erf(x32 * _SQRT_HALF))

    def grad(upstream):
        pdf = tf.exp(-0.5 * tf.square(x32)) * _INV_SQRT_2PI
        return tf.cast(tf.cast(upstream, tf.float32) * (cdf + x32 * pdf), x.dtype)

    return tf.cast(x32 * cdf, x.dtype), grad


_gelu_kernel = tf.function(_gelu, jit_compile=True)


@keras.saving.register_keras_serializable(package="tfloop")
class BatchNormalization(layers.BatchNormalization):
    """keras.layers.BatchNormalization computed by FusedBatchNormV3 where it applies
    (see the module's docstring); same arguments."""

    def _fuses(self, inputs, mask) -> bool:
        return (mask is None and not self.renorm and not self.synchronized
                and len(inputs.shape) == 4 and self.axis % 4 == 3
                and keras.backend.standardize_dtype(inputs.dtype)
                in ("float32", "bfloat16", "float16"))

    def call(self, inputs, training=None, mask=None):
        if not self._fuses(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        scale = (tf.cast(self.gamma, tf.float32) if self.scale
                 else tf.ones([channels], tf.float32))
        offset = (tf.cast(self.beta, tf.float32) if self.center
                  else tf.zeros([channels], tf.float32))
        x = tf.cast(inputs, self.compute_dtype)  # bf16/f16 in, float32 statistics
        if training and self.trainable:
            outputs, mean, variance, *_ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=scale, offset=offset, mean=tf.zeros([0], tf.float32),
                variance=tf.zeros([0], tf.float32), epsilon=self.epsilon,
                exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
            # `variance` is the unbiased batch variance (the module's docstring).
            self.moving_mean.assign(
                self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
            self.moving_variance.assign(
                self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        else:
            outputs, *_ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=scale, offset=offset,
                mean=tf.cast(self.moving_mean, tf.float32),
                variance=tf.cast(self.moving_variance, tf.float32),
                epsilon=self.epsilon, exponential_avg_factor=1.0, data_format="NHWC",
                is_training=False)
        return outputs
