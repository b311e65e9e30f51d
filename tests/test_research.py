"""Research that needs its own loop, in one file each (issue 30): the built-in gan
and simclr tasks and the docs' worked examples (a mean teacher, adversarial
training, DP-SGD: docs/examples/) train, check_step passes them and fails or
reports their planted bugs, a resume is bitwise for everything in the state, and
what a state must never hold or lack is one line."""
import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, example_task, plain_and_compiled_states, stopped_then_resumed
from test_check_step import _teacher_run
from trainer import check_step, checkpoints, loop, randomness, step
from trainer.tasks import gan, simclr, wgan_gp


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory) -> str:
    """A finished tiny classification run on the synthetic data (the Fréchet
    distance's features)."""
    return _teacher_run(tmp_path_factory.mktemp("classifier"))


def _gan(tiny_config, classifier: str = "", **changes):
    return tiny_config.replace(task="gan", model="dcgan", optimizer="adam",
                               learning_rate=2e-4, **changes).with_settings(
        fid_classifier_dir=classifier)


def _simclr(tiny_config, **changes):
    return tiny_config.replace(task="simclr", model="cifar_cnn", optimizer="adam",
                               **changes).with_settings(knn_k=20)


def _check(config):
    result = check_step.run_check(config.replace(batch_size=16), devices=CPUS[:2])
    return result, check_step.report(result)


# --- gan --------------------------------------------------------------------------

@pytest.mark.long(45)  # seconds, with -n 2
def test_gan_on_two_replicas_resumes_bitwise_with_a_distance_and_serves_its_generator(
        tiny_config, classifier_dir, tmp_path, monkeypatch):
    """Both networks, both optimizers and the step (state_sha256) and the
    generator's final weights after a stop and resume; then the generator served."""
    from trainer.serving import export, predict
    config = _gan(tiny_config, classifier_dir, cpu_replicas=2, deterministic=True)
    metrics = loop.train_and_evaluate(config)
    assert metrics["replicas"] == 2 and metrics["best_metric"] == "test_fid"
    assert np.isfinite(metrics["test_fid"]) and metrics["test_fid"] > 0
    assert "real_features" not in metrics  # (the sums became the distance)
    resumed = stopped_then_resumed(config.replace(model_dir=config.model_dir + "_2"),
                                   monkeypatch, at_step=4)
    assert resumed["resumed_from_step"] == 2
    assert resumed["state_sha256"] == metrics["state_sha256"]
    assert resumed["weights_sha256"] == metrics["weights_sha256"]
    exported = tf.saved_model.load(export.export(config.model_dir,
                                                 str(tmp_path / "generator")))
    latent = exported.signatures["serving_default"](latent=tf.zeros([2, 16]))["image"]
    seeded = exported.signatures["generate_from_seed"](seeds=tf.constant([0, 1]))["image"]
    assert latent.shape == seeded.shape == (2, 32, 32, 3) and latent.dtype == tf.uint8
    lines = predict.run(predict.parse([f"--model_dir={config.model_dir}", "--samples=4",
                                       f"--output_dir={tmp_path / 'out'}"]))
    assert "4 generated images" in lines[-1]
    grid = tf.io.decode_png(tf.io.read_file(str(tmp_path / "out" / "samples.png")))
    assert grid.shape == (64, 64, 3)


@pytest.mark.long(30)  # seconds, with -n 2
def test_gan_passes_the_check_and_a_discriminator_loss_per_replica_fails(
        tiny_config, monkeypatch):
    result, report = _check(_gan(tiny_config))
    assert result.passed, report
    assert {"g_loss", "d_real", "d_fake"} <= set(result.metrics)
    original = gan.Gan.discriminator_loss

    def per_replica_mean(discriminator, batch):
        # The bug: the discriminator's loss averaged over this replica's examples
        # (the step divides by the global batch: x replicas is the per-replica mean).
        loss, metrics = original(discriminator, batch)
        return loss * tf.distribute.get_replica_context().num_replicas_in_sync, metrics

    monkeypatch.setattr(gan.Gan, "discriminator_loss", staticmethod(per_replica_mean))
    result, report = _check(_gan(tiny_config))
    assert not result.passed, report
    assert result.metrics["grad_norm"][1] > 1.9 * result.metrics["grad_norm"][0]


