"""trainer.check_step: 1 vs 2 replicas on the configured step, PASS on ours, FAIL on
the classic distributed-step bugs."""
import os
import subprocess
import sys

import keras
import tensorflow as tf

from conftest import CPUS
from trainer import check_step, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(config, train_step=step.train_step):
    return check_step.run_check(config.replace(batch_size=16), num_steps=2,
                                train_step=train_step, devices=CPUS[:2])


def test_our_step_passes_with_batch_norm_and_dropout_in_the_model(tiny_config):
    result = _check(tiny_config)  # the tiny cifar_cnn has both
    assert result.passed, check_step.report(result, tiny_config, 2)
    assert result.weight_difference < 1e-3
    assert set(result.metrics) >= {"loss", "accuracy", "grad_norm"}


def test_a_loss_averaged_per_replica_fails_on_the_gradient_norm(tiny_config, monkeypatch):
    # The classic bug: mean over this replica's examples, then the replicas' gradients
    # are summed, so 2 replicas train with twice the gradient.
    monkeypatch.setattr(step, "_mean_over_global_batch",
                        lambda per_example_loss, options: tf.reduce_mean(per_example_loss))
    result = _check(tiny_config)
    assert not result.passed
    one, two, _ = result.metrics["grad_norm"]
    assert two / one > 1.9


def test_a_metric_with_the_wrong_weight_fails(tiny_config):
    def step_with_a_wrong_metric(model, optimizer, batch, options):
        metrics = step.train_step(model, optimizer, batch, options)
        total, _ = metrics["loss"]
        # The loss as the step optimizes it (this replica's sum / the GLOBAL batch),
        # reported with weight 1 per replica: 2 replicas show half the loss.
        return {**metrics, "scaled_loss": (total / options.batch_size, tf.constant(1.0))}
    result = _check(tiny_config, step_with_a_wrong_metric)
    assert not result.passed and result.metrics["scaled_loss"][2] > 0.4


def test_checkable_model_synchronizes_batch_norm_and_drops_dropout():
    import models
    model = check_step.checkable(models.build("cifar_cnn", 10, (32, 32, 3), tiny=True))
    norms = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    drops = [l for l in model.layers if isinstance(l, keras.layers.Dropout)]
    assert norms and all(layer.synchronized for layer in norms)
    assert drops and all(layer.rate == 0.0 for layer in drops)


def test_command_prints_pass_and_exits_0():
    result = subprocess.run(
        [sys.executable, "-m", "trainer.check_step", "--model=cifar_cnn",
         "--model_size=tiny", "--dataset=synthetic", "--batch_size=16", "--check_steps=2",
         "--clip_grad_norm=0.5", "--grad_accum_steps=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "PASS" in result.stdout and "grad_norm" in result.stdout
