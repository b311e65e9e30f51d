"""trainer.check_step: 1 vs 2 replicas on the run as training builds it, at the
default tolerance: PASS on correct steps and tasks, FAIL on the planted bugs (the
loss divided per replica, a metric with the wrong weight, SAM with this replica's
gradient norm, a teacher run in training mode)."""
import json
import os

import pytest
import tensorflow as tf

from conftest import CPUS
import models
from trainer import check_step, step, tasks
from trainer.tasks import distill


def _check(config):
    """check_step at its defaults (3 steps, the default tolerance)."""
    result = check_step.run_check(config.replace(batch_size=16), devices=CPUS[:2])
    return result, check_step.report(result)


@pytest.mark.long(12)  # seconds, with -n 2
def test_our_step_passes_with_batch_norm_and_dropout_in_the_model(tiny_config):
    result, report = _check(tiny_config)  # the tiny cifar_cnn has both
    assert result.passed, report
    assert result.weight_difference < 1e-10  # float64 rounding
    assert set(result.metrics) >= {"loss", "accuracy", "grad_norm"}
    assert "PASS: decided by " in report


@pytest.mark.long(10)  # seconds, with -n 2
def test_a_loss_averaged_per_replica_fails_on_the_gradient_norm(tiny_config, monkeypatch):
    # The classic bug: mean over this replica's examples, then the replicas' gradients
    # are summed, so 2 replicas train with twice the gradient.
    monkeypatch.setattr(step, "global_mean",
                        lambda per_example_loss, options: tf.reduce_mean(per_example_loss))
    result, report = _check(tiny_config)
    assert not result.passed
    one, two, _ = result.metrics["grad_norm"]
    assert two / one > 1.9
    assert "FAIL: decided by " in report


@pytest.mark.long(10)  # seconds, with -n 2
def test_a_metric_with_the_wrong_weight_fails(tiny_config, monkeypatch):
    original = step.train_step

    def step_with_a_wrong_metric(state, task, batch, options):
        metrics = original(state, task, batch, options)
        total, _ = metrics["loss"]
        # The loss as the step optimizes it (this replica's sum / the GLOBAL batch),
        # reported with weight 1 per replica: 2 replicas show half the loss.
        return {**metrics, "scaled_loss": (total / options.batch_size, 1.0)}

    monkeypatch.setattr(step, "train_step", step_with_a_wrong_metric)
    result, report = _check(tiny_config)
    assert not result.passed and result.deciding[0] == "scaled_loss", report


@pytest.mark.long(38)  # seconds, with -n 2
def test_sam_passes_and_sam_with_this_replicas_norm_fails(tiny_config, monkeypatch):
    config = tiny_config.replace(sam_rho=0.05)
    result, report = _check(config)
    assert result.passed, report

    def sam_from_the_local_gradient(objective, batch, options, gradients, grad_norm,
                                    finite):
        # The bug: perturb along this replica's own gradient and norm (before the sum).
        local, _ = step.replica_gradients(objective, batch, options)
        scale = options.sam_rho / (tf.linalg.global_norm(local) + 1e-12)
        gradients = step.gradient_at_offset(objective, batch, options,
                                            [scale * g for g in local], finite)
        return gradients, tf.linalg.global_norm(gradients), finite

    monkeypatch.setattr(step, "sam_gradient", sam_from_the_local_gradient)
    result, report = _check(config)
    assert not result.passed, report
    assert result.weight_difference > 1e-3


def _teacher_run(directory, seed: int = 4) -> str:
    """A finished run's directory as the teacher needs it: run_config.json and
    model.weights.h5 of a tiny cifar_cnn on the synthetic data."""
    os.makedirs(directory, exist_ok=True)
    tf.keras.utils.set_random_seed(seed)
    models.build("cifar_cnn", 10, (32, 32, 3), tiny=True).save_weights(
        os.path.join(directory, "model.weights.h5"))
    with open(os.path.join(directory, "run_config.json"), "w") as f:
        json.dump({"model": "cifar_cnn", "model_size": "tiny", "dataset": "synthetic"}, f)
    return str(directory)


@pytest.mark.long(25)  # seconds, with -n 2
def test_distillation_passes_and_a_teacher_in_training_mode_fails(tiny_config, tmp_path,
                                                                   monkeypatch):
    config = tiny_config.replace(task="distill").with_settings(
        teacher_dir=_teacher_run(tmp_path / "teacher"), distill_alpha=0.3)
    result, report = _check(config)
    assert result.passed, report
    assert {"distill_kl", "teacher_agreement"} <= set(result.metrics)  # the teacher ran
    original_create = distill.Distill.create_state

    def build_a_teacher_in_training_mode(self, build):
        state = original_create(self, build)
        teacher = self.teacher
        # The bug: the teacher's dropout on (its batch-norm, frozen with the
        # teacher, uses the moving statistics in either mode).
        self.teacher = lambda images, training: teacher(images, training=True)
        return state

    monkeypatch.setattr(distill.Distill, "create_state", build_a_teacher_in_training_mode)
    result, report = _check(config)
    assert not result.passed, report


def test_a_model_built_with_operators_is_checkable():
    """`x + y` in a functional model makes a Keras operation, not a layer: the
    float64 copy must clone it too (the docs' mixer does this)."""
    import keras
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(x + inputs * 2.0))
    copy = check_step.checkable(model)
    copy.set_weights(model.get_weights())
    assert copy(tf.ones((2, 4), tf.float64)).dtype == tf.float64


