"""models/fused.py: the fused batch-norm and GELU compute what Keras' own do, and a
model built with them loads the weights of one built without."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import models
from models import fused


def _pair(**kwargs):
    ours, theirs = fused.BatchNormalization(**kwargs), keras.layers.BatchNormalization(**kwargs)
    return ours, theirs


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_batch_norm_trains_like_keras_and_keeps_the_unbiased_variance(policy):
    keras.mixed_precision.set_global_policy(policy)
    ours, theirs = _pair(momentum=0.6, epsilon=1e-5, center=True, scale=True)
    x = tf.random.stateless_normal((16, 6, 6, 8), (1, 2)) * 3 + 1
    x = tf.cast(x, ours.compute_dtype)
    weights = tf.range(8, dtype=tf.float32)
    outputs, grads = [], []
    for layer in (ours, theirs):
        layer.build(x.shape)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        assert y.dtype == x.dtype
        outputs.append(tf.cast(y, tf.float32).numpy())
        grads.append([tf.cast(g, tf.float32).numpy()
                      for g in tape.gradient(loss, [x, layer.gamma, layer.beta])])
    tolerance = 1e-5 if policy == "float32" else 2e-2
    np.testing.assert_allclose(outputs[0], outputs[1], atol=tolerance * 10)
    for a, b in zip(*grads):  # (gamma's is a sum of ~0 over 576 terms: absolute)
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=max(1e-3, tolerance * 10))
    np.testing.assert_allclose(ours.moving_mean.numpy(), theirs.moving_mean.numpy(),
                               atol=1e-6)
    n = 16 * 6 * 6  # moving = 0.6 * 1 + 0.4 * variance: ours with n / (n - 1)
    np.testing.assert_allclose((ours.moving_variance.numpy() - 0.6),
                               (theirs.moving_variance.numpy() - 0.6) * n / (n - 1),
                               rtol=1e-4)
    # Inference normalizes with the moving statistics, as Keras' does.
    theirs.moving_variance.assign(ours.moving_variance)
    np.testing.assert_allclose(tf.cast(ours(x, training=False), tf.float32).numpy(),
                               tf.cast(theirs(x, training=False), tf.float32).numpy(),
                               atol=tolerance * 10)


def test_batch_norm_without_scale_trains_the_bias_and_falls_back_where_it_cannot_fuse():
    ours, theirs = _pair(scale=False, epsilon=1e-12)
    x = tf.random.stateless_normal((8, 4, 4, 3), (3, 4))
    for layer in (ours, theirs):
        layer.build(x.shape)
    with tf.GradientTape(persistent=True) as tape:
        losses = [tf.reduce_sum(layer(x, training=True) * tf.range(3.0))
                  for layer in (ours, theirs)]
    np.testing.assert_allclose(tape.gradient(losses[0], ours.beta).numpy(),
                               tape.gradient(losses[1], theirs.beta).numpy(), atol=1e-4)
    flat, flat_keras = _pair()  # 2-D input: Keras' own computation, same result
    v = tf.random.stateless_normal((8, 5), (5, 6))
    np.testing.assert_allclose(flat(v, training=True).numpy(),
                               flat_keras(v, training=True).numpy(), atol=1e-5)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_gelu_is_keras_exact_gelu_in_value_and_gradient(dtype):
    x = tf.cast(tf.linspace(-6.0, 6.0, 1001), dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, theirs = fused.gelu(x), keras.activations.gelu(x, approximate=False)
    assert ours.dtype == dtype
    tolerance = 2e-6 if dtype == tf.float32 else 2e-2
    as_np = lambda t: tf.cast(t, tf.float32).numpy()  # noqa: E731
    np.testing.assert_allclose(as_np(ours), as_np(theirs), atol=tolerance)
    np.testing.assert_allclose(as_np(tape.gradient(ours, x)), as_np(tape.gradient(theirs, x)),
                               atol=tolerance * 4)


def test_an_airbench_with_fused_layers_loads_the_weights_of_one_without(tmp_path):
    keras.utils.set_random_seed(0)
    plain = models.build("airbench", 10, (32, 32, 3), tiny=True, options="fused=false")
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    fast = models.build("airbench", 10, (32, 32, 3), tiny=True, weights=path)
    assert any(isinstance(layer, fused.BatchNormalization) for layer in fast.layers)
    x = tf.random.stateless_normal((4, 32, 32, 3), (7, 8))
    np.testing.assert_allclose(fast(x, training=False).numpy(),
                               plain(x, training=False).numpy(), atol=1e-4)
    clone = keras.Model.from_config(fast.get_config())  # both layers serialize
    assert sum(isinstance(layer, fused.BatchNormalization) for layer in clone.layers) == 6


def test_the_fused_benchmark_times_airbenchs_six_pairs():
    from trainer.tools import fused_benchmark
    assert fused_benchmark.shapes(1024, [32, 64, 128]) == [
        (1024, 15, 15, 32), (1024, 15, 15, 32), (1024, 7, 7, 64), (1024, 7, 7, 64),
        (1024, 3, 3, 128), (1024, 3, 3, 128)]
    milliseconds = fused_benchmark.time_pass(
        lambda: fused.BatchNormalization(scale=False), fused.gelu,
        fused_benchmark.shapes(4, [2, 2, 2]), repeats=1)
    assert milliseconds > 0
    assert keras.mixed_precision.global_policy().name == "float32"  # restored