# --- wgan_gp: two steps on a schedule ----------------------------------------------

def _wgan(tiny_config, classifier: str = "", **changes):
    return tiny_config.replace(task="wgan_gp", model="dcgan", optimizer="adam",
                               learning_rate=1e-4, optimizer_options="beta_1=0.0,beta_2=0.9",
                               **changes).with_settings(fid_classifier_dir=classifier,
                                                        critic_steps=2)


@pytest.mark.long(45)  # seconds, with -n 2
def test_wgan_gp_on_two_replicas_follows_its_schedule_and_resumes_bitwise_mid_cycle(
        tiny_config, classifier_dir, tmp_path, monkeypatch):
    """2 critic steps, 1 generator step, repeated, over 4 steps on 2 replicas: the
    critic's optimizer made 3 updates, the generator's 1 (their own iterations);
    stopped at step 2 (mid-cycle) and resumed, the whole state is bitwise that of
    the run straight through; the generator is served."""
    from trainer.serving import export
    config = _wgan(tiny_config, classifier_dir, cpu_replicas=2, deterministic=True)
    metrics = loop.train_and_evaluate(config)
    assert metrics["steps"] == 4 and metrics["best_metric"] == "test_fid"
    assert np.isfinite(metrics["test_fid"]) and metrics["test_fid"] > 0
    resumed = stopped_then_resumed(config.replace(model_dir=config.model_dir + "_2"),
                                   monkeypatch, at_step=4)
    assert resumed["resumed_from_step"] == 2
    assert resumed["state_sha256"] == metrics["state_sha256"]
    assert resumed["weights_sha256"] == metrics["weights_sha256"]
    # Each optimizer's own count: its real updates (read back from the checkpoint).
    saved = tf.train.load_checkpoint(tf.train.latest_checkpoint(config.model_dir))
    iterations = {key.split("/")[0]: int(saved.get_tensor(key))
                  for key in saved.get_variable_to_shape_map()
                  if key.startswith("optimizer") and "/_iterations/" in key}
    assert iterations == {"optimizer": 1, "optimizer_discriminator": 3}, iterations
    exported = tf.saved_model.load(export.export(config.model_dir,
                                                 str(tmp_path / "generator")))
    latent = exported.signatures["serving_default"](latent=tf.zeros([2, 16]))["image"]
    assert latent.shape == (2, 32, 32, 3) and latent.dtype == tf.uint8


@pytest.mark.long(40)  # seconds, with -n 2
def test_wgan_gp_passes_the_check_over_a_cycle_and_its_planted_bugs_fail(
        tiny_config, monkeypatch):
    result, report = _check(_wgan(tiny_config))
    assert result.passed, report
    assert "3 steps" in result.heading and "critic x2, generator x1" in result.heading
    assert {"critic_loss", "generator_loss", "gradient_penalty"} <= set(result.metrics)

    def batch_slope(critic, images):
        # The bug: one norm of the whole (replica's) batch's gradient, not each
        # example's: it depends on how the batch is split.
        with tf.GradientTape() as tape:
            tape.watch(images)
            scores = tf.reduce_sum(critic(images, training=True))
        norm = tf.norm(tape.gradient(scores, images))
        return tf.fill(tf.shape(images)[:1], norm)

    monkeypatch.setattr(wgan_gp, "slope_norms", batch_slope)
    result, report = _check(_wgan(tiny_config))
    assert not result.passed and "gradient_penalty" in report, report
    monkeypatch.undo()

    def stateful_mix(state, batch, name, shape=(), minval=0.0, maxval=1.0,
                     dtype=tf.float32):
        # The bug: the interpolation drawn by a stateful op (other numbers on
        # each replica and after a resume).
        return tf.random.uniform([tf.shape(batch["index"])[0], *shape], dtype=dtype)

    monkeypatch.setattr(randomness, "per_example_uniform", stateful_mix)
    result, report = _check(_wgan(tiny_config))
    assert not result.passed and result.stateful_ops, report


