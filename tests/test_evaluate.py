"""trainer.evaluate: a checkpoint evaluated apart from training, also following a
running training job; the trainer keeps its best weights."""
import json
import os
import subprocess
import sys
import time

import pytest

from test_main import ROOT, TINY
from trainer import cli, evaluate, loop


def _files(directory: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), directory):
            open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(directory) for name in names}


@pytest.mark.long(14)  # seconds, with -n 2
def test_latest_checkpoint_scores_what_training_scored(tiny_config, finished_tiny,
                                                       tmp_path):
    metrics = finished_tiny  # what training scored
    before = _files(tiny_config.model_dir)
    records = evaluate.evaluate_checkpoints(tiny_config.model_dir, str(tmp_path / "ev"))
    assert len(records) == 1 and records[0]["step"] == 4
    assert records[0]["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    assert records[0]["test_examples"] == 2000
    assert _files(tiny_config.model_dir) == before  # the trainer's files untouched
    written = json.loads((tmp_path / "ev" / evaluate.EVALUATIONS_FILE).read_text())
    assert written["evaluations"][0]["checkpoint"] == "ckpt-4"
    assert os.listdir(tmp_path / "ev" / "eval")  # TensorBoard events
    # An older checkpoint, by path.
    older = evaluate.evaluate_checkpoints(
        tiny_config.model_dir, str(tmp_path / "ev2"),
        checkpoint=os.path.join(tiny_config.model_dir, "ckpt-2"))
    assert older[0]["step"] == 2


@pytest.mark.long(14)  # seconds, with -n 2
def test_best_weights_are_kept_with_their_step(tiny_config):
    metrics = loop.train_and_evaluate(tiny_config.replace(train_steps=6, eval_every=2))
    history = metrics["eval_history"]
    best = max(history, key=lambda r: r["test_accuracy"])
    assert metrics["best_step"] == best["step"]
    assert metrics["best_test_accuracy"] == best["test_accuracy"]
    assert os.path.exists(os.path.join(tiny_config.model_dir, "best.weights.h5"))


@pytest.mark.long(11)  # seconds, with -n 2
def test_no_checkpoint_is_a_one_line_error(tiny_config, capsys):
    loop.train_and_evaluate(tiny_config.replace(train_steps=2))  # in-process: quicker
    for name in os.listdir(tiny_config.model_dir):
        if name.startswith("ckpt") or name == "checkpoint":
            os.remove(os.path.join(tiny_config.model_dir, name))
    capsys.readouterr()
    from absl.testing import flagsaver
    evaluate.define_flags()
    with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_:  # the command's own
        cli.parse_flags(["trainer.evaluate",  # parsing and main, in this process
                              f"--model_dir={tiny_config.model_dir}"])
        evaluate.main(["trainer.evaluate"])
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines()[-1].startswith("error: no checkpoint in")


@pytest.mark.long(35)  # seconds, with -n 2
def test_watch_follows_a_running_training_to_its_end(tmp_path, command):
    model_dir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainer.main", *TINY, "--train_steps=150",
         "--steps_per_loop=5", "--checkpoint_every=50", "--eval_every=150",
         "--keep_checkpoints=10", f"--model_dir={model_dir}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (model_dir / "run_config.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    # The watcher in this process, the trainer in its own (as a user runs them).
    status, _, log = command("trainer.evaluate", f"--model_dir={model_dir}", "--watch",
                             "--timeout=120", f"--output_dir={tmp_path}/watch")
    trainer_err = trainer.communicate(timeout=300)[1]
    assert trainer.returncode == 0, trainer_err[-2000:]
    assert status == 0, log[-2000:]
    records = json.loads((tmp_path / "watch" / evaluate.EVALUATIONS_FILE).read_text())
    steps = [r["step"] for r in records["evaluations"]]
    assert steps == sorted(steps) and len(steps) >= 2 and steps[-1] == 150
    final = json.loads((model_dir / "metrics.json").read_text())
    assert records["evaluations"][-1]["test_accuracy"] == pytest.approx(
        final["test_accuracy"], abs=1e-6)
    assert not (model_dir / "evaluator").exists()  # it wrote only to its --output_dir


@pytest.mark.long(10)  # seconds, with -n 2
@pytest.mark.parametrize("how", ["deleted while listed", "rotated away unseen"])
def test_watch_skips_a_checkpoint_deleted_under_it_and_says_which_it_missed(
        tiny_config, finished_tiny, tmp_path, how):
    """A trainer's --keep_checkpoints deletes checkpoints the evaluator has not
    reached: one line each, in evaluations.json too, and the watcher goes on."""
    import tensorflow as tf
    model_dir = tiny_config.model_dir  # checkpoints at steps 2 and 4, done
    for name in tf.io.gfile.glob(os.path.join(model_dir, "ckpt-2.*")):
        tf.io.gfile.remove(name)
    if how == "rotated away unseen":  # the index no longer lists it either
        with open(os.path.join(model_dir, "checkpoint"), "w") as f:
            f.write('model_checkpoint_path: "ckpt-4"\n'
                    'all_model_checkpoint_paths: "ckpt-4"\n')
    records = evaluate.evaluate_checkpoints(model_dir, str(tmp_path / "w"), watch=True,
                                            timeout=30)
    assert [r["checkpoint"] for r in records] == ["ckpt-4"]
    written = json.loads((tmp_path / "w" / evaluate.EVALUATIONS_FILE).read_text())
    assert [m["checkpoint"] for m in written["missed"]] == ["ckpt-2"]
    assert ("deleted before it could be read" if how == "deleted while listed" else
            "before the evaluator saw it") in written["missed"][0]["why"]
