"""The per-replica step and its distributed wrapper: the explicit cross-replica sum,
clipping, accumulation, metrics as data, auxiliary heads, loss scaling."""
import dataclasses
import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, mirrored, classification, step_loop
from trainer import distributed, optimizers, state as state_lib, step


def _no_bn_model(seed: int = 3, aux_head: bool = False) -> keras.Model:
    """Deterministic init, no batch-norm/dropout: replicas must agree exactly."""
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=init)(inputs)
    x = keras.layers.Flatten()(x)
    logits = keras.layers.Dense(5, kernel_initializer=init)(x)
    if not aux_head:
        return keras.Model(inputs, logits)
    aux = keras.layers.Dense(5, kernel_initializer=init, name="aux")(x)
    return keras.Model(inputs, {"logits": logits, "aux_logits": aux})


def _batch(size=8, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.normal(size=(size, 8, 8, 3)), tf.float32),
            "label": tf.constant(rng.integers(0, 5, size), tf.int32)}


def _one_device():
    return tf.distribute.OneDeviceStrategy(CPUS[0])


def _train(strategy, steps=1, global_batch=8, optimizer_name="sgd", learning_rate=0.1,
           batches=None, model_fn=_no_bn_model, task=None, **options):
    """Trains `steps` steps (of `batches`, cycled, else one fixed batch); returns
    (model, optimizer, metric means)."""
    task = task or classification()
    with strategy.scope():
        model = model_fn()
        optimizer = optimizers.create(optimizer_name, learning_rate,
                                      model.trainable_variables,
                                      momentum=0.0 if optimizer_name == "sgd" else 0.9)
    step_options = step.StepOptions(batch_size=global_batch, **options)
    batches = batches or [_batch(global_batch)]
    dataset = tf.data.Dataset.from_tensor_slices(
        {key: tf.stack([b[key] for b in batches]) for key in batches[0]}).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    loop, _ = step_loop(strategy, model, optimizer, task, step_options)
    sums, _ = loop(iterator, tf.constant(steps), tf.constant(0.0))
    return model, optimizer, distributed.means(
        tf.nest.map_structure(lambda t: t.numpy(), sums))


def _evaluated(model, task, batch) -> dict:
    """The default eval step of `model` (a one-model state) on `batch`."""
    return step.eval_step(state_lib.single(model, None), task, batch)


def _assert_same_weights(a: keras.Model, b: keras.Model, rtol=1e-5, atol=1e-6):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_one_train_step_updates_weights_and_counts_one_step(strategy):
    with strategy.scope():
        before = [w.copy() for w in _no_bn_model().get_weights()]
    model, optimizer, metrics = _train(strategy, optimizer_name="adam")
    assert np.isfinite(metrics["loss"]) and 0 <= metrics["accuracy"] <= 1
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
    assert int(optimizer.iterations.numpy()) == 1
    assert all(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))


def test_two_replicas_make_the_same_update_as_one():
    one_model, _, one = _train(_one_device(), steps=2)
    two_model, _, two = _train(mirrored(), steps=2)
    _assert_same_weights(one_model, two_model)
    # The reported loss and gradient norm are global (no loss / num_replicas bug).
    for key in ("loss", "accuracy", "grad_norm"):
        assert one[key] == pytest.approx(two[key], rel=1e-5)


def test_the_gradient_is_summed_once_not_again_in_the_optimizer():
    """One SGD step of lr 1 moves the weights by exactly the global-mean gradient."""
    model, _, _ = _train(mirrored(), learning_rate=1.0)
    start = _no_bn_model()
    batch = _batch()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            batch["label"], start(batch["image"]), from_logits=True))
    expected = tape.gradient(loss, start.trainable_variables)
    for w0, w1, g in zip(start.get_weights(), model.get_weights(), expected):
        np.testing.assert_allclose(w0 - w1, g.numpy(), rtol=1e-4, atol=1e-6)


def test_clipping_binds_on_the_summed_gradient_alike_on_one_and_two_replicas():
    clip = 0.01
    one_model, _, one = _train(_one_device(), steps=3, learning_rate=1.0,
                               clip_grad_norm=clip)
    two_model, _, two = _train(mirrored(), steps=3, learning_rate=1.0,
                               clip_grad_norm=clip)
    assert one["grad_norm"] > 10 * clip  # the clip really bound
    _assert_same_weights(one_model, two_model)
    # One clipped SGD step of lr 1 moves the weights by exactly `clip`.
    single, _, _ = _train(mirrored(), steps=1, learning_rate=1.0, clip_grad_norm=clip)
    moved = [a - b for a, b in zip(_no_bn_model().get_weights(), single.get_weights())]
    assert np.sqrt(sum(np.sum(m * m) for m in moved)) == pytest.approx(clip, rel=1e-4)