def test_the_frechet_distance_of_two_gaussians():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 4))
    cov = a @ a.T + np.eye(4)
    assert gan.frechet_distance(np.zeros(4), cov, np.zeros(4), cov) == pytest.approx(
        0.0, abs=1e-9)
    # Equal covariances: the squared distance of the means; scaled ones: by hand.
    assert gan.frechet_distance(np.zeros(4), cov, np.ones(4), cov) == pytest.approx(4.0)
    expected = np.trace(cov) * (1 + 4 - 2 * 2)  # Tr(S + 4S - 2 (4 S^2)^1/2)
    assert gan.frechet_distance(np.zeros(4), cov, np.zeros(4), 4 * cov) == pytest.approx(
        expected)


# --- simclr -----------------------------------------------------------------------

@pytest.mark.long(40)  # seconds, with -n 2
def test_simclr_on_two_replicas_resumes_bitwise_and_evaluates_by_knn(
        tiny_config, monkeypatch):
    """The two views come from the pipeline (stateless: a resume sees the same
    views), the negatives from both replicas."""
    config = _simclr(tiny_config, cpu_replicas=2, deterministic=True)
    straight = loop.train_and_evaluate(config)
    assert straight["replicas"] == 2 and 0 <= straight["test_knn_accuracy"] <= 1
    assert straight["best_metric"] == "test_knn_accuracy"
    resumed = stopped_then_resumed(config.replace(model_dir=config.model_dir + "_2"),
                                   monkeypatch, at_step=4)
    assert resumed["state_sha256"] == straight["state_sha256"]


@pytest.mark.long(30)  # seconds, with -n 2
def test_simclr_passes_the_check_and_negatives_from_one_replica_fail(
        tiny_config, monkeypatch):
    result, report = _check(_simclr(tiny_config))
    assert result.passed, report

    def local_negatives(self, model, batch):
        # The bug: only this replica's views as negatives (no all_gather).
        both = model(tf.concat([batch["view_1"], batch["view_2"]], 0),
                     training=True)["projection"]
        z1, z2 = tf.split(tf.math.l2_normalize(both, -1), 2, axis=0)
        loss, hits = simclr.nt_xent(z1, z2, z1, z2, 0, self.settings.temperature)
        return loss, {"contrastive_accuracy": (tf.reduce_sum(hits),
                                               tf.cast(tf.size(hits), hits.dtype))}

    monkeypatch.setattr(simclr.SimCLR, "contrastive_loss", local_negatives)
    result, report = _check(_simclr(tiny_config))
    assert not result.passed, report


def test_simclr_views_are_two_different_crops_of_each_image():
    from data import augment
    images = tf.cast(tf.random.stateless_uniform([4, 32, 32, 3], (1, 2), 0, 255),
                     tf.uint8)
    one = augment.simclr_view(images, tf.constant([1, 2], tf.int64), blur=True)
    again = augment.simclr_view(images, tf.constant([1, 2], tf.int64), blur=True)
    other = augment.simclr_view(images, tf.constant([1, 3], tf.int64), blur=True)
    assert one.shape == images.shape and one.dtype == tf.uint8
    np.testing.assert_array_equal(one, again)  # a pure function of the key
    assert not np.array_equal(one, other)


# --- the docs' worked examples --------------------------------------------------

@pytest.mark.long(40)  # seconds, with -n 2
def test_mean_teacher_passes_and_an_ema_on_one_replica_fails(tiny_config, monkeypatch):
    module = example_task("mean_teacher")
    config = tiny_config.replace(task="mean_teacher")
    result, report = _check(config)
    assert result.passed, report
    assert "teacher" in result.state_summary and "consistency" in result.metrics
    original = module.MeanTeacher.update_teacher

    def on_replica_zero(self, student, teacher):  # the bug: replica 0's copy only
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        tf.cond(first, lambda: original(self, student, teacher) or tf.constant(0),
                lambda: tf.constant(0))

    monkeypatch.setattr(module.MeanTeacher, "update_teacher", on_replica_zero)
    result, report = _check(config)
    assert not result.passed and result.deciding[0] == "the replicas' copies", report


