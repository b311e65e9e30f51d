"""Any Keras optimizer, used right or refused: every optimizer Keras ships makes
the same update on 1 and 2 replicas through the step (wrapped, not re-declared),
a plain one is refused with one line, and a test fails if a Keras upgrade moves
the second cross-replica sum our wrapper switches off."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, classification, mirrored, step_loop
from test_step import _assert_same_weights, _batch, _no_bn_model
from trainer import distributed, optimizers, step
from trainer.settings import message_of


def _trained(strategy, make_optimizer, steps: int = 2):
    with strategy.scope():
        model = _no_bn_model()
        optimizer = make_optimizer(model)
    options = step.StepOptions(batch_size=8)
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop, _ = step_loop(strategy, model, optimizer, classification(), options)
    loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(steps),
         tf.constant(0.0))
    return model


def test_every_keras_optimizer_is_offered():
    offered = set(optimizers.names())
    assert {"sgd", "adam", "adamw", "lion", "lamb", "adafactor", "nadam", "rmsprop",
            "ftrl", "adagrad", "adadelta", "adamax"} <= offered
    assert "muon" in offered or not hasattr(keras.optimizers, "Muon")
    assert not offered & {"optimizer", "lossscaleoptimizer", "multioptimizer"}


@pytest.mark.parametrize("name", optimizers.names())
def test_each_optimizer_makes_the_same_update_on_one_and_two_replicas(name):
    def make(model):
        return optimizers.create(name, 0.01, model.trainable_variables)
    one = _trained(tf.distribute.OneDeviceStrategy(CPUS[0]), make)
    two = _trained(mirrored(), make)
    moved = [np.abs(w - w0).max() for w, w0 in zip(one.get_weights(),
                                                   _no_bn_model().get_weights())]
    assert max(moved) > 1e-6, f"{name} did not train"
    _assert_same_weights(one, two, rtol=1e-5, atol=1e-6)


def test_optimizer_options_reach_the_constructor():
    variables = [tf.Variable(1.0)]
    adam = optimizers.create("adam", 0.1, variables,
                             optimizer_options="beta_1=0.5,amsgrad=true,epsilon=1e-3")
    assert (adam.beta_1, adam.amsgrad, adam.epsilon) == (0.5, True, 1e-3)
    sgd = optimizers.create("sgd", 0.1, variables, optimizer_options="nesterov=false")
    assert not sgd.nesterov and sgd.momentum == 0.9
    for text, message in (("beta_3=1", "not an option of adam"),
                          ("beta_1=high", "beta_1='high' is not like the default 0.9"),
                          ("learning_rate=2", "set by the schedule")):
        with pytest.raises(ValueError, match=message):
            optimizers.create("adam", 0.1, variables, optimizer_options=text)


def test_a_plain_keras_optimizer_is_refused_with_one_line():
    strategy = mirrored()
    with pytest.raises(distributed.StepContractError) as raised:
        _trained(strategy, lambda model: keras.optimizers.SGD(0.1))
    message = message_of(raised.value)  # (raised while tracing the step)
    assert message.startswith("SGD is a plain Keras optimizer") and "\n" not in message
    assert "trainer.optimizers.summed(keras.optimizers.SGD)" in message
    # The way out it names works.
    _trained(strategy, lambda model: optimizers.summed(keras.optimizers.SGD)(0.1))


def test_keras_still_sums_in_the_method_the_wrapper_switches_off():
    """If a Keras upgrade renames or moves `_all_reduce_sum_gradients`, the wrapper
    stops working silently (a double sum on N replicas): this fails first. A plain
    optimizer's apply() in a replica context must sum (2 replicas: twice the step),
    the wrapped one must not."""
    strategy = mirrored()
    assert "_all_reduce_sum_gradients" in vars(optimizers._SummedGradients)

    def one_update(cls):
        with strategy.scope():
            variable = tf.Variable(0.0)
            optimizer = cls(1.0)
            optimizer.build([variable])

        @tf.function
        def update():
            strategy.run(lambda: optimizer.apply([tf.constant(1.0)], [variable]))
        update()
        return float(variable.numpy())

    assert one_update(keras.optimizers.SGD) == -2.0  # Keras' own sum over 2 replicas
    assert one_update(optimizers.summed(keras.optimizers.SGD)) == -1.0


@pytest.mark.parametrize("decay_vectors", [False, True])
def test_decay_vectors_decays_biases_too(decay_vectors):
    kernel, bias = tf.Variable(np.ones((2, 2), np.float32)), tf.Variable(np.ones(2, np.float32))
    optimizer = optimizers.create("sgd", 0.5, [kernel, bias], weight_decay=0.1,
                                  momentum=0.0, decay_vectors=decay_vectors)
    optimizer.apply([tf.zeros_like(kernel), tf.zeros_like(bias)], [kernel, bias])
    np.testing.assert_allclose(kernel.numpy(), 1 - 0.5 * 0.1)  # decoupled: x (1 - lr wd)
    np.testing.assert_allclose(bias.numpy(), 1 - 0.5 * 0.1 if decay_vectors else 1.0)
