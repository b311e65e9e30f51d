"""Faults: a non-finite loss, preemption (SIGTERM), kill -9 and exact resume."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, mirrored
from test_main import ROOT, TINY, _main
from test_step import _batch
from trainer import distributed, faults, optimizers


def _linear_model() -> keras.Model:
    """No ReLU: a NaN in the input reaches the loss (fused conv+ReLU kernels can
    turn a NaN into 0)."""
    init = keras.initializers.GlorotUniform(seed=3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(5, kernel_initializer=init)(x))


def _train(strategy, batches, on_nan):
    with strategy.scope():
        model = _linear_model()
        optimizer = optimizers.create("adam", 0.01, model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices(
        tuple(tf.stack(part) for part in zip(*batches))).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    loop = distributed.make_train_loop(strategy, model, optimizer, 8, False, on_nan)
    sums = {k: float(v) for k, v in loop(iterator, tf.constant(len(batches))).items()}
    return model, optimizer, sums


@pytest.mark.parametrize("replicas", [1, 2])
def test_skip_step_drops_exactly_the_bad_update_on_every_replica(replicas):
    strategy = mirrored() if replicas == 2 else tf.distribute.OneDeviceStrategy(CPUS[0])
    good_1, good_2 = _batch(), (_batch()[0] * 0.5, _batch()[1])
    images = _batch()[0].numpy()
    images[-1, 0, 0, 0] = np.nan  # one example, on the last replica's slice only
    bad = (tf.constant(images), _batch()[1])
    skipped_model, opt, sums = _train(strategy, [good_1, bad, good_2], "skip_step")
    clean_model, clean_opt, clean = _train(strategy, [good_1, good_2], "skip_step")
    assert sums["skipped"] == 1 and clean["skipped"] == 0
    assert sums["count"] == 16 and np.isfinite(sums["loss_sum"])
    assert int(opt.iterations.numpy()) == int(clean_opt.iterations.numpy()) == 2
    for a, b in zip(skipped_model.get_weights(), clean_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_stop_returns_at_the_first_non_finite_step():
    images = _batch()[0].numpy()
    images[0, 0, 0, 0] = np.nan
    batches = [_batch(), _batch(), (tf.constant(images), _batch()[1]), _batch()]
    _, _, sums = _train(tf.distribute.OneDeviceStrategy(CPUS[0]), batches, "stop")
    assert sums["steps"] == 3 and not np.isfinite(sums["loss_sum"])


def test_diverging_run_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path):
    model_dir = str(tmp_path / "run")
    ok = _main(*TINY, f"--model_dir={model_dir}", "--checkpoint_every=2")
    assert ok.returncode == 0, ok.stderr[-2000:]
    files = {f: os.path.getmtime(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
             if f.startswith("ckpt-4")}
    diverged = _main(*TINY, f"--model_dir={model_dir}", "--train_steps=40",
                     "--learning_rate=1e12", "--optimizer=sgd", "--momentum=0")
    assert diverged.returncode == 3, diverged.stderr[-2000:]
    errors = [line for line in diverged.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: non-finite loss at step ")
    assert "is kept" in errors[0]
    for name, mtime in files.items():  # the last good checkpoint is untouched
        assert os.path.getmtime(os.path.join(model_dir, name)) == mtime


def _sha(model_dir: str) -> str:
    """The checksum of the final weights that the run wrote into metrics.json."""
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["weights_sha256"]


RESUME = [*TINY, "--batch_size=128", "--train_steps=120", "--checkpoint_every=10",
          "--steps_per_loop=1", "--eval_every=120", "--deterministic",
          "--shuffle_buffer=4096"]


def _start(model_dir, *extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, "-m", "trainer.main", *RESUME, *extra,
                             f"--model_dir={model_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(model_dir, proc, at_least: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        ckpt = tf.train.latest_checkpoint(model_dir)
        if ckpt and int(ckpt.rsplit("-", 1)[1]) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint >= {at_least}: {proc.communicate()[0][-2000:]}")


@pytest.mark.parametrize("replicas", [1, 2])
def test_kill_9_at_a_random_step_then_resume_is_bitwise_identical(tmp_path, replicas):
    extra = [f"--cpu_replicas={replicas}"]
    reference = _main(*RESUME, *extra, f"--model_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed_dir = str(tmp_path / "killed")
    proc = _start(killed_dir, *extra)
    _wait_for_checkpoint(killed_dir, proc, random.Random().choice([10, 20, 30, 40, 50]))
    time.sleep(random.random() * 0.2)  # mid-step, between checkpoints
    assert proc.poll() is None, "the run ended before the kill; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = _main(*RESUME, *extra, f"--model_dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open(os.path.join(killed_dir, "metrics.json")) as f:
        assert 0 < json.load(f)["resumed_from_step"] < 120
    assert _sha(killed_dir) == _sha(str(tmp_path / "ref"))


def test_sigterm_saves_the_current_step_and_exits_75_then_resumes(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = _start(model_dir, "--train_steps=100000", "--checkpoint_every=100000")
    deadline = time.time() + 240
    while "step 2/" not in (line := proc.stdout.readline()) and time.time() < deadline:
        assert line or proc.poll() is None, "the run ended before training"
    proc.send_signal(signal.SIGTERM)
    started = time.time()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == faults.PREEMPTED_EXIT_CODE, output[-2000:]
    assert time.time() - started < 10
    assert "preempted (SIGTERM): saved a checkpoint at step" in output
    step = int(tf.train.latest_checkpoint(model_dir).rsplit("-", 1)[1])
    assert step >= 2
    resumed = _main(*RESUME, f"--model_dir={model_dir}", f"--train_steps={step + 2}")
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr
