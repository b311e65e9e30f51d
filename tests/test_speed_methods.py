"""The speed records' methods as pieces (issue 13): patch whitening, identity init,
learning-rate multipliers, Lookahead, alternating flip, multi-crop TTA, and the
loop's FLOP/s and profiler, each checked on tiny inputs."""
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, mirrored, classification, step_loop, stopped_then_resumed
import models
from data import augment, pipeline
from models.layers import Dirac, PatchWhitening
from trainer import averaging, optimizers, step
from trainer.config import ConfigError
from trainer.run_settings import validate


# --- patch whitening and identity init ----------------------------------------------

def test_the_whitening_layer_whitens_the_patches_of_its_data():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(64, 8, 8, 3)).astype(np.float32)
    images[..., 1] = 0.9 * images[..., 0] + 0.1 * images[..., 1]  # correlated channels
    images[:, :, 1:] += 2.0 * images[:, :, :-1]  # and neighbouring pixels
    layer = PatchWhitening(3, kernel_size=2, eps=1e-9)  # airbench's 5e-4 damps the
    layer.build((None, 8, 8, 3))  # smallest directions a little
    layer.init_from_data(images)
    outputs = keras.ops.convert_to_numpy(layer(images)).reshape(-1, 24).astype(np.float64)
    covariance = outputs[:, :12].T @ outputs[:, :12] / len(outputs)  # about the origin
    np.testing.assert_allclose(covariance, np.eye(12), atol=1e-3)
    np.testing.assert_allclose(outputs[:, 12:], -outputs[:, :12], rtol=1e-5, atol=1e-5)
    # The raw patches were far from white; the kernel is data, only the bias trains.
    raw = models.layers.patches(images.astype(np.float64), 2)
    assert np.abs(raw.T @ raw / len(raw) - np.eye(12)).max() > 1.0
    assert [v.path for v in layer.trainable_variables] == [layer.bias.path]


def test_the_loop_initialises_whitening_from_data_only_for_models_that_have_it():
    airbench = models.build("airbench", 10, (32, 32, 3), tiny=True)
    assert models.needs_data(airbench)
    assert not models.needs_data(models.build("resnet_fast", 10, (32, 32, 3), tiny=True))
    before = airbench.get_layer("whiten").kernel.numpy().copy()
    images = np.random.default_rng(1).normal(size=(16, 32, 32, 3)).astype(np.float32)
    assert models.init_from_data(airbench, images) == ["whiten"]
    assert not np.allclose(before, airbench.get_layer("whiten").kernel.numpy())
    without = models.build("airbench", 10, (32, 32, 3), tiny=True, options="whiten=false")
    assert not models.needs_data(without)


def test_identity_init_passes_the_first_channels_through():
    conv = keras.layers.Conv2D(6, 3, padding="same", use_bias=False,
                               kernel_initializer=Dirac("he_normal"))
    x = np.random.default_rng(0).normal(size=(2, 5, 5, 4)).astype(np.float32)
    y = keras.ops.convert_to_numpy(conv(x))
    np.testing.assert_allclose(y[..., :4], x, rtol=1e-6, atol=1e-6)
    assert np.abs(conv.kernel.numpy()[..., 4:]).sum() > 0  # the rest stay random


def test_airbench_layers_survive_a_config_round_trip():
    """check_step and Keras' own saving rebuild models from their config."""
    model = models.build("airbench", 10, (32, 32, 3), tiny=True)
    again = keras.Model.from_config(model.get_config())
    assert isinstance(again.get_layer("whiten"), PatchWhitening)
    assert again.get_layer("whiten").kernel_size == (2, 2)
    assert [v.shape for v in again.weights] == [v.shape for v in model.weights]


def test_model_options_reach_the_builder_and_bad_ones_are_one_line_errors():
    small = models.build("airbench", 10, (32, 32, 3), options="widths=8:16:16")
    assert small.count_params() < models.build("airbench_small", 10, (32, 32, 3)).count_params()
    with pytest.raises(ValueError, match="valid: widths=VALUE, whiten=VALUE, dirac=VALUE"):
        models.build("airbench", 10, (32, 32, 3), options="depth=3")
    with pytest.raises(ValueError, match="not like the default"):
        models.build("airbench", 10, (32, 32, 3), options="whiten=maybe")