@pytest.mark.long(25)  # seconds, with -n 2
def test_mean_teacher_resumes_its_teacher_bitwise(tiny_config, monkeypatch):
    example_task("mean_teacher")
    config = tiny_config.replace(task="mean_teacher", deterministic=True)
    straight = loop.train_and_evaluate(config)
    resumed = stopped_then_resumed(config.replace(model_dir=config.model_dir + "_2"),
                                   monkeypatch, at_step=4)
    assert resumed["state_sha256"] == straight["state_sha256"]
    assert resumed["weights_sha256"] == straight["weights_sha256"]  # the teacher's


@pytest.mark.long(40)  # seconds, with -n 2
def test_adversarial_training_passes_and_its_planted_bugs_are_caught(tiny_config,
                                                                   monkeypatch):
    module = example_task("adversarial")
    # One PGD step (the default is 3): the same bugs, a smaller graph to trace.
    config = tiny_config.replace(task="adversarial").with_settings(attack_steps=1)
    result, report = _check(config)
    assert result.passed, report
    assert max(result.batch_norm_passes.values()) == 1.0

    def per_replica_start(self, state, batch, radius):  # the bug: a draw per replica
        images = batch["image"]
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return radius * tf.random.stateless_uniform(
            tf.shape(images), tf.stack([state.seed, replica]), -1.0, 1.0, images.dtype)

    with monkeypatch.context() as patch:
        patch.setattr(module.Adversarial, "random_start", per_replica_start)
        result, report = _check(config)
        assert not result.passed, report
    original_attack = module.Adversarial.attack

    def attack_in_training_mode(self, state, model, batch):  # the bug: training=True
        return original_attack(self, state, lambda x, training: model(x, training=True),
                               batch)

    monkeypatch.setattr(module.Adversarial, "attack", attack_in_training_mode)
    result, report = _check(config)
    assert max(result.batch_norm_passes.values()) == 2.0  # the attack step + training
    assert "updated by 2 training-mode forward passes a step" in report


@pytest.mark.long(40)  # seconds, with -n 2
def test_dp_sgd_passes_and_noise_per_replica_or_from_a_stateful_op_fails(
        tiny_config, monkeypatch):
    module = example_task("dp_sgd")
    config = tiny_config.replace(task="dp_sgd", model="convnet", optimizer="sgd",
                                 learning_rate=0.1)
    result, report = _check(config)
    assert result.passed, report

    def per_replica(self, state, gradients):  # the bug: noise drawn on each replica
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return [tf.random.stateless_normal(g.shape, tf.stack([i, replica]), dtype=g.dtype)
                for i, g in enumerate(gradients)]

    with monkeypatch.context() as patch:
        patch.setattr(module.DPSGD, "noise", per_replica)
        result, report = _check(config)
        assert not result.passed, report

    def stateful(self, state, gradients):  # the bug: the natural tf.random.normal
        return [tf.random.normal(g.shape, dtype=g.dtype) for g in gradients]

    monkeypatch.setattr(module.DPSGD, "noise", stateful)
    result, report = _check(config)
    assert not result.passed and result.stateful_ops, report
    assert "RandomStandardNormal" in report


# --- draws, the state's integrity -------------------------------------------------

def test_per_example_draws_do_not_depend_on_how_the_batch_is_split():
    class State:
        seed, step = 3, tf.Variable(7, dtype=tf.int64)
    keys = tf.range(8)
    whole = randomness.per_example_normal(State, {"index": keys}, "x", (5,))
    halves = [randomness.per_example_normal(State, {"index": k}, "x", (5,))
              for k in (keys[:4], keys[4:])]
    np.testing.assert_array_equal(whole, tf.concat(halves, 0))
    other_name = randomness.per_example_normal(State, {"index": keys}, "y", (5,))
    State.step.assign(8)
    next_step = randomness.per_example_normal(State, {"index": keys}, "x", (5,))
    assert not np.allclose(whole, other_name) and not np.allclose(whole, next_step)
    values = randomness.per_example_normal(State, {"index": tf.range(20_000)}, "x", ())
    assert abs(float(np.mean(values))) < 0.03 and abs(float(np.std(values)) - 1) < 0.03
    uniform = randomness.per_example_uniform(State, {"index": tf.range(20_000)}, "u")
    assert 0 < float(np.min(uniform)) and float(np.max(uniform)) < 1