def test_accumulating_four_micro_batches_equals_one_full_batch_step():
    batches = [_batch(16, seed=s) for s in range(2)]
    full, _, full_metrics = _train(_one_device(), steps=2, global_batch=16,
                                   batches=batches, optimizer_name="adam")
    accumulated, optimizer, metrics = _train(_one_device(), steps=2, global_batch=16,
                                             batches=batches, optimizer_name="adam",
                                             grad_accum_steps=4)
    two, _, two_metrics = _train(mirrored(), steps=2, global_batch=16, batches=batches,
                                 optimizer_name="adam", grad_accum_steps=4)
    _assert_same_weights(full, accumulated, rtol=1e-4, atol=1e-5)
    _assert_same_weights(full, two, rtol=1e-4, atol=1e-5)
    assert int(optimizer.iterations.numpy()) == 2  # one update per step
    for key in ("loss", "accuracy", "grad_norm"):
        assert metrics[key] == pytest.approx(full_metrics[key], rel=1e-4)
        assert two_metrics[key] == pytest.approx(full_metrics[key], rel=1e-4)


def test_grad_norm_is_the_global_norm_of_the_mean_gradient_by_hand():
    model = _no_bn_model()
    batch = _batch()
    with tf.GradientTape() as tape:
        logits = model(batch["image"])
        per_example = -tf.math.log(tf.gather(tf.nn.softmax(logits), batch["label"],
                                             batch_dims=1))
        loss = tf.reduce_sum(per_example) / 8
    by_hand = np.sqrt(sum(np.sum(g.numpy() ** 2)
                          for g in tape.gradient(loss, model.trainable_variables)))
    _, _, metrics = _train(mirrored())
    assert metrics["grad_norm"] == pytest.approx(by_hand, rel=1e-5)


def test_an_auxiliary_head_adds_its_weighted_loss():
    batch = _batch()
    model = _no_bn_model(aux_head=True)
    outputs = model(batch["image"])
    ce = lambda logits: keras.losses.sparse_categorical_crossentropy(  # noqa: E731
        batch["label"], logits, from_logits=True)
    np.testing.assert_allclose(classification(aux_loss_weight=0.4).loss(batch, outputs)[0],
                               ce(outputs["logits"]) + 0.4 * ce(outputs["aux_logits"]),
                               rtol=1e-6)
    # Trained, the auxiliary head moves; evaluation reads the main head only.
    trained, _, metrics = _train(mirrored(), model_fn=lambda: _no_bn_model(aux_head=True))
    assert np.isfinite(metrics["loss"])
    aux_kernel = trained.get_layer("aux").get_weights()[0]
    assert not np.allclose(aux_kernel, model.get_layer("aux").get_weights()[0])
    eval_sums = _evaluated(trained, classification(), {**batch, "mask": tf.ones(8)})
    np.testing.assert_allclose(float(eval_sums["loss"][0]), float(tf.reduce_sum(
        ce(trained(batch["image"])["logits"]))), rtol=1e-5)


def test_soft_targets_train_against_the_target_and_score_the_hard_label():
    batch = _batch()
    outputs = _no_bn_model()(batch["image"])
    targets = 0.7 * tf.one_hot(batch["label"], 5) + 0.3 * tf.one_hot(
        tf.reverse(batch["label"], [0]), 5)
    np.testing.assert_allclose(
        classification().loss({**batch, "target": targets}, outputs)[0],
        keras.losses.categorical_crossentropy(targets, outputs, from_logits=True),
        rtol=1e-6)


def test_reported_loss_is_the_unscaled_mean(strategy):
    with strategy.scope():
        model = _no_bn_model()
    batch = _batch()
    expected = float(tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        batch["label"], model(batch["image"]), from_logits=True)))
    task = classification()
    state = state_lib.single(model, None)
    loop = distributed.make_eval_loop(strategy, lambda b: step.eval_step(state, task, b))
    masked = tf.data.Dataset.from_tensors({**batch, "mask": tf.ones([8])}).repeat()
    sums = loop(iter(strategy.experimental_distribute_dataset(masked)), tf.constant(1))
    means = distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums))
    np.testing.assert_allclose(means["loss"], expected, rtol=1e-5)


