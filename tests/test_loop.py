"""The outer loop runs whatever the step returns: a new metric reaches every output,
a model with an auxiliary head trains and serves its main head."""
import json
import logging
import os

from absl import logging as absl_logging
import numpy as np
import pytest
import tensorflow as tf

from trainer import loop, step


def _tags(event_dir: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for name in tf.io.gfile.listdir(event_dir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(event_dir, name)):
            for value in event.summary.value:
                values.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor)) if value.tensor.dtype else 0.0)
    return values


def test_a_metric_the_step_returns_reaches_log_tensorboard_and_metrics_json(
        tiny_config, monkeypatch, caplog):
    original = step.train_step

    def step_with_a_new_metric(state, task, batch, options):
        metrics = original(state, task, batch, options)
        # The researcher's one-line change: the mean squared logit of the batch.
        logits = state.model(batch["image"], training=False)
        return {**metrics, "logit_square": (tf.reduce_sum(logits ** 2),
                                            tf.cast(tf.size(logits), tf.float32))}

    monkeypatch.setattr(step, "train_step", step_with_a_new_metric)
    with caplog.at_level(logging.INFO, logger="absl"):
        loop.train_and_evaluate(tiny_config)
        absl_logging.info("capture works")
    assert "capture works" in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all("logit_square " in line and "grad_norm " in line for line in lines)
    with open(os.path.join(tiny_config.model_dir, "metrics.json")) as f:
        written = json.load(f)
    history = written["train_history"]
    assert all(r["train_logit_square"] > 0 and r["train_grad_norm"] > 0 for r in history)
    assert written["train_logit_square"] == history[-1]["train_logit_square"]
    tags = _tags(os.path.join(tiny_config.model_dir, "train"))
    np.testing.assert_allclose(tags["logit_square"],
                               [r["train_logit_square"] for r in history], rtol=1e-6)
    assert "grad_norm" in tags and "skipped" in tags


@pytest.mark.long(16)  # seconds, with -n 2
def test_a_two_output_model_trains_with_its_auxiliary_loss_and_exports_logits(
        tiny_config, tmp_path):
    from trainer.serving import export, inference
    config = tiny_config.replace(model="resnet_aux").with_settings(aux_loss_weight=0.5)
    metrics = loop.train_and_evaluate(config)
    assert np.isfinite(metrics["train_loss"]) and metrics["test_examples"] == 2000
    trained = inference.TrainedModel(config.model_dir)
    assert set(trained.model(np.zeros((1, 32, 32, 3), np.float32))) == {"logits",
                                                                          "aux_logits"}
    out = export.export(config.model_dir, str(tmp_path / "export"))
    served = tf.saved_model.load(out)
    images = tf.constant(np.random.default_rng(0).integers(0, 255, (3, 32, 32, 3)),
                         tf.uint8)
    result = served.signatures["predict_images"](images=images)
    expected = trained.serve(list(images.numpy()))["probabilities"]
    np.testing.assert_allclose(result["probabilities"].numpy(), expected, atol=1e-5)


@pytest.mark.long(12)  # seconds, with -n 2
def test_a_whole_run_and_its_resume_on_a_bucket_like_filesystem(tmp_path, monkeypatch,
                                                                 tmp_path_factory):
    """TFRecords and --model_dir on TensorFlow's in-memory ram:// (standing in for
    gs://): everything the run writes lands there, nothing on the local disk."""
    import tempfile
    import uuid
    from data import make_tfrecords
    from trainer.config import Config
    monkeypatch.chdir(tmp_path)  # a "ram:" folder made by mistake would land here
    # A temporary directory of this test's own (other tests may run beside it).
    private_temp = str(tmp_path_factory.mktemp("temp"))
    monkeypatch.setattr(tempfile, "tempdir", private_temp)
    monkeypatch.setenv("TMPDIR", private_temp)
    bucket = f"ram://{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    for label, name in enumerate(("cats", "dogs")):
        for i in range(12):
            tf.io.write_file(f"{bucket}/photos/{name}/{i}.png", tf.io.encode_png(
                rng.integers(0, 255, (20, 20, 3), np.uint8)))
    make_tfrecords.write(f"{bucket}/photos", f"{bucket}/data/pets", 16, 2, None)
    config = Config(model="convnet", model_size="tiny", dataset=f"tfrecord:{bucket}/data/pets*",
                    model_dir=f"{bucket}/run", batch_size=4, train_steps=4,
                    steps_per_loop=2, log_every=2, eval_every=2, checkpoint_every=2,
                    precision="float32", shuffle_buffer=16)
    temp_before = set(os.listdir(tempfile.gettempdir()))
    first = loop.train_and_evaluate(config)
    resumed = loop.train_and_evaluate(config.replace(train_steps=6))
    assert first["steps"] == 4 and resumed["resumed_from_step"] == 4
    written = set(tf.io.gfile.listdir(config.model_dir))
    for name in ("metrics.json", "run_config.json", "summary.png", "model.weights.h5",
                 "best.weights.h5", "dataset.json", "checkpoint", "ckpt-6.index"):
        assert name in written, name
    assert tf.io.gfile.listdir(f"{config.model_dir}/train")  # TensorBoard events
    with tf.io.gfile.GFile(f"{config.model_dir}/metrics.json") as f:
        metrics = json.load(f)
    assert metrics["steps"] == 6 and [r["step"] for r in metrics["eval_history"]] == [2, 4, 6]
    assert os.listdir(tmp_path) == []
    new_in_temp = set(os.listdir(tempfile.gettempdir())) - temp_before
    # (TensorFlow's autograph caches the code it generates there, nothing of the run's)
    assert not [n for n in new_in_temp if not n.startswith("__autograph_generated_file")]


def test_evaluation_has_its_own_batch_size_split_over_the_replicas(tiny_config):
    """--eval_batch_size: evaluation's global batch (0: --batch_size); the last
    batch is padded and masked (tests/test_data.py), so any size is exact."""
    from trainer import build
    from trainer.config import ConfigError
    from trainer.config import LoopSettings

    def plan(eval_batch_size: int) -> build.Plan:
        loop = tiny_config.replace(eval_batch_size=eval_batch_size).group(LoopSettings)
        return build.Plan.make(loop, 1, 10_000, 2_000, 2)
    assert (plan(256).eval_steps, plan(256).steps_per_epoch,
            plan(256).per_replica_batch) == (8, 625, 8)
    assert plan(0).eval_steps == 125  # 2,000 / 16
    with pytest.raises(ConfigError, match="--eval_batch_size=255 does not divide by "
                                          "the 2 replicas"):
        plan(255)