def test_stateful_random_ops_are_found_in_a_traced_step_and_stateless_ones_are_not():
    stateful = tf.function(lambda x: x + tf.random.normal([3])).get_concrete_function(
        tf.TensorSpec([3]))
    stateless = tf.function(lambda x: x + tf.random.stateless_normal(
        [3], (1, 2))).get_concrete_function(tf.TensorSpec([3]))
    assert [op.split()[0] for op in randomness.stateful_random_ops(stateful.graph)] == [
        "RandomStandardNormal"]
    assert randomness.stateful_random_ops(stateless.graph) == []


def test_a_state_variable_the_checkpoint_lacks_is_one_line(tiny_config, finished_tiny,
                                                           monkeypatch):
    from trainer.tasks import classification
    original = classification.Classification.create_state

    def with_a_queue(self, build):  # a task that now keeps one more variable
        state = original(self, build)
        state.extras["queue"] = build.variable(tf.zeros([4]), "queue")
        return state

    monkeypatch.setattr(classification.Classification, "create_state", with_a_queue)
    with pytest.raises(checkpoints.CheckpointError) as raised:
        loop.train_and_evaluate(tiny_config.replace(train_steps=6))
    message = str(raised.value)
    assert "\n" not in message and "does not fit this run's state" in message
    assert "lacks" in message


@pytest.mark.long(10)  # seconds, with -n 2
def test_an_update_that_overflows_stops_the_run_naming_its_step_before_saving(
        tiny_config, monkeypatch):
    from trainer import faults
    apply_or_skip = step.apply_or_skip

    def overflowing_at_step_2(optimizer, gradients, variables, apply):
        # A finite gradient whose update leaves a weight infinite (what an overflow
        # in the update does): the case the skip cannot see, the wrapper's check must.
        apply_or_skip(optimizer, gradients, variables, apply)
        first = variables[0]
        first.assign(tf.where(optimizer.iterations == 2, first * np.inf, first))

    monkeypatch.setattr(step, "apply_or_skip", overflowing_at_step_2)
    config = tiny_config.replace(on_nan="skip_step")
    with pytest.raises(faults.TrainingDivergedError, match="step 2 left a weight "
                                                           "non-finite"):
        loop.train_and_evaluate(config)
    assert not tf.io.gfile.glob(os.path.join(config.model_dir, "ckpt-*"))
    assert not os.path.exists(os.path.join(config.model_dir, "model.weights.h5"))


def test_a_non_finite_weight_is_never_written():
    import models
    model = models.build("convnet", 3, (32, 32, 3), tiny=True)
    model.weights[0].assign(tf.fill(model.weights[0].shape, np.nan))
    with pytest.raises(checkpoints.NonFiniteError, match="1 variable"):
        checkpoints.save_weights(model, "ram://nonfinite/model.weights.h5")
    assert not tf.io.gfile.exists("ram://nonfinite/model.weights.h5")


def test_a_step_setting_a_tasks_own_step_does_not_carry_out_is_refused(tiny_config):
    """--sam_rho on a GAN, micro-batches on SimCLR (each micro-batch's negatives
    alone): one line, not a setting silently ignored. SimCLR runs the default step
    on its loss, so it keeps the rest (clipping, SAM, Lookahead)."""
    from data import sources
    from trainer import build
    from trainer.settings import ConfigError
    spec = sources.get_spec("synthetic")
    options = step.StepOptions(batch_size=16, sam_rho=0.05)
    with pytest.raises(ConfigError, match=r"--task=gan .* --sam_rho \(set to 0.05\); "
                                          r"give --sam_rho=0.0 .*: none\)"):
        build.check_step_settings(build.make_task(_gan(tiny_config), spec), options)
    simclr_task = build.make_task(_simclr(tiny_config), spec)
    build.check_step_settings(simclr_task, options)  # SAM: carried out
    with pytest.raises(ConfigError, match="--grad_accum_steps"):
        build.check_step_settings(simclr_task, step.StepOptions(batch_size=16,
                                                                grad_accum_steps=2))
    assert set(step.SETTINGS) <= {f.name for f in dataclasses.fields(step.StepOptions)}


def test_step_pieces_are_public():
    """What a task's own step composes (docs/changing-the-step.md)."""
    for name in ("Objective", "summed_gradients", "replica_gradients", "all_reduce_sum",
                 "gradient_at_offset", "sam_gradient", "apply_or_skip", "per_step",
                 "global_mean", "moving_statistics", "train_step", "eval_step"):
        assert callable(getattr(step, name)), name