def test_eval_step_ignores_padding_and_leaves_weights():
    model = _no_bn_model()
    batch = _batch()
    weights = [w.copy() for w in model.get_weights()]
    task = classification()
    sums = _evaluated(model, task, {**batch, "mask": tf.constant([1.0] * 5 + [0.0] * 3)})
    assert float(sums["loss"][1]) == 5
    full = _evaluated(model, task, {"image": batch["image"][:5],
                                    "label": batch["label"][:5], "mask": tf.ones([5])})
    np.testing.assert_allclose(float(sums["loss"][0]), float(full["loss"][0]), rtol=1e-5)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_mixed_float16_step_unscales_before_the_norm_and_matches_float32():
    float32_model, _, float32_metrics = _train(_one_device(), steps=2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = _one_device()
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("sgd", 0.1, model.trainable_variables, momentum=0.0,
                                      precision="mixed_float16")
    assert optimizers.loss_scaled(optimizer)
    options = step.StepOptions(batch_size=8)
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop, _ = step_loop(strategy, model, optimizer, classification(), options)
    sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(2), tf.constant(0.0))
    metrics = distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums))
    # The loss was scaled by 32768, yet the norm is that of the real gradient.
    assert metrics["grad_norm"] == pytest.approx(float32_metrics["grad_norm"], rel=2e-2)
    _assert_same_weights(model, float32_model, rtol=2e-2, atol=2e-3)


def test_jit_compiled_step_matches_plain_step():
    plain, _, _ = _train(_one_device())
    strategy = _one_device()
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("sgd", 0.1, model.trainable_variables, momentum=0.0)
    options = step.StepOptions(batch_size=8)
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop, _ = step_loop(strategy, model, optimizer, classification(), options,
                        jit_compile=True)
    loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(1),
         tf.constant(0.0))
    _assert_same_weights(plain, model, rtol=1e-4, atol=1e-5)


def test_label_smoothing_raises_the_loss_of_a_confident_right_answer():
    logits = tf.constant([[10.0, -10.0, -10.0]])
    batch = {"label": tf.constant([0])}
    plain = float(classification().loss(batch, logits)[0][0])
    smoothed = float(classification(label_smoothing=0.1).loss(batch, logits)[0][0])
    # 0.1 of the target is spread uniformly: 1/30 on each wrong class, at logit -10.
    assert plain < 1e-6 and smoothed == pytest.approx(2 / 30 * 20, rel=0.01)


def test_flip_tta_evaluates_an_image_and_its_mirror():
    model = _no_bn_model()
    images = _batch()["image"]
    flip, plain_task = classification(tta_flip=True), classification()
    tta = flip.predict(model, images)
    tta_of_mirror = flip.predict(model, tf.reverse(images, axis=[2]))
    plain = plain_task.predict(model, images)
    np.testing.assert_allclose(tta, tta_of_mirror, rtol=1e-5, atol=1e-6)  # symmetric
    assert not np.allclose(tta, plain)
    np.testing.assert_allclose(
        tta, (plain + plain_task.predict(model, tf.reverse(images, axis=[2]))) / 2,
        rtol=1e-5, atol=1e-6)


def test_the_step_runs_with_the_step_settings_of_the_run(tiny_config):
    # What trainer/build.py hands the step: every StepSettings field of the Config
    # (one field each: there is no second list to forget), and what is derived.
    from trainer import build, config as config_lib
    from trainer.config import Config
    config = tiny_config.replace(batch_size=64, clip_grad_norm=2.0, grad_accum_steps=4,
                                 sam_rho=0.05, lookahead_every=5)
    plan = build.plan(config, build.run_data(config).spec, 1)
    builder = build.StateBuilder(config, build.run_data(config).spec, plan,
                                 tf.distribute.get_strategy(), "float32", build.TRAIN,
                                 build.make_task(config, build.run_data(config).spec))
    assert builder.options == step.StepOptions(
        batch_size=64, clip_grad_norm=2.0, grad_accum_steps=4, sam_rho=0.05,
        lookahead_every=5, total_steps=plan.total_steps)
    assert set(step.SETTINGS) == {f.name for f in dataclasses.fields(step.StepSettings)}
    assert set(step.SETTINGS) <= set(config_lib.FLAG_FIELDS)
    assert issubclass(Config, step.StepSettings)


