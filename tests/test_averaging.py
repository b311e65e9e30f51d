"""Weight averaging (--ema_decay): the average follows the raw weights, is swapped
in for evaluation only, survives a checkpoint, and reaches metrics.json."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import classification, step_loop

from test_step import _batch, _no_bn_model
from trainer import averaging, loop, optimizers, step


def _train(strategy, ema_decay, steps=3):
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("sgd", 0.5, model.trainable_variables,
                                      momentum=0.0, ema_decay=ema_decay)
    dataset = tf.data.Dataset.from_tensors(_batch(8)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    options = step.StepOptions(batch_size=8)
    task = classification()
    step_loop(strategy, model, optimizer, task, options)[0](
        iterator, tf.constant(steps), tf.constant(0.0))
    return model, optimizer


def _replica_values(model):
    """Every replica's copy of every trainable variable, variable by variable."""
    values = []
    for var in model.trainable_variables:
        values += [np.array(copy) for copy in getattr(var.value, "values", (var.value,))]
    return values


def test_average_is_swapped_in_on_every_replica_and_raw_weights_return(strategy):
    model, optimizer = _train(strategy, ema_decay=0.5)
    raw = _replica_values(model)
    with averaging.averaged_weights(optimizer):
        averaged = _replica_values(model)
    # The average lags the raw weights after 3 updates with lr 0.5 ...
    assert all(not np.allclose(a, r) for a, r in zip(averaged, raw))
    # ... every replica holds it (not only the first) ...
    if len(averaged) > len(model.trainable_variables):
        for first, second in zip(averaged[0::2], averaged[1::2]):
            np.testing.assert_array_equal(first, second)
    # ... and training resumes from exactly the raw weights.
    for a, b in zip(raw, _replica_values(model)):
        np.testing.assert_array_equal(a, b)


def test_average_follows_the_update_rule(strategy):
    """With decay d, after steps w1, w2 the average is d * w1 + (1 - d) * w2 (Keras
    starts the average at the first step's weights)."""
    with strategy.scope():
        w1 = [w.copy() for w in _train(strategy, 0.0, steps=1)[0].get_weights()]
        w2 = [w.copy() for w in _train(strategy, 0.0, steps=2)[0].get_weights()]
    model, optimizer = _train(strategy, ema_decay=0.25, steps=2)
    with averaging.averaged_weights(optimizer):
        for got, a, b in zip(model.get_weights(), w1, w2):
            np.testing.assert_allclose(got, 0.25 * a + 0.75 * b, rtol=1e-5, atol=1e-6)


def test_without_averaging_evaluation_sees_the_raw_weights():
    model, optimizer = _train(tf.distribute.get_strategy(), ema_decay=0.0)
    assert not averaging.enabled(optimizer)
    before = model.get_weights()
    with averaging.averaged_weights(optimizer):
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)
    assert averaging.evaluate_raw_and_averaged(lambda: {"test_accuracy": 1.0},
                                               optimizer) == {"test_accuracy": 1.0}


def test_checkpoint_restores_the_average(tmp_path):
    model, optimizer = _train(tf.distribute.get_strategy(), ema_decay=0.5)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))
    fresh, fresh_optimizer = _train(tf.distribute.get_strategy(), 0.5, steps=1)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).read(
        str(tmp_path / "ckpt")).assert_existing_objects_matched()
    with averaging.averaged_weights(optimizer):
        expected = model.get_weights()
    with averaging.averaged_weights(fresh_optimizer):
        for a, b in zip(expected, fresh.get_weights()):
            np.testing.assert_array_equal(a, b)


@pytest.mark.long(9)  # seconds, with -n 2
def test_run_reports_raw_and_averaged_accuracy(tiny_config):
    metrics = loop.train_and_evaluate(tiny_config.replace(ema_decay=0.9, optimizer="sgd"))
    with open(os.path.join(tiny_config.model_dir, "metrics.json")) as f:
        written = json.load(f)
    assert "test_accuracy_raw" in written
    assert all("test_accuracy_raw" in e for e in written["eval_history"])
    assert written["test_accuracy"] == metrics["test_accuracy"]
    # Stopped before its end (no weights files): predict and export serve the
    # newest checkpoint's average, as model.weights.h5 holds it, not its raw weights.
    from trainer.serving import inference
    averaged = [v.numpy() for v in inference.TrainedModel(tiny_config.model_dir).model.weights]
    for name in ("model.weights.h5", "best.weights.h5"):
        os.remove(os.path.join(tiny_config.model_dir, name))
    newest = inference.TrainedModel(tiny_config.model_dir)
    assert newest.weights.startswith("ckpt-4 (step 4;")
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(averaged, newest.model.weights))


def test_an_optimizer_that_has_not_updated_yet_is_evaluated_with_its_raw_weights():
    """Keras fills the moving average at an optimizer's first update (zeros before):
    a schedule's optimizer that has not run yet (a backbone's in a head phase, a
    WGAN-GP generator's before step 6) keeps its raw weights in evaluation."""
    import keras
    import numpy as np
    import tensorflow as tf
    from trainer import averaging, optimizers
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = optimizers.create("sgd", 0.1, model.trainable_variables, ema_decay=0.9)
    raw = model.get_weights()
    with averaging._averaged_weights(optimizer):  # noqa: SLF001
        for a, b in zip(model.get_weights(), raw):
            np.testing.assert_array_equal(a, b)
    optimizer.apply([tf.ones_like(v) for v in model.trainable_variables],
                    model.trainable_variables)
    with averaging._averaged_weights(optimizer):  # noqa: SLF001 (now the average)
        assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), raw))
