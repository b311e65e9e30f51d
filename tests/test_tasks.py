"""The task seam: each built-in task trains through the loop on 2 replicas,
check_step passes it, its step compiles with XLA and gives the plain step's
result, and predict and export run on its own output; classification through the
seam is bitwise what it was before tasks; bad task/model/dataset combinations are
one line, exit 2, and leave model_dir empty."""
import json
import os
import platform

import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, plain_and_compiled_states
from test_check_step import _teacher_run
from test_main import TINY
from trainer import build, check_step, loop
from trainer.serving import export, predict, tflite


@pytest.fixture(scope="session")  # (a module fixture is rebuilt each time xdist returns)
def teacher_dir(tmp_path_factory) -> str:
    return _teacher_run(tmp_path_factory.mktemp("teacher"))


def _config(tiny_config, task: str, teacher_dir: str):
    if task == "distill":
        return tiny_config.replace(task="distill").with_settings(teacher_dir=teacher_dir)
    if task == "autoencoder":
        return tiny_config.replace(task="autoencoder", model="conv_autoencoder",
                                   optimizer="adam", learning_rate=2e-3)
    return tiny_config.replace(sam_rho=0.05)  # classification, with SAM


@pytest.mark.parametrize("task", ["distill", "autoencoder"])
@pytest.mark.long(29)  # seconds, with -n 2
def test_a_task_trains_on_two_replicas_passes_the_check_and_serves(
        task, tiny_config, teacher_dir, tmp_path):
    config = _config(tiny_config, task, teacher_dir).replace(cpu_replicas=2)
    metrics = loop.train_and_evaluate(config)
    assert metrics["replicas"] == 2 and metrics["task"] == task
    assert np.isfinite(metrics["train_loss"]) and metrics["test_examples"] == 2000
    written = json.load(open(os.path.join(config.model_dir, "metrics.json")))
    best = written["best_metric"]
    assert best == ("test_loss" if task == "autoencoder" else "test_accuracy")
    assert written[f"best_{best}"] == (min if task == "autoencoder" else max)(
        r[best] for r in written["eval_history"])
    if task == "autoencoder":  # (distill's: tests/test_check_step.py)
        result = check_step.run_check(config.replace(cpu_replicas=1), devices=CPUS[:2])
        assert result.passed, check_step.report(result)

    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    path = str(tmp_path / "input.png")
    tf.io.write_file(path, tf.io.encode_png(image))
    lines = predict.run(predict.parse([f"--model_dir={config.model_dir}", path,
                                       f"--output_dir={tmp_path / 'out'}"]))
    exported = tf.saved_model.load(export.export(config.model_dir, str(tmp_path / "sm"),
                                                 tflite=task == "autoencoder"))
    served = exported.signatures["predict_images"](images=tf.constant(image[None]))
    if task == "autoencoder":  # a reconstruction, as an image file and as pixels
        assert "reconstruction:" in lines[-1] and "dB" in lines[-1]
        written = tf.io.decode_png(tf.io.read_file(str(tmp_path / "out" / "input.png")))
        assert written.shape == (32, 32, 3)
        np.testing.assert_allclose(served["reconstruction"].numpy()[0], written.numpy(),
                                   atol=1)
        # and as model.tflite's uint8 output (--tflite), to one level of rounding
        data = (tmp_path / "sm" / "model.tflite").read_bytes()
        from_tflite = tflite.run(data, image[None])
        assert list(from_tflite) == ["reconstruction"]
        assert from_tflite["reconstruction"].dtype == np.uint8
        np.testing.assert_allclose(from_tflite["reconstruction"],
                                   served["reconstruction"].numpy(), atol=1)
        assert not (tmp_path / "sm" / "labels.txt").exists()  # (no classes)
    else:  # the student's classes
        assert lines[2].startswith("  1. class_")
        assert served["probabilities"].shape == (1, 10)