# --- two-pass steps: SAM ------------------------------------------------------------

def _gradient(model, batch, weights=None):
    """The global-mean cross-entropy gradient of `model` at `weights` (default its own)."""
    if weights is not None:
        model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            batch["label"], model(batch["image"]), from_logits=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_sam_steps_with_the_gradient_at_the_perturbed_weights_by_hand(replicas):
    rho = 0.05
    strategy = mirrored() if replicas == 2 else _one_device()
    trained, _, metrics = _train(strategy, learning_rate=1.0, sam_rho=rho)
    batch, by_hand = _batch(), _no_bn_model()
    start = by_hand.get_weights()
    first = _gradient(by_hand, batch)
    norm = np.sqrt(sum(np.sum(g * g) for g in first))
    second = _gradient(by_hand, batch, [w + rho * g / norm for w, g in zip(start, first)])
    for w0, w1, g in zip(start, trained.get_weights(), second):
        np.testing.assert_allclose(w0 - w1, g, rtol=1e-4, atol=1e-6)
    # The logged norm is that of the applied (second) gradient.
    assert metrics["grad_norm"] == pytest.approx(
        np.sqrt(sum(np.sum(g * g) for g in second)), rel=1e-5)


def _bn_model():
    init = keras.initializers.GlorotUniform(seed=3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, kernel_initializer=init)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.5)(x)
    x = keras.layers.Flatten()(keras.layers.Activation("relu")(x))
    return keras.Model(inputs, keras.layers.Dense(5, kernel_initializer=init)(x))


def test_the_second_pass_leaves_the_weights_and_batch_norm_as_one_pass_does():
    """With learning rate 0 a step changes only batch-norm's moving statistics:
    with SAM the weights come back bitwise and the statistics hold the first
    pass's update alone (a second update would move them twice as far)."""
    plain, _, _ = _train(_one_device(), learning_rate=0.0, model_fn=_bn_model)
    sam, _, _ = _train(_one_device(), learning_rate=0.0, model_fn=_bn_model,
                       sam_rho=0.5)
    for a, b in zip(plain.get_weights(), sam.get_weights()):
        np.testing.assert_array_equal(a, b)
    moved = [v for v in _bn_model().non_trainable_weights if "moving_mean" in v.path]
    assert not np.array_equal(moved[0].numpy(), step.moving_statistics(sam)[0].numpy())


def test_clipping_after_sam_uses_the_second_gradients_norm():
    clip = 0.01
    trained, _, metrics = _train(mirrored(), learning_rate=1.0, sam_rho=0.05,
                                 clip_grad_norm=clip)
    assert metrics["grad_norm"] > 10 * clip
    moved = [a - b for a, b in zip(_no_bn_model().get_weights(), trained.get_weights())]
    assert np.sqrt(sum(np.sum(m * m) for m in moved)) == pytest.approx(clip, rel=1e-4)


def test_a_non_finite_first_gradient_is_skipped_without_touching_the_weights():
    bad = _batch()
    bad["image"] = tf.tensor_scatter_nd_update(bad["image"], [[0, 0, 0, 0]], [np.nan])
    trained, optimizer, metrics = _train(mirrored(), batches=[bad], sam_rho=0.05,
                                         model_fn=_bn_model)
    assert metrics["skipped"] == 1 and int(optimizer.iterations.numpy()) == 0
    for a, b in zip(_bn_model().get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(a, b)  # weights and statistics, no NaN


@pytest.mark.parametrize("replicas,optimizer_name", [(1, "sgd"), (2, "sgd"), (2, "adam")])
def test_an_update_that_overflows_a_weight_is_reported_at_its_step_without_a_copy(
        replicas, optimizer_name):
    """A finite gradient times a learning rate near float32's largest overflows
    some weights. Nothing is copied to undo it (issue 30: no per-step copy of the
    state): the wrapper, reading the weights after every step, names the step
    whose update made them non-finite, and the loop stops before anything is
    saved (tests/test_faults.py)."""
    batch = _batch()
    batch["image"] = batch["image"] * 100.0  # gradients above 1: 3e38 x g overflows
    gradient = _gradient(_no_bn_model(), batch)
    assert np.isfinite(sum(np.sum(g * g) for g in gradient))
    assert max(np.abs(g).max() for g in gradient) > 2  # x 3e38: beyond float32
    strategy = mirrored() if replicas == 2 else _one_device()
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create(optimizer_name, 3e38, model.trainable_variables,
                                      momentum=0.0)
    loop, state = step_loop(strategy, model, optimizer, classification(),
                            step.StepOptions(batch_size=8))
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(3), tf.constant(0.0))
    # The first step's update overflowed: step 1 is named, though steps 2-3 ran too.
    assert float(sums[distributed.NONFINITE_AT][0]) == 1.0
    assert state.nonfinite() and int(state.step.numpy()) == 3