@pytest.mark.long(20)  # seconds, with -n 2
@pytest.mark.parametrize("task", ["gan", "simclr"])
def test_a_tasks_own_step_compiles_with_xla_and_matches_the_plain_step(task, tiny_config):
    """A TPU compiles everything: gan's and simclr's steps under jit_compile=True
    give the plain step's state (test_tasks.py does it for the other tasks)."""
    config = (_gan(tiny_config) if task == "gan"
              # SGD: Adam's first steps are +-lr wherever a gradient is near 0, so
              # XLA's other rounding there would flip whole steps
              else _simclr(tiny_config).replace(model="convnet", optimizer="sgd"))
    images = tf.random.stateless_normal((16, 32, 32, 3), (1, 2))
    batch = {"index": tf.range(16)}
    if task == "gan":
        batch["image"] = images
    else:
        batch.update(view_1=images, view_2=tf.image.flip_left_right(images),
                     label=tf.zeros(16, tf.int32))
    states = plain_and_compiled_states(config, batch)
    assert len(states[0]) == len(states[1]) > 4  # (Keras numbers the layers anew)
    for (name, plain), (_, compiled) in zip(*states):
        np.testing.assert_allclose(plain, compiled, rtol=1e-4, atol=1e-5, err_msg=name)


# --- fixmatch: two input streams -----------------------------------------------------

def _fixmatch(tiny_config, **changes):
    return tiny_config.replace(task="fixmatch", model="cifar_cnn", optimizer="sgd",
                               learning_rate=0.03, **changes).with_settings(
        labelled_examples=40, unlabelled_factor=3, threshold=0.0)  # (every guess counts)


def test_a_balanced_subset_stream_holds_the_first_of_each_class_and_resumes_at_a_step(
        tiny_config):
    from trainer import build, inputs
    config = _fixmatch(tiny_config, batch_size=8)
    data = build.run_data(config)
    streams = build.task_input(build.make_task(config, data.spec))
    assert set(streams) == {"labelled", "unlabelled"}
    whole = tf.distribute.InputContext()
    train_examples = data.counts()[0]
    make = inputs.train_input_fn(data, train_examples, task_input=streams)
    batches = list(make(whole).take(12))
    first = batches[0]
    assert first["labelled"]["image"].shape[0] == config.batch_size
    assert first["unlabelled"]["weak"].shape[0] == 3 * config.batch_size
    assert first["unlabelled"]["strong"].shape == first["unlabelled"]["weak"].shape
    # 40 labelled examples, 4 of each of the 10 classes, every one seen in an epoch
    # of the labelled stream (5 steps of 8), none other.
    seen = np.concatenate([b["labelled"]["index"].numpy() for b in batches[:5]])
    labels = np.concatenate([b["labelled"]["label"].numpy() for b in batches[:5]])
    assert sorted(seen) == list(range(40))
    assert np.bincount(labels, minlength=10).tolist() == [4] * 10
    # The streams resume at a step: from step 7 the same batches as straight through.
    resumed = list(inputs.train_input_fn(data, train_examples, start_step=7,
                                         task_input=streams)(whole).take(5))
    for a, b in zip(batches[7:], resumed):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)


@pytest.mark.long(45)  # seconds, with -n 2
def test_fixmatch_on_two_replicas_resumes_bitwise_and_serves_its_classifier(
        tiny_config, tmp_path, monkeypatch):
    from trainer.serving import predict
    config = _fixmatch(tiny_config, cpu_replicas=2, deterministic=True)
    metrics = loop.train_and_evaluate(config)
    assert metrics["steps"] == 4 and 0 <= metrics["test_accuracy"] <= 1
    resumed = stopped_then_resumed(config.replace(model_dir=config.model_dir + "_2"),
                                   monkeypatch, at_step=4)
    assert resumed["resumed_from_step"] == 2
    assert resumed["state_sha256"] == metrics["state_sha256"]
    assert resumed["weights_sha256"] == metrics["weights_sha256"]
    image = tmp_path / "x.png"
    tf.io.write_file(str(image), tf.io.encode_png(tf.zeros([32, 32, 3], tf.uint8)))
    lines = predict.run(predict.parse([f"--model_dir={config.model_dir}", str(image)]))
    assert any("%" in line for line in lines)


