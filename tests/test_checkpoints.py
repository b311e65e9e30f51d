"""Checkpoints: save/restore, resume, and never clobbering another run."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import models
from trainer import checkpoints, loop, optimizers, run_dir


def _state(seed):
    tf.keras.utils.set_random_seed(seed)
    model = models.build("cifar_cnn", 10, (32, 32, 3), tiny=True)
    optimizer = optimizers.create("adam", 1e-3, model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    return model, optimizer, step, tf.train.Checkpoint(model=model, optimizer=optimizer,
                                                        step=step)


def test_save_and_restore_into_a_fresh_model(tmp_path):
    model, optimizer, step, ckpt = _state(seed=1)
    optimizer.iterations.assign(7)
    step.assign(7)
    manager = checkpoints.make_manager(str(tmp_path), ckpt, keep=2)
    manager.save(checkpoint_number=7)
    fresh, fresh_opt, fresh_step, fresh_ckpt = _state(seed=2)
    kernel = lambda m: next(w for w in m.get_weights() if w.ndim == 4)  # noqa: E731
    assert not np.allclose(kernel(fresh), kernel(model))
    assert checkpoints.restore_latest(fresh_ckpt, str(tmp_path)).endswith("ckpt-7")
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(fresh_step) == 7 and int(fresh_opt.iterations) == 7


@pytest.mark.long(17)  # seconds, with -n 2
def test_run_resumes_and_continues_the_step_count(tiny_config, finished_tiny):
    first = finished_tiny  # tiny_config's run, finished
    assert first["steps"] == 4 and first["resumed_from_step"] == 0
    second = loop.train_and_evaluate(tiny_config.replace(train_steps=8))
    assert second["resumed_from_step"] == 4 and second["steps"] == 8
    assert tf.train.latest_checkpoint(tiny_config.model_dir).endswith("ckpt-8")


def _snapshot(directory):
    """Every file under directory (checkpoints, summaries, pictures) by path."""
    return {os.path.relpath(os.path.join(root, name), directory):
            open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(directory) for name in names}


@pytest.mark.long(15)  # seconds, with -n 2
def test_model_dir_of_another_model_is_refused_untouched(tiny_config, finished_tiny):
    before = _snapshot(tiny_config.model_dir)
    other = tiny_config.replace(model_size="full", train_steps=8)
    with pytest.raises(checkpoints.CheckpointError, match="holds a run with model_size"):
        loop.train_and_evaluate(other)
    assert _snapshot(tiny_config.model_dir) == before


def test_resuming_with_other_model_options_or_lookahead_is_refused(tmp_path):
    run = {"model": "airbench", "model_size": "full", "dataset": "cifar10",
           "optimizer": "sgd", "lookahead_every": 5}
    run_dir.prepare_model_dir(str(tmp_path), run)  # an older run: no model_options
    (tmp_path / "ckpt-5.index").write_bytes(b"")  # (it kept a step: it is a run)
    run_dir.prepare_model_dir(str(tmp_path), {**run, "model_options": ""})
    for change, named in [({"model_options": "whiten=false"}, "model_options"),
                          ({"lookahead_every": 0}, "lookahead_every > 0")]:
        with pytest.raises(checkpoints.CheckpointError, match=f"holds a run with {named}="):
            run_dir.prepare_model_dir(str(tmp_path), {**run, **change})


def test_a_directory_where_no_step_was_kept_is_not_yet_a_run(tmp_path, monkeypatch):
    """A start stopped before its first checkpoint (SIGTERM during start-up, kill
    -9) left run_config.json and run_history.json: a start with other settings
    begins the run afresh there, with one line, instead of being refused."""
    run = {"model": "airbench", "dataset": "cifar10", "learning_rate": 0.001}
    run_dir.prepare_model_dir(str(tmp_path), run)
    changed = {**run, "learning_rate": 0.01, "model": "resnet"}
    assert run_dir.check_previous_run(str(tmp_path), changed) == []
    lines = []  # (the line itself: absl's verbosity is another test's to set)
    monkeypatch.setattr(checkpoints.logging, "info", lambda text, *args: lines.append(
        text % args))
    run_dir.prepare_model_dir(str(tmp_path), changed)
    assert run_dir.read_run_config(str(tmp_path))["learning_rate"] == 0.01
    history = json.loads((tmp_path / checkpoints.RUN_HISTORY).read_text())
    assert [start["start"] for start in history] == [1]  # the afresh start's alone
    line, = [line for line in lines if "afresh" in line]
    assert "--learning_rate: 0.001 -> 0.01" in line and "--model: airbench -> resnet" in line
    # Once a step is kept (a checkpoint, or best weights) it is a run: refused.
    for kept in ("ckpt-20.index", checkpoints.BEST_WEIGHTS_FILE):
        (tmp_path / kept).write_bytes(b"")
        with pytest.raises(checkpoints.CheckpointError):
            run_dir.prepare_model_dir(str(tmp_path), run)
        (tmp_path / kept).unlink()


def test_unwritable_model_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(checkpoints.CheckpointError, match="choose a writable directory"):
        run_dir.prepare_model_dir(str(blocker / "run"), {"model": "x"})


DAMAGE = ("cut", "zero-filled")  # (emptied and bit-flipped: as cut, seen in issue 46)


def _damage(model_dir: str, step: int, how: str = "cut") -> None:
    """A checkpoint's data file as a bad disk leaves it: cut (a crash during a
    copy), zero-filled at its own size (a crashed VM's file system), emptied, or
    one bit flipped."""
    data = [f for f in os.listdir(model_dir) if f.startswith(f"ckpt-{step}.data")][0]
    path = os.path.join(model_dir, data)
    with open(path, "rb") as f:
        kept = bytearray(f.read())
    if how == "cut":
        kept = kept[:100]
    elif how == "zero-filled":
        kept = bytearray(len(kept))
    elif how == "emptied":
        kept = bytearray()
    else:
        kept[len(kept) // 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(kept)


@pytest.mark.long(20)  # seconds, with -n 2
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_before_it(
        tiny_config, finished_tiny, caplog, how):
    import logging  # (finished_tiny: checkpoints at steps 2 and 4)
    _damage(tiny_config.model_dir, 4, how)
    with caplog.at_level(logging.WARNING, logger="absl"):
        resumed = loop.train_and_evaluate(tiny_config.replace(train_steps=6))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 6
    assert "ckpt-4 is unreadable" in caplog.text
    assert tf.train.latest_checkpoint(tiny_config.model_dir).endswith("ckpt-6")


@pytest.mark.long(25)  # seconds, with -n 2
def test_evaluate_predict_and_export_pass_over_a_zero_filled_newest_checkpoint(
        tiny_config, finished_tiny, tmp_path, caplog):
    """evaluate (the newest, --checkpoint=, --watch), predict and export on a run
    whose newest checkpoint is zero-filled: the one before it, with a line, or one
    line naming the file."""
    import logging
    from trainer import evaluate
    from trainer.serving import inference
    model_dir = tiny_config.model_dir  # checkpoints at steps 2 and 4, done
    os.remove(os.path.join(model_dir, checkpoints.WEIGHTS_FILE))  # serve a checkpoint
    os.remove(os.path.join(model_dir, checkpoints.BEST_WEIGHTS_FILE))
    _damage(model_dir, 4, "zero-filled")
    with caplog.at_level(logging.WARNING, logger="absl"):
        newest = evaluate.evaluate_checkpoints(model_dir, str(tmp_path / "ev"))
    assert [r["checkpoint"] for r in newest] == ["ckpt-2"]
    assert "missed ckpt-4: OpError: The length checksum does not match" in caplog.text
    with pytest.raises(checkpoints.CheckpointError, match=r"cannot read .*ckpt-4 \(OpE"):
        evaluate.evaluate_checkpoints(model_dir, str(tmp_path / "ev2"),
                                      checkpoint=os.path.join(model_dir, "ckpt-4"))
    watched = evaluate.evaluate_checkpoints(model_dir, str(tmp_path / "ev3"), watch=True,
                                            timeout=5)
    assert [r["checkpoint"] for r in watched] == ["ckpt-2"]
    written = json.loads((tmp_path / "ev3" / evaluate.EVALUATIONS_FILE).read_text())
    assert [m["checkpoint"] for m in written["missed"]] == ["ckpt-4"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        served = inference.TrainedModel(model_dir)  # what predict and export load
    assert served.weights.startswith("ckpt-2 (step 2;"), served.weights
    assert "ckpt-4 is unreadable" in caplog.text


@pytest.mark.long(10)  # seconds, with -n 2
def test_no_readable_checkpoint_is_a_one_line_error(tiny_config, finished_tiny):
    for step in (2, 4):
        _damage(tiny_config.model_dir, step)
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"no checkpoint in .* is readable \(ckpt-4, ckpt-2\)"):
        loop.train_and_evaluate(tiny_config.replace(train_steps=6))


@pytest.mark.long(12)  # seconds, with -n 2
def test_checkpoints_written_in_the_background_hold_what_a_direct_write_holds(
        tiny_config, tmp_path):
    """--async_checkpoints: the same checkpoints (every variable, bit for bit) as
    written directly, listed in the index file, the oldest beyond
    --keep_checkpoints removed, no temporary left; a resume from them goes on."""
    settings = dict(train_steps=8, checkpoint_every=2, keep_checkpoints=2)
    direct = loop.train_and_evaluate(tiny_config.replace(
        **settings, model_dir=str(tmp_path / "direct")))
    background_dir = str(tmp_path / "background")
    background = loop.train_and_evaluate(tiny_config.replace(
        **settings, model_dir=background_dir, async_checkpoints=True))
    assert background["state_sha256"] == direct["state_sha256"]
    names = sorted(os.listdir(background_dir))
    assert [n for n in names if n.startswith("ckpt-")] == [
        "ckpt-6.data-00000-of-00001", "ckpt-6.index",
        "ckpt-8.data-00000-of-00001", "ckpt-8.index"], names
    assert not [n for n in names if ".tmp-" in n or n.endswith("_temp")], names
    state = tf.train.get_checkpoint_state(background_dir)
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
        "ckpt-6", "ckpt-8"]
    # (every tensor but the save counter, which only the manager's save counts)
    reader = tf.train.load_checkpoint(os.path.join(background_dir, "ckpt-8"))
    direct_reader = tf.train.load_checkpoint(str(tmp_path / "direct" / "ckpt-8"))
    for key in direct_reader.get_variable_to_shape_map():
        if "save_counter" not in key and "OBJECT_GRAPH" not in key:
            np.testing.assert_array_equal(reader.get_tensor(key),
                                          direct_reader.get_tensor(key), err_msg=key)
    resumed = loop.train_and_evaluate(tiny_config.replace(
        **{**settings, "train_steps": 10}, model_dir=background_dir,
        async_checkpoints=True))
    assert resumed["resumed_from_step"] == 8 and resumed["steps"] == 10


@pytest.mark.long(24)  # seconds, with -n 2
@pytest.mark.parametrize("writes", ["direct", "background"])
def test_a_save_that_fails_leaves_no_temp_and_names_the_last_good_one(tmp_path, run,
                                                                      writes):
    """A full disk at the save of step 4, written directly or in the background
    (--async_checkpoints: the failure is raised at the next save, step 6's,
    which does not start): exit 5, one line naming step 4, ckpt-2 intact."""
    import resource
    import subprocess
    import sys
    from test_main import ROOT, TINY
    model_dir = tmp_path / "run"
    flags = [*TINY, "--steps_per_loop=1", "--checkpoint_every=2", f"--model_dir={model_dir}"]
    status, log = run(*flags, "--train_steps=2")  # in this process; the failing one not
    assert status == 0, log[-2000:]
    args = [sys.executable, "-m", "trainer.main", *flags]
    good = {name: (model_dir / name).read_bytes() for name in os.listdir(model_dir)
            if name.startswith("ckpt-2")}

    def small_files():  # a full disk: no file may grow past 64 KB (a checkpoint is ~330)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    failed = subprocess.run([*args, "--train_steps=6",
                             f"--async_checkpoints={writes == 'background'}"], cwd=ROOT,
                            capture_output=True,
                            text=True, timeout=300, preexec_fn=small_files)
    assert failed.returncode == 5, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not save the checkpoint of step 4 in {model_dir}")
    assert "File too large" in last and f"last good checkpoint is {model_dir}/ckpt-2" in last
    assert "Traceback" not in failed.stderr
    assert not [name for name in os.listdir(model_dir) if name.endswith("_temp")]
    for name, data in good.items():
        assert (model_dir / name).read_bytes() == data
    assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-2")


def test_a_run_config_the_chief_writes_between_the_two_looks_is_a_run(tmp_path,
                                                                       monkeypatch):
    # A worker checks the directory as the chief writes run_config.json: its first
    # look (exists) finds none, its second (listdir) finds it. Seen in .ci/run: the
    # second worker refused the directory, "holds files that are not a run's
    # (run_config.json)", and the 2-worker run failed.
    from trainer.config import Config
    settings = Config(model_dir=str(tmp_path)).as_dict()
    (tmp_path / checkpoints.RUN_CONFIG).write_text(json.dumps(settings))
    real_exists = tf.io.gfile.exists
    looks = []

    def first_look_misses(path):
        if path.endswith(checkpoints.RUN_CONFIG) and not looks:
            looks.append(path)
            return False
        return real_exists(path)
    monkeypatch.setattr(tf.io.gfile, "exists", first_look_misses)
    assert run_dir.check_previous_run(str(tmp_path), settings) == []
    assert looks  # (the race was played)


def test_a_run_config_the_chief_is_writing_is_a_new_run_not_foreign_files(tmp_path):
    # The chief writes run_config.json to a temporary, then renames it; a worker
    # that looks in between sees only the temporary. Seen in the suite: the second
    # worker refused "holds files that are not a run's (run_config.json.tmp-...)".
    from data import files
    from trainer.config import Config
    settings = Config(model_dir=str(tmp_path)).as_dict()
    (tmp_path / "writer.lock").write_text("")
    writing = files.temporary_name(str(tmp_path / checkpoints.RUN_CONFIG))
    with open(writing, "w") as f:
        f.write(json.dumps(settings)[:10])  # half written
    assert run_dir.check_previous_run(str(tmp_path), settings) == []
    # A user's file beside it is still refused, and so is a temporary of theirs.
    (tmp_path / "notes.txt.tmp-" f"{'0' * 32}").write_text("")
    with pytest.raises(checkpoints.CheckpointError, match="notes.txt.tmp-"):
        run_dir.check_previous_run(str(tmp_path), settings)