def test_the_wrapper_counts_every_step_and_reports_no_step_of_a_finite_run():
    strategy = _one_device()
    with strategy.scope():
        model = _no_bn_model()
        optimizer = optimizers.create("sgd", 0.1, model.trainable_variables, momentum=0.0)
    loop, state = step_loop(strategy, model, optimizer, classification(),
                            step.StepOptions(batch_size=8))
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(3), tf.constant(0.0))
    assert float(sums[distributed.NONFINITE_AT][0]) == 0.0
    assert int(state.step.numpy()) == 3 and int(optimizer.iterations.numpy()) == 3
    # The counter as the call left it, read in its graph (the loop checks it there).
    assert float(sums[distributed.STEP_COUNTER][0]) == 3.0
    sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(2), tf.constant(0.0))
    assert float(sums[distributed.STEP_COUNTER][0]) == 5.0
    means = distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums))
    assert not set(distributed.LOOP_KEYS) & set(means)  # (the loop's, not metrics)


# --- metrics the wrapper sums -------------------------------------------------------

def test_a_per_step_value_may_be_python_numbers_on_two_replicas():
    """The documented (value, 1.0) of a per-step value, on 2 replicas (it used to
    fail: a Python number cannot be reduced across replicas)."""
    strategy = mirrored()
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop = distributed.make_train_loop(
        strategy, lambda batch: {"constant": (0.5, 1.0), "helper": step.per_step(2.0)})
    sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(3), tf.constant(0.0))
    means = distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums))
    assert means == {"constant": 0.5, "helper": 2.0}


@pytest.mark.parametrize("value,message", [
    (tf.constant(1.0), "'bad' is a tensor, not a (total, weight) pair"),
    ((1.0, 2.0, 3.0), "'bad' is a tuple of 3, not a (total, weight) pair"),
    ((1.0, tf.ones(3)), "'bad' has a weight of shape (3,)"),
    (("x", 1.0), "'bad' has a string/float32 (total, weight)"),
])
def test_a_metric_the_wrapper_cannot_sum_is_one_line_naming_it(value, message):
    from trainer.settings import message_of
    strategy = _one_device()
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop = distributed.make_train_loop(strategy, lambda batch: {"bad": value})
    with pytest.raises(distributed.StepContractError) as raised:
        loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(1),
             tf.constant(0.0))
    assert message in message_of(raised.value) and "\n" not in message_of(raised.value)


def test_a_task_metric_named_like_the_steps_own_is_refused():
    from trainer.settings import message_of
    task = classification()
    original = task.loss
    task.loss = lambda batch, outputs: (original(batch, outputs)[0],
                                        {"grad_norm": (1.0, 1.0)})
    with pytest.raises(distributed.StepContractError) as raised:
        _train(_one_device(), task=task)
    assert "'grad_norm', which the step reports itself" in message_of(raised.value)


def test_every_replica_holds_the_same_batch_norm_statistics_after_a_step(tiny_config):
    """Batch-norm moves each replica's copy of its moving statistics by that
    replica's examples; the wrapper averages them after every step. Without it the
    checkpoint holds replica 0's, a resume gives them to every replica, and a step
    that reads them (an attack or a teacher in inference mode) is not bitwise
    what the uninterrupted run did."""
    from data import sources
    from trainer import build
    spec = sources.get_spec("synthetic")
    config = tiny_config.replace(cpu_replicas=2)
    strategy = mirrored()
    run = build.build_run(config, spec, build.plan(config, spec, 2), strategy)
    statistics = run.state.replica_statistics()
    assert statistics and all("moving" in v.path for v in statistics)
    before = [v.numpy() for v in statistics]
    images = tf.random.stateless_normal([16, 32, 32, 3], (1, 2))  # two different halves
    batch = {"image": images, "label": tf.range(16, dtype=tf.int32) % 10,
             "index": tf.range(16, dtype=tf.int32)}
    train_loop = distributed.make_train_loop(strategy, run.train_steps, state=run.state)
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    train_loop(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(2),
               tf.constant(0.0))
    for variable, old in zip(statistics, before):
        copies = [c.numpy() for c in strategy.experimental_local_results(variable.value)]
        assert not np.array_equal(copies[0], old), variable.path  # they moved
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=variable.path)


