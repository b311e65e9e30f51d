"""The per-replica step and its distributed wrapper."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, mirrored
from trainer import distributed, optimizers, step


def _no_bn_model(seed: int = 3) -> keras.Model:
    """Deterministic init, no batch-norm/dropout: replicas must agree exactly."""
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=init)(inputs)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(5, kernel_initializer=init)(x))


def _batch(size=8):
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(size, 8, 8, 3)), tf.float32),
            tf.constant(rng.integers(0, 5, size), tf.int32))


def _train_once(strategy, optimizer_name="sgd", steps=1, global_batch=8):
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create(optimizer_name, 0.1, model.trainable_variables,
                                      momentum=0.0 if optimizer_name == "sgd" else 0.9)
    dataset = tf.data.Dataset.from_tensors(_batch(global_batch)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    loop = distributed.make_train_loop(strategy, model, optimizer, global_batch, False)
    sums = loop(iterator, tf.constant(steps))
    return model, optimizer, {k: float(v) for k, v in sums.items()}


def test_one_train_step_updates_weights(strategy):
    with strategy.scope():
        before = [w.copy() for w in _no_bn_model().get_weights()]
    model, optimizer, sums = _train_once(strategy, "adam")
    assert np.isfinite(sums["loss_sum"]) and sums["count"] == 8
    assert int(optimizer.iterations.numpy()) == 1
    changed = [not np.allclose(a, b) for a, b in zip(before, model.get_weights())]
    assert all(changed)


def test_two_replicas_make_the_same_update_as_one():
    one_model, _, one = _train_once(tf.distribute.OneDeviceStrategy(CPUS[0]), steps=2)
    two_model, _, two = _train_once(mirrored(), steps=2)
    for a, b in zip(one_model.get_weights(), two_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The reported loss is the global mean on both (no loss / num_replicas bug).
    np.testing.assert_allclose(one["loss_sum"] / one["count"],
                               two["loss_sum"] / two["count"], rtol=1e-5)
    assert one["count"] == two["count"] == 16


def test_reported_loss_is_the_unscaled_mean(strategy):
    with strategy.scope():
        model = _no_bn_model()
    images, labels = _batch()
    expected = float(tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        labels, model(images), from_logits=True)))
    loop = distributed.make_eval_loop(strategy, model, False)
    masked = tf.data.Dataset.from_tensors((images, labels, tf.ones([8]))).repeat()
    sums = loop(iter(strategy.experimental_distribute_dataset(masked)), tf.constant(1))
    np.testing.assert_allclose(float(sums["loss_sum"]) / float(sums["count"]), expected,
                               rtol=1e-5)


def test_eval_step_ignores_padding_and_leaves_weights():
    model = _no_bn_model()
    images, labels = _batch()
    weights = [w.copy() for w in model.get_weights()]
    mask = tf.constant([1.0] * 5 + [0.0] * 3)
    sums = step.eval_step(model, images, labels, mask)
    assert float(sums["count"]) == 5
    full = step.eval_step(model, images[:5], labels[:5], tf.ones([5]))
    np.testing.assert_allclose(float(sums["loss_sum"]), float(full["loss_sum"]), rtol=1e-5)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_mixed_float16_step_uses_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.OneDeviceStrategy(CPUS[0])
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("adam", 1e-3, model.trainable_variables,
                                      precision="mixed_float16")
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop = distributed.make_train_loop(strategy, model, optimizer, 8, False)
    sums = loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(2))
    assert np.isfinite(float(sums["loss_sum"]))


def test_jit_compiled_step_matches_plain_step():
    strategy = tf.distribute.OneDeviceStrategy(CPUS[0])
    plain, _, _ = _train_once(strategy)
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("sgd", 0.1, model.trainable_variables, momentum=0.0)
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop = distributed.make_train_loop(strategy, model, optimizer, 8, jit_compile=True)
    loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(1))
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_label_smoothing_raises_the_loss_of_a_confident_right_answer():
    logits = tf.constant([[10.0, -10.0, -10.0]])
    labels = tf.constant([0])
    plain = float(step._loss(labels, logits, 0.0)[0])
    smoothed = float(step._loss(labels, logits, 0.1)[0])
    # 0.1 of the target is spread uniformly: 1/30 on each wrong class, at logit -10.
    assert plain < 1e-6 and smoothed == pytest.approx(2 / 30 * 20, rel=0.01)


def test_flip_tta_evaluates_an_image_and_its_mirror():
    model = _no_bn_model()
    images, labels = _batch()
    mask = tf.ones(8)
    mirrored = tf.reverse(images, axis=[2])
    tta = step.eval_step(model, images, labels, mask, tta_flip=True)
    tta_of_mirror = step.eval_step(model, mirrored, labels, mask, tta_flip=True)
    plain = step.eval_step(model, images, labels, mask)
    np.testing.assert_allclose(float(tta["loss_sum"]), float(tta_of_mirror["loss_sum"]),
                               rtol=1e-5)  # symmetric in the flip
    assert float(tta["loss_sum"]) != pytest.approx(float(plain["loss_sum"]))