@pytest.mark.long(40)  # seconds, with -n 2
def test_fixmatch_passes_the_check_and_its_planted_bugs_fail(tiny_config, monkeypatch):
    from trainer.tasks import classification
    result, report = _check(_fixmatch(tiny_config))
    assert result.passed, report
    assert result.metrics["confident"][0] == 1.0  # (threshold 0: the unlabelled loss runs)
    original = classification.objective

    def per_replica_mean(targets, logits, smoothing=0.0):
        # The bug: each loss averaged over this replica's examples (then divided
        # again by the global batch): 2 replicas train with half... x replicas.
        losses = original(targets, logits, smoothing)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        return tf.fill(tf.shape(losses), tf.reduce_mean(losses)) * tf.cast(
            replicas, losses.dtype)

    monkeypatch.setattr(classification, "objective", per_replica_mean)
    result, report = _check(_fixmatch(tiny_config))
    assert not result.passed, report
    monkeypatch.undo()

    def threshold_on_the_replicas_mean(task_self, state, batch, options):
        # The bug: the confidence of the replica's mean prediction decides for all
        # its images (it depends on how the batch is split).
        settings = dataclasses.replace(task_self.settings, threshold=0.3)
        object.__setattr__(task_self, "settings", settings)
        unlabelled = batch["unlabelled"]
        mean = tf.reduce_mean(unlabelled["weak"], axis=0, keepdims=True)
        batch = {**batch, "unlabelled": {**unlabelled, "weak": tf.zeros_like(
            unlabelled["weak"]) + mean}}
        return fixmatch_step(task_self, state, batch, options)

    from trainer.tasks import fixmatch
    fixmatch_step = fixmatch.FixMatch.train_step
    monkeypatch.setattr(fixmatch.FixMatch, "train_step", threshold_on_the_replicas_mean)
    result, report = _check(_fixmatch(tiny_config))
    assert not result.passed, report


def test_a_stream_of_another_dataset_comes_at_the_runs_size_and_normalization(
        tiny_config):
    """A synthetic run with a second stream of tf_flowers' first 16 images (any
    size): resized to the run's 32x32, normalized with the run's statistics."""
    from trainer import build, inputs
    config = tiny_config.replace(batch_size=8)
    data = build.run_data(config)
    streams = {"run": inputs.Stream(),
               "flowers": inputs.Stream(examples="first:16", dataset="tf_flowers")}
    batch = next(iter(inputs.train_input_fn(data, data.counts()[0], task_input=streams)(
        tf.distribute.InputContext())))
    assert batch["run"]["image"].shape == batch["flowers"]["image"].shape == (8, 32, 32, 3)
    pixels = batch["flowers"]["image"].numpy() * np.array(data.spec.std) + np.array(
        data.spec.mean)
    assert pixels.min() >= -1e-3 and pixels.max() <= 1.001 and pixels.std() > 0.05  # [0, 1]
    assert set(batch["flowers"]["label"].numpy()) <= set(range(5))  # (its own classes)


def test_a_subset_stream_smaller_than_its_batch_is_one_line(tiny_config):
    from trainer import build, inputs
    from trainer.settings import ConfigError
    data = build.run_data(tiny_config.replace(batch_size=16))
    streams = {"few": inputs.Stream(examples="balanced:10")}
    with pytest.raises(ConfigError, match="stream 'few': examples='balanced:10' gives "
                                          "10 examples .* fewer than its batch of 16"):
        inputs.train_input_fn(data, data.counts()[0], task_input=streams)(
            tf.distribute.InputContext())


def test_a_wgan_gp_critic_with_batch_norm_is_refused(tiny_config):
    from trainer import build
    from trainer.settings import ConfigError
    config = _wgan(tiny_config).with_settings(discriminator="cifar_cnn")
    spec = build.run_data(config).spec
    with pytest.raises(ConfigError, match="batch-norm"):
        build.build_run(config, spec, build.plan(config, spec, 1),
                        tf.distribute.get_strategy())