# --- steps on a schedule (Task.train_steps, step.Steps) --------------------------------

def test_a_schedule_names_its_step_from_the_step_counter_alone():
    cycle = step.Steps((("critic", None, 5), ("generator", None, 1)))
    assert [cycle.name_at(t) for t in range(13)] == (["critic"] * 5 + ["generator"]) * 2 + [
        "critic"]
    assert [int(cycle.index_at(tf.constant(t, tf.int64))) for t in range(7)] == [
        0, 0, 0, 0, 0, 1, 0]
    phases = step.Steps((("head", None, 4), ("whole", None, 0)), repeat=False)
    assert [phases.name_at(t) for t in (0, 3, 4, 10_000)] == ["head", "head", "whole",
                                                              "whole"]
    assert phases.cycle == 4 and cycle.describe() == "critic x5, generator x1, repeated"
    for bad in ((("a", None, 0),), (("a", None, 1), ("a", None, 1))):
        with pytest.raises(ValueError):
            step.Steps(bad)
    with pytest.raises(ValueError, match="the last 0"):
        step.Steps((("head", None, 4), ("whole", None, 3)), repeat=False)


def _two_models_two_optimizers(strategy):
    with strategy.scope():
        first, second = _no_bn_model(seed=3), _no_bn_model(seed=4)
        state = state_lib.TrainState(
            {"main": first, "other": second},
            {"main": optimizers.create("adam", 0.01, first.trainable_variables),
             "other": optimizers.create("adam", 0.01, second.trainable_variables)},
            state_lib.new_step_counter(), seed=0)
    return state