@pytest.mark.long(23)  # seconds, with -n 2
@pytest.mark.parametrize("task", ["classification", "distill", "autoencoder"])
def test_a_tasks_step_compiles_with_xla_and_matches_the_plain_step(
        task, tiny_config, teacher_dir):
    """A TPU compiles everything: each task's step (classification's with SAM)
    under jit_compile=True gives the plain step's weights. (Models without
    dropout: XLA draws other random numbers.)"""
    config = _config(tiny_config.replace(model="convnet"), task, teacher_dir)
    batch = {"image": tf.random.stateless_normal((16, 32, 32, 3), (1, 2)),
             "label": tf.random.stateless_uniform((16,), (3, 4), maxval=10,
                                                  dtype=tf.int32)}
    plain, compiled = plain_and_compiled_states(config, batch)
    assert sum(name.startswith("main/") for name, _ in plain) > 4
    for (name, a), (_, b) in zip(plain, compiled):
        if name.startswith("main/"):  # the trained model's weights, as before
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


# Recorded with the code before tasks existed (commit 7370e34) on each CPU the
# project has run on: the weights' SHA-256 after 6 steps of the test's own settings
# (loop.train_and_evaluate in a checkout of 7370e34, run as a process; without
# model_options and eval_batch_size, which it lacks). Bitwise equality only means
# something on the same CPU (its name and the instruction set oneDNN picks its
# kernels by) and TensorFlow, so on another the test is skipped, naming the CPUs it
# knows.
BEFORE_TASKS = {
    "aux_head_clip_accumulate": dict(
        model="resnet_aux", aux_loss_weight=0.4, clip_grad_norm=0.5,
        grad_accum_steps=2, optimizer="sgd", learning_rate=0.05),
    "airbench_every_piece": dict(
        # (fused=false: the Keras batch-norm and GELU the reference was recorded with)
        model="airbench_small", model_options="fused=false", optimizer="sgd",
        learning_rate=0.2, momentum=0.85,
        lr_multipliers="*/beta=4", lookahead_every=2, tta_flip=True,
        tta_translate=True, label_smoothing=0.2, augment="translate",
        alternating_flip=True, cutmix_alpha=1.0, weight_decay=0.01,
        ema_decay=0.9),
}
REFERENCE_HASHES = {
    ("AMD EPYC", "avx512_bf16", "2.21.0"): {
        "aux_head_clip_accumulate":
            "5c940b3e23667af9d03d6b4939a06c59fee4780d40c95ca9fdf5a241a2d2f9e1",
        "airbench_every_piece":
            "2f0e561929e74e8a8d6116bd982d46e0a76e7408eb458786de01150cc1ad6fba",
    },
    ("AMD EPYC", "avx2", "2.21.0"): {  # (Zen 3: recorded 2026-12-03, stop 29)
        "aux_head_clip_accumulate":
            "67aa564a093857d2fdfb851c23e6e89517f6dca289f777cbce0f7eb86815d54a",
        "airbench_every_piece":
            "a3afa89043378a361ed8848dd06762626d0f56ac9974fef5e2613aa8415ba2a9",
    },
    ("Intel(R) Xeon(R) Processor", "amx", "2.21.0"): {
        "aux_head_clip_accumulate":
            "488b2709d87a3cd9790321db73b65ce0783dc569f776340049e70a4efeacb9d3",
        "airbench_every_piece":
            "1b91c272fa26e3a8906d7351227fd3d141a53cca9ba8ec7b21438885b7ed099b",
    },
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _isa() -> str:
    """The widest matrix instructions the CPU has (what oneDNN's kernels depend on:
    two 'AMD EPYC' machines of this project's differ there)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    for isa, flag in (("amx", "amx_tile"), ("avx512_bf16", "avx512_bf16"),
                      ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return "other"


@pytest.mark.long(26)  # seconds, with -n 2
@pytest.mark.parametrize("case", sorted(BEFORE_TASKS))
def test_classification_through_the_task_seam_is_bitwise_as_before(case, tmp_path,
                                                                   grappler):
    machine = (_cpu_model(), _isa(), tf.__version__)
    if machine not in REFERENCE_HASHES:
        pytest.skip(f"no reference recorded on {machine}; recorded on "
                    f"{sorted(REFERENCE_HASHES)}")
    from trainer import config as config_lib, run_settings
    values, expected = BEFORE_TASKS[case], REFERENCE_HASHES[machine][case]
    config = run_settings.from_dict(dict(
        model_size="tiny", dataset="synthetic", batch_size=16, eval_batch_size=256,
        train_steps=6, steps_per_loop=2, log_every=2, eval_every=6, checkpoint_every=6,
        precision="float32", shuffle_buffer=64, deterministic=True,
        model_dir=str(tmp_path / "run"), **values))
    assert loop.train_and_evaluate(config)["weights_sha256"] == expected


@pytest.mark.parametrize("flags,message", [
    (["--task=autoencoder", "--model=cifar_cnn"], "task autoencoder needs a model that "
     "outputs an image of the input's shape; cifar_cnn outputs logits"),
    (["--teacher_dir=x"], "--teacher_dir is a setting of task(s) distill, not of "
     "classification"),
])
def test_a_task_that_does_not_fit_is_one_line_and_writes_nothing(tmp_path, run, flags,
                                                                 message):
    """One command-line case per place a combination is refused (the flags, the
    build), through trainer.main's parser and main; the others are the in-process
    test below."""
    model_dir = tmp_path / "run"
    status, err = run(*TINY, f"--model_dir={model_dir}", *flags)
    assert status == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert not model_dir.exists() or not os.listdir(model_dir)


@pytest.mark.parametrize("change,settings,message", [
    (dict(task="autoencoder", model="conv_autoencoder", mixup_alpha=0.2), {},
     "task autoencoder does not train on them"),
    (dict(model="conv_autoencoder"), {}, "task classification needs a model that "
     "outputs logits or a dict of heads"),
    (dict(task="distill"), {}, "--task=distill needs --teacher_dir=DIR"),
    (dict(task="distill"), {"teacher_dir": "/nonexistent"}, "run_config.json not found"),
    (dict(task="autoencoder", model="conv_autoencoder", image_size=30), {},
     "divisible by 4"),
])
def test_bad_task_model_and_data_combinations_are_refused_before_writing(
        tiny_config, change, settings, message):
    import models
    from data import sources
    from trainer.config import ConfigError
    from trainer.run_settings import validate
    config = tiny_config.replace(**change)
    with pytest.raises(ConfigError) as raised:
        config = validate(config.with_settings(**settings), models.names(),
                          sources.names())
        loop.train_and_evaluate(config)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not os.path.exists(config.model_dir)


def test_a_teacher_of_another_dataset_or_size_is_refused(tiny_config, tmp_path,
                                                          teacher_dir):
    from data import sources
    from trainer.config import ConfigError
    config = tiny_config.replace(task="distill", dataset="cifar10").with_settings(
        teacher_dir=teacher_dir)

    def load_teacher(config, spec):  # as Distill.create_state does
        builder = build.StateBuilder(config, spec, None, tf.distribute.get_strategy(),
                                     "float32", build.SERVE, build.make_task(config, spec))
        return builder.finished_classifier(teacher_dir, "--teacher_dir", "final")

    with pytest.raises(ConfigError, match="they need the same dataset"):
        load_teacher(config, sources.get_spec("cifar10"))
    config = tiny_config.replace(task="distill", image_size=16).with_settings(
        teacher_dir=teacher_dir)
    with pytest.raises(ConfigError, match="set --image_size=32"):
        load_teacher(config, sources.get_spec("synthetic"))


def test_a_model_whose_output_would_broadcast_is_refused(tiny_config):
    """An image model that outputs another shape than its input would broadcast
    silently in the loss (the issue's 'accuracy 103.9'): refused by shape."""
    import keras
    from data import sources
    from trainer import tasks
    from trainer.config import ConfigError
    config = tiny_config.replace(task="autoencoder", model="conv_autoencoder")
    task = build.make_task(config, sources.get_spec("synthetic"))
    inputs = keras.Input((32, 32, 3))
    wrong = keras.Model(inputs, keras.layers.Conv2D(3, 3)(inputs))  # 30x30
    with pytest.raises(ConfigError, match=r"outputs shape \(30, 30, 3\) per example"):
        tasks.check_model(task, "conv_autoencoder", wrong)