@pytest.mark.long(17)  # seconds, with -n 2
def test_command_prints_pass_and_exits_0(command):
    status, stdout, log = command(
        "trainer.check_step", "--model=cifar_cnn", "--model_size=tiny",
        "--dataset=synthetic", "--batch_size=16", "--check_steps=2",
        "--clip_grad_norm=0.5", "--grad_accum_steps=2")
    assert status == 0, stdout + log[-2000:]
    assert "PASS: decided by" in stdout and "grad_norm" in stdout


# --- what check_step sees beyond 1 vs 2 replicas (issue 45) ------------------------

def _phased(tiny_config):
    from conftest import example_task
    example_task("phased_finetune")
    return tiny_config.replace(task="phased_finetune", batch_size=16).with_settings(
        head_epochs=0.01)  # (a 6-step head phase on the synthetic data)


@pytest.mark.long(40)  # seconds, with -n 2
def test_each_phase_is_checked_and_a_leak_into_the_frozen_backbone_fails(
        tiny_config, monkeypatch):
    config = _phased(tiny_config)
    from trainer import build
    spec = build.run_data(config).spec
    schedule = build.make_task(config, spec).train_steps(build.plan(config, spec, 2))
    starts = schedule.starts()
    assert not schedule.repeat and starts[0] == 0 and len(starts) == 2 and starts[1] >= 1
    for start in starts:
        result = check_step.run_check(config, devices=CPUS[:2], start_step=start)
        assert result.passed, check_step.report(result)
        assert not result.frozen_moved
    # In the head phase only the head moved: of the model's variables, its 2.
    head_phase = check_step.run_check(config, devices=CPUS[:2])
    assert head_phase.moved["main"][0] == 2, head_phase.moved

    def leaking_head_step(self, state, batch, options):
        # The bug: the backbone run in training mode in the head phase: its
        # batch-norm statistics move, though the phase declares it frozen.
        self.features(batch["image"], training=True)
        return original(self, state, batch, options)

    task = tasks.get("phased_finetune")
    original = task.head_step
    monkeypatch.setattr(task, "head_step", leaking_head_step)
    result = check_step.run_check(config, devices=CPUS[:2])
    report = check_step.report(result)
    assert not result.passed and result.frozen_moved, report
    assert "declared frozen in head steps, but changed (steps 1, 2, 3): main/" in report
    assert "moving_mean" in report or "moving_variance" in report


def test_an_exception_in_the_step_is_one_fail_line_naming_the_tasks_line(
        tiny_config, monkeypatch):
    config = _phased(tiny_config)
    task = tasks.get("phased_finetune")

    def head_step_with_the_wrong_optimizer(self, state, batch, options):
        objective = step.supervised(state, self)  # every weight, the head's optimizer
        return step.train_step(state, self, batch, options, objective)

    monkeypatch.setattr(task, "head_step", head_step_with_the_wrong_optimizer)
    result = check_step.run_check(config, devices=CPUS[:2])
    report = check_step.report(result)
    assert not result.passed and result.step_error, report
    assert "test_check_step.py:" in result.step_error, result.step_error
    assert "Traceback" not in report and len(report.splitlines()) == 3
    assert report.splitlines()[-1].startswith("FAIL: decided by the step raising")


@pytest.mark.long(30)  # seconds, with -n 2
def test_a_bfloat16_all_gather_fails_in_the_runs_precision_on_two_replicas(
        tiny_config, monkeypatch):
    from trainer.tasks import simclr
    config = tiny_config.replace(task="simclr", model="cifar_cnn", optimizer="adam",
                                 batch_size=16, precision="auto").with_settings(knn_k=20)

    def gathered_in_the_models_dtype(self, model, batch):
        # The bug: the projections gathered as the model outputs them (bfloat16
        # under mixed_bfloat16): float64 in check_step, float32 on 1 replica.
        both = model(tf.concat([batch["view_1"], batch["view_2"]], axis=0),
                     training=True)["projection"]
        gathered = tf.distribute.get_replica_context().all_gather(both, axis=0)
        loss = tf.reduce_mean(tf.square(tf.cast(gathered, tf.float32)))
        per_image = tf.fill(tf.shape(batch["view_1"])[:1], loss)
        return tf.cast(per_image, both.dtype), {}

    assert check_step.run_check(config, devices=CPUS[:2]).precision == "mixed_bfloat16"
    monkeypatch.setattr(simclr.SimCLR, "contrastive_loss", gathered_in_the_models_dtype)
    result = check_step.run_check(config, devices=CPUS[:2])
    report = check_step.report(result)
    assert not result.passed and result.precision_error, report
    line = [line for line in report.splitlines() if "mixed_bfloat16" in line][-1]
    assert "bfloat16" in result.precision_error and "Traceback" not in report, line
    assert "in all_gather" in result.precision_error, line
    assert report.splitlines()[-2].startswith("FAIL: decided by the step in mixed_bfloat16")


def test_a_counter_outside_the_state_is_named_on_the_repeat(tiny_config, monkeypatch):
    from trainer.tasks import classification
    create_state, loss = (classification.Classification.create_state,
                          classification.Classification.loss)

    def with_a_counter(self, build):  # the bug: a variable the state does not hold
        self.calls = tf.Variable(0.0, trainable=False, name="my_calls",
                                 aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        return create_state(self, build)

    def counted_loss(self, batch, outputs):
        self.calls.assign_add(1.0)
        per_example, metrics = loss(self, batch, outputs)
        return per_example * (1.0 + tf.cast(self.calls, per_example.dtype)), metrics

    monkeypatch.setattr(classification.Classification, "create_state", with_a_counter)
    monkeypatch.setattr(classification.Classification, "loss", counted_loss)
    result, report = _check(tiny_config)
    assert not result.passed and result.outside_state == ("my_calls:0",), report
    assert "outside the run's state (my_calls:0)" in report
    assert "inf" not in report and "step count" not in report