# --- learning-rate multipliers ------------------------------------------------------

def test_lr_multipliers_scale_the_update_of_matching_variables_not_the_decay():
    alpha = keras.Variable(np.ones(3, np.float32), name="alpha")
    beta = keras.Variable(np.ones(3, np.float32), name="beta")
    kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
    optimizer = optimizers.create("sgd", 0.1, [alpha, beta, kernel], momentum=0.0,
                                  weight_decay=0.5, lr_multipliers="alpha=64,beta=0")
    gradient = [tf.fill((3,), 0.01), tf.fill((3,), 0.01), tf.fill((2, 2), 0.01)]
    optimizer.apply(gradient, [alpha, beta, kernel])
    np.testing.assert_allclose(alpha.numpy(), 1 - 0.1 * 64 * 0.01, rtol=1e-6)
    np.testing.assert_allclose(beta.numpy(), 1.0)
    # The kernel: decayed by lr x wd (not multiplied), then the plain step.
    np.testing.assert_allclose(kernel.numpy(), (1 - 0.1 * 0.5) - 0.1 * 0.01, rtol=1e-6)


def test_lr_multiplier_patterns_match_paths_and_a_typo_is_an_error():
    model = models.build("airbench", 10, (32, 32, 3), tiny=True)
    pairs = optimizers.parse_lr_multipliers("*/beta=64")
    factors = optimizers.lr_multipliers(model.trainable_variables, pairs)
    for variable, factor in zip(model.trainable_variables, factors):
        assert factor == (64.0 if variable.path.endswith("/beta") else 1.0), variable.path
    assert factors.count(64.0) == 6  # two batch-norms in each of three groups
    with pytest.raises(ValueError, match="match"):
        optimizers.lr_multipliers(model.trainable_variables, [("*/gamma", 2.0)])
    with pytest.raises(ValueError, match="PATTERN=FACTOR"):
        optimizers.parse_lr_multipliers("*/beta")