@pytest.mark.parametrize("replicas", [1, 2])
def test_scheduled_steps_run_only_their_own_update_and_each_optimizer_counts_its_own(
        replicas):
    """3 steps of "main", then 1 of "other", repeated, over 10 steps in loops of 4
    and 6: "main" is updated 8 times, "other" 2; each optimizer's iterations are
    its real updates (Adam's bias correction), the step counter 10; each metric
    is the mean over the steps that returned it; the result is that of the same
    updates done by hand in that order."""
    strategy = mirrored() if replicas == 2 else _one_device()
    state = _two_models_two_optimizers(strategy)
    options = step.StepOptions(batch_size=8)

    def update(name):
        def train(state_, batch, options_):
            model = state_.models[name]
            objective = step.Objective(
                lambda b: (tf.reduce_sum(tf.square(model(b["image"], training=True)), -1),
                           {}), model.trainable_variables, (model,),
                state_.optimizers[name])
            gradients, sums = step.summed_gradients(objective, batch, options_)
            step.apply_or_skip(objective.optimizer, gradients, objective.variables, True)
            return {f"{name}_loss": sums["loss"], "count": step.per_step(1.0)}
        return train

    schedule = step.Steps((("main", update("main"), 3), ("other", update("other"), 1)))
    loop = distributed.make_train_loop(
        strategy, schedule.bound(lambda fn: lambda batch: fn(state, batch, options)),
        state=state)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(_batch()).repeat())
    iterator = iter(dataset)
    first, _ = loop(iterator, tf.constant(4), tf.constant(0.0))
    second, _ = loop(iterator, tf.constant(6), tf.constant(0.0))
    assert int(state.step.numpy()) == 10
    assert int(state.optimizers["main"].iterations.numpy()) == 8
    assert int(state.optimizers["other"].iterations.numpy()) == 2
    # Each metric's weight counts the steps (or examples) that returned it.
    assert float(first["main_loss"][1]) == 3 * 8 and float(first["other_loss"][1]) == 8
    assert float(second["main_loss"][1]) == 5 * 8 and float(second["other_loss"][1]) == 8
    # (a per-step value weighs 1 on each replica)
    assert float(first["count"][1]) == 4 * replicas
    assert float(second["count"][1]) == 6 * replicas

    # The same 10 updates by hand, in the schedule's order, on one device.
    reference = _two_models_two_optimizers(_one_device())
    by_hand = {name: distributed.make_train_loop(
        _one_device(), lambda batch, fn=update(name): fn(reference, batch, options))
        for name in ("main", "other")}
    hand_iterator = iter(tf.data.Dataset.from_tensors(_batch()).repeat())
    for t in range(10):
        by_hand[schedule.name_at(t)](hand_iterator, tf.constant(1), tf.constant(0.0))
    for name in ("main", "other"):
        for a, b in zip(reference.models[name].get_weights(),
                        state.models[name].get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_held_back_update_does_not_advance_its_optimizers_iterations():
    """apply_or_skip(..., apply=False): no update, and the optimizer's own count
    stays that of its real updates (10 calls, 2 applied: 2), so Adam's bias
    correction is that of 2 updates: the weights equal those of 2 plain updates."""
    strategy = _one_device()
    with strategy.scope():
        held, plain = _no_bn_model(), _no_bn_model()
        held_optimizer = optimizers.create("adam", 0.01, held.trainable_variables)
        plain_optimizer = optimizers.create("adam", 0.01, plain.trainable_variables)
    gradients = [tf.ones_like(v) for v in held.trainable_variables]

    @tf.function
    def held_back(apply):
        strategy.run(lambda: step.apply_or_skip(held_optimizer, gradients,
                                                held.trainable_variables, apply))

    @tf.function
    def applied():
        strategy.run(lambda: step.apply_or_skip(plain_optimizer, gradients,
                                                plain.trainable_variables, True))

    for call in range(10):
        held_back(tf.constant(call % 5 == 4))
    applied()
    applied()
    assert int(held_optimizer.iterations.numpy()) == 2
    for a, b in zip(held.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_the_loop_holds_the_step_once_and_a_call_of_one_step_runs_one():
    """The graph the first call optimizes holds one call of the step (a first step
    peeled off before the loop made two: twice the graph, twice xception's first
    call); a call given 1 step runs 1, given 3 runs 3; a total whose shape varies
    from batch to batch is one line."""
    from trainer.settings import message_of
    strategy = _one_device()
    dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
    loop = distributed.make_train_loop(
        strategy, lambda batch: {"special": (tf.math.bessel_i0e(1.0), 1.0)})
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    graph = loop.get_concrete_function(iterator, tf.constant(1), tf.constant(0.0)).graph
    definition = graph.as_graph_def()
    bodies = {f.signature.name: f.node_def for f in definition.library.function}
    with_step = {name for name, nodes in bodies.items()
                 if any(n.op == "BesselI0e" for n in nodes)}
    assert len(with_step) == 1, with_step  # traced once
    calls = [n for nodes in [definition.node, *bodies.values()] for n in nodes
             if n.op in ("PartitionedCall", "StatefulPartitionedCall")
             and n.attr["f"].func.name in with_step]
    assert len(calls) == 1, [n.name for n in calls]  # and called from one place
    for steps in (1, 3):
        sums, _ = loop(iterator, tf.constant(steps), tf.constant(0.0))
        assert int(sums[distributed.STEPS_DONE][0]) == steps
        assert float(sums["special"][1]) == steps
    varying = distributed.make_train_loop(
        strategy, lambda batch: {"ragged": (tf.zeros([tf.size(tf.unique(
            tf.reshape(batch["label"], [-1]))[0])]), 1.0)})
    with pytest.raises(distributed.StepContractError) as raised:
        varying(iter(strategy.experimental_distribute_dataset(dataset)), tf.constant(1),
                tf.constant(0.0))
    assert "varies from batch to batch" in message_of(raised.value)


def test_a_step_keeps_autograph_under_the_unconverted_loop():
    """The loops are traced without AutoGraph (start-up); a step's own Python `if`
    and `for` on tensors are still converted, one replica and two."""
    def branchy(batch):
        total = tf.constant(0.0)
        for _ in tf.range(3):  # a graph loop only under AutoGraph
            total += 1.0
        if tf.reduce_sum(batch["label"]) >= 0:  # a cond only under AutoGraph
            total += 10.0
        return {"branchy": (total, 1.0)}

    for strategy in (_one_device(), mirrored()):
        dataset = tf.data.Dataset.from_tensors(_batch()).repeat()
        loop = distributed.make_train_loop(strategy, branchy)
        sums, _ = loop(iter(strategy.experimental_distribute_dataset(dataset)),
                       tf.constant(2), tf.constant(0.0))
        replicas = strategy.num_replicas_in_sync
        assert float(sums["branchy"][0]) == 13.0 * 2 * replicas