def _frozen_run(freeze_text: str, steps: int, strategy=None, decay_vectors=True):
    """`steps` SGD-Nesterov updates (decay 0.5) of a vector and a kernel, with
    `freeze_text` (--freeze_after_epochs, 1 step an epoch); the values after each."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        alpha = keras.Variable(np.ones(3, np.float32), name="alpha")
        kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
        optimizer = optimizers.create("sgd", 0.1, [alpha, kernel], momentum=0.85,
                                      weight_decay=0.5, decay_vectors=decay_vectors,
                                      freeze_after_epochs=freeze_text, steps_per_epoch=1)

    @tf.function
    def update(k):
        gradient = [tf.fill((3,), 0.01) * k, tf.fill((2, 2), 0.02) * k]
        strategy.run(lambda: optimizers.apply_or_skip(
            optimizer, gradient, [alpha, kernel], tf.constant(True)))

    history = []
    for k in range(steps):
        update(tf.constant(k + 1.0))
        history.append((alpha.numpy().copy(), kernel.numpy().copy()))
    return history


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_frozen_variable_stops_at_its_step_and_nothing_else_changes(replicas):
    """airbench's whitening bias: trained for 3 epochs, then requires_grad=False
    (no gradient step, no weight decay). Before its step a frozen variable moves
    bitwise as it would unfrozen (its decay, moved out of Keras' pass, is the same
    sum); from it on it stays; the other variables never notice."""
    strategy = mirrored() if replicas == 2 else None
    free = _frozen_run("", 4, strategy)
    frozen = _frozen_run("alp*=2", 4, strategy)  # frozen from optimizer step 2
    for i in range(4):
        np.testing.assert_array_equal(frozen[i][1], free[i][1])  # the kernel
    for i in (0, 1):
        np.testing.assert_array_equal(frozen[i][0], free[i][0])
    for i in (2, 3):
        np.testing.assert_array_equal(frozen[i][0], frozen[1][0])
    assert not np.array_equal(free[3][0], free[1][0])
    # Without --decay_vectors the vector is not decayed, frozen or not.
    plain, plain_frozen = _frozen_run("", 2, decay_vectors=False), _frozen_run(
        "alpha=1", 2, decay_vectors=False)
    np.testing.assert_allclose(plain[0][0], 1 - 0.1 * 0.01 * (1 + 0.85), rtol=1e-6)
    np.testing.assert_array_equal(plain_frozen[0][0], plain[0][0])
    np.testing.assert_array_equal(plain_frozen[1][0], plain_frozen[0][0])


def test_a_freeze_pattern_that_matches_nothing_is_refused():
    variables = [keras.Variable(np.ones(3, np.float32), name="alpha")]
    with pytest.raises(ValueError, match="--freeze_after_epochs: whiten/\\* match"):
        optimizers.create("sgd", 0.1, variables, freeze_after_epochs="whiten/*=3")
    with pytest.raises(ValueError, match="--freeze_after_epochs: 'whiten' is not "
                                         "PATTERN=EPOCHS"):
        optimizers.create("sgd", 0.1, variables, freeze_after_epochs="whiten")


def test_airbench_freezes_its_whitening_bias_after_3_epochs():
    from trainer import recipes
    assert recipes.RECIPES["airbench_small"]["freeze_after_epochs"] == "whiten/*=3"
    model = models.build("airbench", 10, (32, 32, 3), tiny=True)
    optimizer = optimizers.create("sgd", 0.1, model.trainable_variables,
                                  weight_decay=0.01, decay_vectors=True,
                                  freeze_after_epochs="whiten/*=3", steps_per_epoch=48)
    steps = dict(zip((v.path for v in model.trainable_variables),
                     optimizer._freeze_steps))  # noqa: SLF001
    assert steps.pop("whiten/bias") == 144 and set(steps.values()) == {None}


# --- Lookahead --------------------------------------------------------------------

def _model(seed: int = 3) -> keras.Model:
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=init)(inputs)
    logits = keras.layers.Dense(5, kernel_initializer=init)(keras.layers.Flatten()(x))
    return keras.Model(inputs, logits)


def _batches(count: int = 5, size: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"image": tf.constant(rng.normal(size=(size, 6, 6, 3)), tf.float32),
             "label": tf.constant(rng.integers(0, 5, size), tf.int32)}
            for _ in range(count)]


def _sgd_steps(strategy, weights, batches, lookahead_every=0, decay=0.9, total=5,
               all_replicas=False):
    """Weights after SGD (lr 0.5, no momentum) steps over `batches`, with Lookahead."""
    with strategy.scope():
        model = _model()
        model.set_weights(weights)
        optimizer = optimizers.create("sgd", 0.5, model.trainable_variables, momentum=0.0)
        if lookahead_every:
            averaging.add_lookahead(optimizer, model.trainable_variables)
            # the slow copies are the optimizer's; the model's weights stay the model's
            model_paths = {v.path for v in model.trainable_variables}
            assert not model_paths & {v.path for v in optimizer.variables}
    options = step.StepOptions(batch_size=8, lookahead_every=lookahead_every,
                               lookahead_decay=decay, total_steps=total)
    dataset = tf.data.Dataset.from_tensor_slices(
        {key: tf.stack([b[key] for b in batches]) for key in batches[0]})
    loop, _ = step_loop(strategy, model, optimizer, classification(), options)
    loop(iter(strategy.experimental_distribute_dataset(dataset)),
         tf.constant(len(batches)), tf.constant(0.0))
    if all_replicas:  # [replica][variable]: every replica's own copy
        return [[v.numpy() for v in replica] for replica in zip(
            *(strategy.experimental_local_results(v.value) for v in model.weights))]
    return model.get_weights()


@pytest.mark.parametrize("replicas", [1, 2])
def test_lookahead_matches_a_hand_computation(replicas):
    strategy = mirrored() if replicas == 2 else tf.distribute.OneDeviceStrategy(CPUS[0])
    batches = _batches(5)
    start = _model().get_weights()
    trained = _sgd_steps(strategy, start, batches, lookahead_every=2, decay=0.9, total=5,
                         all_replicas=True)
    assert len(trained) == replicas
    # By hand: plain SGD steps; after steps 2 and 4 slow += (1 - d)(fast - slow) with
    # d = 0.9^2 (t/5)^3, and fast = slow; after the last step (5) fast = slow.
    one = tf.distribute.OneDeviceStrategy(CPUS[0])
    fast, slow = start, [w.copy() for w in start]
    for t, batch in enumerate(batches, start=1):
        fast = _sgd_steps(one, fast, [batch])
        if t % 2 == 0 or t == 5:
            decay = 0.81 * (t / 5) ** 3 if t % 2 == 0 else 1.0
            slow = [s + (1 - decay) * (f - s) for s, f in zip(slow, fast)]
            fast = [s.copy() for s in slow]
    for replica in trained:
        for got, want in zip(replica, fast):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not all(np.allclose(a, b) for a, b in zip(trained[0], _sgd_steps(one, start,
                                                                              batches)))


def test_lookahead_decay_grows_as_the_cube_of_progress():
    assert float(averaging.lookahead_decay(0, 5, 0.95, 100)) == 0.0
    assert float(averaging.lookahead_decay(50, 5, 0.95, 100)) == pytest.approx(
        0.95 ** 5 / 8)
    assert float(averaging.lookahead_decay(100, 5, 0.95, 100)) == pytest.approx(0.95 ** 5)


# --- alternating flip -------------------------------------------------------------

def _ramps(n: int) -> tf.data.Dataset:
    """Image i: a left-to-right ramp offset by i (so its mirror image differs)."""
    ramp = tf.range(8, dtype=tf.int32)[None, :, None] * 3
    return tf.data.Dataset.range(n).map(lambda i: (
        tf.cast(tf.broadcast_to(ramp + tf.cast(i, tf.int32), (8, 8, 3)), tf.uint8),
        tf.cast(i, tf.int32)))


def _flip_stream(start_step: int, steps: int, n: int = 40):
    ds = pipeline.make_train(_ramps(n), tf.distribute.InputContext(1, 0, 1), 8,
                             augment.identity,
                             lambda images, labels: (tf.cast(images, tf.float32), labels),
                             shuffle_buffer=16, seed=5, start_step=start_step,
                             alternating_flip=True)
    batches = list(ds.take(steps))
    return (np.concatenate([b["image"].numpy() for b in batches]),
            np.concatenate([b["label"].numpy() for b in batches]))


def test_alternating_flip_alternates_per_image_and_resumes_exactly():
    images, labels = _flip_stream(0, 15)  # 3 epochs of 5 steps, 40 images
    mirrored_in = {}  # (epoch, label) -> is the image mirrored
    for position, (image, label) in enumerate(zip(images, labels)):
        increasing = image[0, 1, 0] > image[0, 0, 0]
        mirrored_in[(position // 40, int(label))] = not increasing
    for label in range(40):  # each image alternates, epoch after epoch
        assert mirrored_in[(0, label)] != mirrored_in[(1, label)]
        assert mirrored_in[(0, label)] == mirrored_in[(2, label)]
    first_epoch = [mirrored_in[(0, label)] for label in range(40)]
    assert 10 < sum(first_epoch) < 30  # each image's first flip is its own coin

    def first_flips(seed):  # over 4,000 images: a fair coin, independent per image
        ramp = tf.tile(tf.constant([[[[0.0], [1.0]]]]), [4000, 1, 1, 1])
        flipped = augment.alternating_flip(ramp, tf.range(4000), 0, seed)
        return flipped[:, 0, 0, 0].numpy() == 1.0
    coins, other_seed = first_flips(0), first_flips(1)
    assert 0.45 < coins.mean() < 0.55
    assert 0.45 < (coins[1:] == coins[:-1]).mean() < 0.55
    assert 0.45 < (coins == other_seed).mean() < 0.55
    for start in (3, 5, 7):  # mid-epoch and at an epoch boundary: bitwise the same
        resumed, resumed_labels = _flip_stream(start, 15 - start)
        np.testing.assert_array_equal(resumed, images[start * 8:])
        np.testing.assert_array_equal(resumed_labels, labels[start * 8:])


def test_alternating_flip_needs_an_augmentation_that_does_not_flip(tiny_config):
    with pytest.raises(ConfigError, match="use translate or none"):
        validate(tiny_config.replace(alternating_flip=True, augment="pad_crop_flip"),
                 models.names(), ("synthetic",))
    validate(tiny_config.replace(alternating_flip=True, augment="translate"),
             models.names(), ("synthetic",))


def test_translate_moves_by_at_most_two_pixels_with_reflected_borders():
    image = tf.reshape(tf.range(64, dtype=tf.int32), (1, 8, 8, 1))
    images = tf.cast(tf.tile(image, (32, 1, 1, 3)), tf.uint8)
    moved, _ = augment.TRAIN_AUGMENTATIONS["translate"](images, None, tf.constant([1, 2]))
    padded = np.pad(image.numpy()[0, ..., 0], 2, mode="reflect")
    crops = {(r, c): padded[r:r + 8, c:c + 8] for r in range(5) for c in range(5)}
    found = set()
    for view in moved.numpy()[..., 0]:
        match = [key for key, crop in crops.items() if np.array_equal(view, crop)]
        assert len(match) == 1  # a reflect-padded crop, never mirrored
        found.add(match[0])
    assert len(found) > 5


# --- multi-crop test-time augmentation ---------------------------------------------

def test_multi_crop_tta_averages_the_six_airbench_views():
    model = _model()
    images = np.random.default_rng(2).normal(size=(4, 6, 6, 3)).astype(np.float32)
    f = lambda x: model(x, training=False).numpy()  # noqa: E731
    mirror = lambda x: x[:, :, ::-1]  # noqa: E731
    padded = np.pad(images, [(0, 0), (1, 1), (1, 1), (0, 0)], mode="reflect")
    up_left, down_right = padded[:, :6, :6], padded[:, 2:, 2:]
    both = lambda x: (f(x) + f(mirror(x))) / 2  # noqa: E731
    want = 0.5 * both(images) + 0.25 * both(up_left) + 0.25 * both(down_right)
    got = classification(tta_flip=True, tta_translate=True).predict(model,
                                                                    tf.constant(images))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    only_translate = 0.5 * f(images) + 0.25 * f(up_left) + 0.25 * f(down_right)
    np.testing.assert_allclose(classification(tta_translate=True).predict(
        model, tf.constant(images)), only_translate, rtol=1e-5, atol=1e-5)


# --- the recipe through the loop: FLOP/s, profiler, exact resume -------------------

def _airbench_config(tiny_config, **changes):
    return tiny_config.replace(
        model="airbench", batch_size=16, train_steps=8, steps_per_loop=2, log_every=2,
        eval_every=8, checkpoint_every=4, optimizer="sgd", momentum=0.85,
        learning_rate=0.2, lr_schedule="linear", warmup_epochs=0.0, weight_decay=5e-3,
        lr_multipliers="*/beta=64", augment="translate", alternating_flip=True,
        lookahead_every=3, deterministic=True,
        freeze_after_epochs="whiten/*=0.005",  # at step 3 of 625 an epoch
        **changes).with_settings(
            label_smoothing=0.2, tta_flip=True, tta_translate=True)


def test_the_profiler_marks_each_traced_step_for_xprof(tmp_path):
    """--profile_steps=A,B: the loop stops at every step from A to B, and each
    traced call is one step marked for XProf, numbered as the log numbers it: the
    Overview Page finds steps A+1 to B and their time (not "No step marker
    observed", every time 0.0 ms), which one call of many in-graph steps, or no
    marker, would not give. (With more than 5 steps XProf drops the first and the
    last, as maybe incomplete: 2,6 traces 4.)"""
    from trainer import loop
    from trainer.output import progress
    from trainer.tools import profile_summary
    from xprof.convert import raw_to_tool_data
    profiler = progress.Profiler((2, 6), str(tmp_path / "train"))
    stops, current = [], 0
    x = tf.random.stateless_normal((256, 256), seed=(0, 0))

    @tf.function
    def work(x):
        return tf.reduce_sum(tf.matmul(x, x))

    with profiler.stopped_at_exit():
        while current < 8:
            stop = loop._next_stop(current, 8, 8, marks=profiler.marks)
            with profiler.step(current, stop):
                for _ in range(stop - current):
                    work(x).numpy()
            stops.append(stop)
            current = stop
    assert stops == [2, 3, 4, 5, 6, 8] and not profiler.running
    trace = profile_summary.newest_trace(str(tmp_path))
    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "overview_page",
                                                   {"use_saved_result": False})
    table = next(t for t in json.loads(data)
                 if any(c["id"] == "stepnum" for c in t.get("cols", [])))
    columns = [c["id"] for c in table["cols"]]
    rows = [dict(zip(columns, (cell.get("v") for cell in row["c"]))) for row in table["rows"]]
    assert [row["stepnum"] for row in rows] == ["train 3", "train 4", "train 5", "train 6"]
    assert all(row["stepTimeMs"] > 0 for row in rows)
    assert float(table["p"]["steptime_ms_average"]) > 0


@pytest.mark.long(57)  # seconds, with -n 2
def test_airbench_logs_flops_profiles_and_resumes_bitwise_after_a_kill(
        tiny_config, monkeypatch, caplog):
    """A straight run logs FLOP/s and writes a profile; a run killed after its
    step-4 checkpoint (Lookahead's slow weights, the whitening and the alternating
    flip all come back) ends with the straight run's weights: profiling and
    measuring the peak change nothing."""
    import logging
    from trainer import loop
    from trainer.tools import profile_summary
    from trainer import flops
    real_peak = flops.peak_flops  # a smaller matmul: the peak's use, not its value
    monkeypatch.setattr(flops, "peak_flops", lambda precision: real_peak(precision, n=512))
    config = _airbench_config(tiny_config, measure_peak=True, profile_steps="2,6")
    with caplog.at_level(logging.INFO, logger="absl"):
        straight = loop.train_and_evaluate(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 4 and all("GFLOP/s" in line and "% of peak" in line
                                   for line in lines)
    assert straight["training_flops_per_image"] > 1e6
    assert straight["gflops_per_second"] > 0 and 0 < straight["fraction_of_peak"] < 2
    with open(os.path.join(config.model_dir, "metrics.json")) as f:
        history = json.load(f)["train_history"]
    assert all(record["gflops_per_second"] > 0 for record in history)
    trace = profile_summary.newest_trace(config.model_dir)
    assert trace.startswith(os.path.join(config.model_dir, "train", "plugins", "profile"))
    # TensorBoard's Profile tab (tensorboard-plugin-profile) finds it and its tools
    import argparse
    from tensorboard.plugins import base_plugin
    from xprof import profile_plugin
    profile_tab = profile_plugin.ProfilePlugin(base_plugin.TBContext(
        logdir=config.model_dir, flags=argparse.Namespace(master_tpu_unsecure_channel="")))
    [profiled] = profile_tab.generate_runs()
    assert profiled.startswith("train/")
    assert {"overview_page", "trace_viewer@"} <= set(profile_tab.run_tools_imp(profiled))
    summary = profile_summary.summarize(trace)
    assert summary["parts"]["convolution"]["backward"] > 0
    assert "| convolution |" in profile_summary.markdown(summary)
    # the loop set the (frozen) whitening from the first training images
    from trainer import build, inputs
    saved = models.build("airbench", 10, (32, 32, 3), tiny=True)
    saved.load_weights(os.path.join(config.model_dir, "model.weights.h5"))
    want = models.layers.whitening_kernel(
        inputs.init_images(build.run_data(config)), 2)
    np.testing.assert_allclose(saved.get_layer("whiten").kernel.numpy(), want,
                               rtol=1e-4, atol=1e-4)

    config = _airbench_config(tiny_config, model_dir=tiny_config.model_dir + "_killed")
    resumed = stopped_then_resumed(config, monkeypatch, at_step=6)
    assert resumed["resumed_from_step"] == 4
    assert resumed["weights_sha256"] == straight["weights_sha256"]


@pytest.mark.long(15)  # seconds, with -n 2
def test_weights_given_with_weights_keep_their_whitening(tiny_config, tmp_path):
    """--weights brings the whitening it was saved with: the loop does not set it
    again from the data."""
    from trainer import loop
    saved = models.build("airbench", 10, (32, 32, 3), tiny=True)
    kernel = saved.get_layer("whiten").kernel
    kernel.assign(np.full(kernel.shape, 0.125, np.float32))
    path = str(tmp_path / "start.weights.h5")
    saved.save_weights(path)
    config = _airbench_config(tiny_config, weights=path).replace(train_steps=2,
                                                                 eval_every=2)
    loop.train_and_evaluate(config)
    final = models.build("airbench", 10, (32, 32, 3), tiny=True)
    final.load_weights(os.path.join(config.model_dir, "model.weights.h5"))
    np.testing.assert_array_equal(final.get_layer("whiten").kernel.numpy(), 0.125)


# --- reporting ---------------------------------------------------------------------

def test_compare_runs_finds_the_first_evaluation_at_target_and_groups_runs():
    from trainer.tools import compare_runs

    def run(final, curve):
        return {"test_accuracy": final, "train_seconds": 100.0,
                "images_per_second": 10.0, "gflops_per_second": 1.0,
                "eval_history": [{"epoch": e, "train_seconds": 10.0 * e,
                                  "test_accuracy": a} for e, a in curve]}

    a = run(0.93, [(2, 0.80), (4, 0.921), (6, 0.93)])
    b = run(0.91, [(2, 0.85), (4, 0.91)])
    assert compare_runs.first_at(a, 0.92)["epoch"] == 4
    assert compare_runs.first_at(b, 0.92) is None
    rows = compare_runs.run_rows({"a": a, "b": b}, 0.92)
    assert rows[2].endswith("| epoch 4.0, 40 s |") and rows[3].endswith("not reached |")
    table = compare_runs.group_rows({"all on": [a, b], "one off": [b, b]})
    assert "| all on | 2 | 92.00 ± 1.41 | +0.00 |" in table[2]
    assert "| one off | 2 | 91.00 ± 0.00 | -1.00 |" in table[3]


def test_compare_runs_shows_the_settings_that_differ_and_whole_curves(tmp_path, command):
    """Three runs' directories: a column for each setting that differs between
    them (not where they are); curves by epoch (default), step or seconds, the
    y-axis holding every evaluation; a missing run is one error line, exit 2."""
    from trainer.tools import compare_runs
    dirs = []
    for seed, rate in ((0, 1e-3), (1, 1e-3), (2, 3e-3)):
        run_dir = tmp_path / f"s{seed}"
        run_dir.mkdir()
        history = [{"step": 48 * e, "epoch": e, "train_seconds": 30.0 * e + seed,
                    "test_accuracy": a} for e, a in ((1, 0.31), (2, 0.55), (3, 0.6 + seed / 100))]
        settings = {"model": "cifar_cnn", "dataset": "cifar10", "seed": seed,
                    "learning_rate": rate, "model_dir": str(run_dir), "task_settings": {}}
        (run_dir / "metrics.json").write_text(json.dumps(
            {"test_accuracy": history[-1]["test_accuracy"], "train_seconds": 90.0,
             "images_per_second": 1.0, "eval_history": history, "settings": settings}))
        dirs.append(str(run_dir))
    runs = {os.path.basename(d): compare_runs.load(d) for d in dirs}
    header, _, first, *_ = compare_runs.run_rows(runs, 0.92)
    assert header.startswith("| run | learning_rate | seed | test accuracy |")
    assert first.startswith("| s0 | 0.001 | 0 | 60.00% |")
    assert compare_runs.curve(runs["s2"], "test_accuracy", "step") == [
        (48, pytest.approx(31.0)), (96, pytest.approx(55.0)), (144, pytest.approx(62.0))]
    fig = compare_runs.plot(runs, str(tmp_path / "curves.png"), 0.92)
    low, high = fig.axes[0].get_ylim()
    assert low < 31.0 and high > 92.0 and fig.axes[0].get_xlabel() == "epoch"
    status, out, _ = command("trainer.tools.compare_runs", f"--runs={','.join(dirs)}",
                             f"--plot={tmp_path / 'by_step.png'}", "--x=step")
    assert status == 0 and "| s2 | 0.003 | 2 | 62.00% |" in out
    assert (tmp_path / "by_step.png").read_bytes().startswith(b"\x89PNG")
    status, _, err = command("trainer.tools.compare_runs", f"--runs={tmp_path / 'none'}")
    assert status == 2 and err.strip().splitlines()[-1].startswith("error: ")
    status, out, _ = command("trainer.tools.compare_runs", *dirs)  # (as arguments too)
    assert status == 0 and "| s2 | 0.003 | 2 | 62.00% |" in out
    status, _, err = command("trainer.tools.compare_runs")
    assert status == 2 and err.strip().startswith("error: no runs to compare"), err


def test_profile_busy_time_counts_overlapping_events_once():
    from types import SimpleNamespace
    from trainer.tools import profile_summary
    events = [SimpleNamespace(offset_ps=s, duration_ps=d)
              for s, d in [(0, 10), (5, 10), (30, 5), (31, 1)]]
    assert profile_summary._busy_time(events) == 15 + 5
