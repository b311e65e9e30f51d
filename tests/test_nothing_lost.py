"""Nothing lost, nothing silent (issue 18): final writes whole or not at all, one
writer per run directory, exact data counts, non-finite settings and weights,
state files of the wrong shape, stale temporaries, SIGTERM at start-up, the
launcher watching every worker."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from absl.testing import flagsaver
import h5py
import numpy as np
import pytest
import tensorflow as tf

from conftest import small_tfrecord_dataset
from data import files, tfrecords
from trainer import checkpoints, locks
from trainer import cli, main as main_lib
from trainer.tools import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model_size=tiny", "--dataset=synthetic", "--batch_size=16", "--train_steps=4",
        "--steps_per_loop=2", "--log_every=2", "--precision=float32"]


@pytest.fixture(scope="session")  # (a module fixture is rebuilt each time xdist returns)
def finished(tmp_path_factory):
    """One finished tiny run (2 steps, a checkpoint at each), made once; tests copy it."""
    model_dir = tmp_path_factory.mktemp("finished") / "run"
    main_lib.define_flags()
    with flagsaver.flagsaver():  # the command line's run, as `run` makes it
        cli.parse_flags(["trainer.main", *TINY, "--train_steps=2",
                              "--checkpoint_every=2", f"--model_dir={model_dir}",
                              "--verbosity=0"])
        main_lib.main(["trainer.main"])
    return model_dir


def _copy(finished, tmp_path):
    import shutil
    return shutil.copytree(finished, tmp_path / "run")


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _leftovers(directory) -> list[str]:
    from trainer.tools import kill_resume
    return kill_resume.leftovers(str(directory))


# --- 1. Every file whole or not at all -------------------------------------------------

@pytest.mark.long(10)  # seconds, with -n 2
def test_a_final_write_that_fails_exits_5_and_keeps_the_previous_weights(
        tmp_path, run, monkeypatch, finished):
    model_dir = _copy(finished, tmp_path)
    before = _sha(model_dir / "model.weights.h5")
    real_gfile = tf.io.gfile.GFile

    class FullDisk(real_gfile):  # the final weights' temporary cannot be written
        def write(self, data):
            if "model.weights.h5.tmp-" in self.name:
                raise tf.errors.ResourceExhaustedError(None, None,
                                                       "No space left on device")
            return super().write(data)

    monkeypatch.setattr(files.tf.io.gfile, "GFile", FullDisk)
    status, err = run(*TINY, "--train_steps=6", f"--model_dir={model_dir}")
    assert status == 5, err[-1500:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: could not write ") and "model.weights.h5" in last
    assert "No space left on device" in last and "Traceback" not in err
    assert _sha(model_dir / "model.weights.h5") == before  # bitwise the old file
    assert not _leftovers(model_dir)


def _served_run(model_dir, task: str, teacher_dir: str = "") -> str:
    """A run directory as a finished run leaves it for predict (run_config.json,
    model.weights.h5, metrics.json), of `task` on the generated data: its output
    model built, not trained (predict and its writes are what is tested)."""
    from trainer import build, config as config_lib
    models_of = {"autoencoder": "conv_autoencoder", "gan": "dcgan"}
    config = config_lib.Config(task=task, model=models_of.get(task, "cifar_cnn"),
                               model_size="tiny", dataset="synthetic",
                               model_dir=str(model_dir))
    if task == "distill":
        config = config.with_settings(teacher_dir=teacher_dir)
    run = build.build_run(config, build.run_data(config).spec, None,
                          tf.distribute.get_strategy(), purpose=build.SERVE)
    os.makedirs(model_dir)
    checkpoints.save_weights(run.output_model, str(model_dir / "model.weights.h5"))
    files.write_json(str(model_dir / "run_config.json"), config.as_dict())
    files.write_json(str(model_dir / "metrics.json"), {"status": "done", "steps": 0})
    return str(model_dir)


def _predict(*args: str) -> int:
    """trainer.serving.predict in this process: its exit status."""
    from trainer.serving import predict
    with flagsaver.flagsaver():
        predict.define_flags()
        argv = predict.FLAGS(["predict", *args, "--verbosity=0"])
        try:
            predict.main(argv)
        except SystemExit as exit_:
            return exit_.code
    return 0


@pytest.mark.parametrize("task, fails", [
    ("classification", "file"), ("simclr", "file"), ("distill", "file"),  # (no files)
    ("autoencoder", "file"), ("autoencoder", "folder"), ("gan", "file")])
def test_predict_on_a_full_disk_is_one_line_exit_5_and_leaves_nothing(
        tmp_path, monkeypatch, capsys, task, fails):
    """Issue 43: every file predict writes for each task's report (an
    autoencoder's reconstruction, a GAN's grid; the others write none) on a disk
    that refuses the bytes, or the folder: one line naming the file, exit 5, no
    file or temporary left (it was two tracebacks and exit 1)."""
    teacher = _served_run(tmp_path / "teacher", "classification") if (
        task == "distill") else ""
    model_dir = _served_run(tmp_path / "run", task, teacher)
    out = str(tmp_path / "out")
    real_gfile, real_makedirs = tf.io.gfile.GFile, tf.io.gfile.makedirs

    class FullDisk(real_gfile):
        def write(self, data):
            if self.name.startswith(out):
                raise tf.errors.ResourceExhaustedError(None, None,
                                                       "No space left on device")
            return super().write(data)

    def no_folder(path):
        if str(path).startswith(out):
            raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
        return real_makedirs(path)

    if fails == "file":
        monkeypatch.setattr(files.tf.io.gfile, "GFile", FullDisk)
    else:
        monkeypatch.setattr(files.tf.io.gfile, "makedirs", no_folder)
    what = ["--samples=4"] if task == "gan" else ["--dataset=synthetic", "--index=0"]
    status = _predict(f"--model_dir={model_dir}", f"--output_dir={out}", *what)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    left = [os.path.join(top, n) for top, _, names in os.walk(out) for n in names]
    assert not left and "Traceback" not in err, (left, err[-2000:])
    if task not in ("autoencoder", "gan"):  # a report of lines: nothing to write
        assert status == 0 and not errors, err[-2000:]
        return
    written = f"{out}/{'samples' if task == 'gan' else 'synthetic_test_0'}.png"
    assert status == 5 and len(errors) == 1, err[-2000:]
    assert errors[0].startswith(f"error: could not write {written} (No space left on "
                                f"device"), errors[0]


def test_weights_made_in_memory_are_keras_own_file(tmp_path, tiny_model_and_data):
    """The private Keras writer checkpoints.weights_h5_bytes relies on: if an upgrade
    changes it, this fails (it must load with the public load_weights, to the same
    values, and hold the same datasets as model.save_weights' file)."""
    model = tiny_model_and_data
    path = tmp_path / "a.weights.h5"
    checkpoints.save_weights(model, str(path))
    model.save_weights(str(tmp_path / "b.weights.h5"))
    original = model.get_weights()
    model.set_weights([w * 0 for w in original])
    model.load_weights(str(path))
    for got, want in zip(model.get_weights(), original):
        np.testing.assert_array_equal(got, want)

    def datasets(name):
        found = {}
        with h5py.File(tmp_path / name) as f:
            f.visititems(lambda key, item: found.__setitem__(key, item[()])
                         if isinstance(item, h5py.Dataset) else None)
        return found
    a, b = datasets("a.weights.h5"), datasets("b.weights.h5")
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


@pytest.fixture
def tiny_model_and_data():
    import models
    model = models.build("cifar_cnn", 10, (32, 32, 3), tiny=True)
    model(np.zeros((1, 32, 32, 3), np.float32))
    return model


def test_atomic_writes_leave_the_old_file_or_none_on_any_filesystem(monkeypatch):
    path = "ram://atomic/metrics.json"
    files.write_json(path, {"a": 1})
    real_rename = tf.io.gfile.rename
    monkeypatch.setattr(files.tf.io.gfile, "rename", lambda *a, **k: (_ for _ in ()).throw(
        tf.errors.PermissionDeniedError(None, None, "Permission denied")))
    with pytest.raises(files.WriteError, match="could not write ram://atomic/metrics.json "
                                               r"\(Permission denied\)"):
        files.write_json(path, {"a": 2})
    monkeypatch.setattr(files.tf.io.gfile, "rename", real_rename)
    assert files.read_json(path) == {"a": 1}
    assert tf.io.gfile.listdir("ram://atomic") == ["metrics.json"]


def test_an_output_path_in_a_new_place_is_made_or_is_one_line_with_the_cause(tmp_path):
    """Every writer (write_atomically, written_whole: predict's images, lr_find's,
    compare_runs' --plot, make_tfrecords' --output) makes the missing directories
    above its file, as mkdir -p; where they cannot be made (a file in the way
    here, a read-only file system for a user), WriteError names the file and the
    cause, and nothing is left."""
    nested = tmp_path / "new" / "place" / "lr_find.json"
    files.write_json(str(nested), {"a": 1})
    assert files.read_json(str(nested)) == {"a": 1}
    files.write_json("ram://fresh/place/metrics.json", {"b": 2})  # (any file system)
    assert files.read_json("ram://fresh/place/metrics.json") == {"b": 2}
    (tmp_path / "a_file").write_text("in the way")
    blocked = tmp_path / "a_file" / "sub" / "plot.png"
    with pytest.raises(files.WriteError, match=rf"could not write {blocked} \(") as err:
        files.write_atomically(str(blocked), b"png")
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "new"]


def test_tfrecord_shards_and_an_export_appear_whole(tmp_path, monkeypatch):
    real = tf.io.TFRecordWriter

    class FailsAtTheThird(real):
        count = 0

        def write(self, record):
            FailsAtTheThird.count += 1
            if FailsAtTheThird.count == 3:
                raise tf.errors.ResourceExhaustedError(None, None, "No space left")
            return super().write(record)

    monkeypatch.setattr(tfrecords.tf.io, "TFRecordWriter", FailsAtTheThird)
    with pytest.raises(files.WriteError, match="could not write .*shard-01-2.tfrec"):
        tfrecords.write_shards((b"x" for _ in range(4)), 4, str(tmp_path / "shard-"), 2)
    assert sorted(os.listdir(tmp_path)) == ["shard-00-2.tfrec"]  # whole, and only it

    def fails(tmp):
        tf.io.gfile.makedirs(tmp)
        open(os.path.join(tmp, "saved_model.pb"), "w").write("half")
        raise tf.errors.ResourceExhaustedError(None, None, "No space left")
    with pytest.raises(files.WriteError):
        with files.written_whole(str(tmp_path / "export")) as tmp:
            fails(tmp)
    assert sorted(os.listdir(tmp_path)) == ["shard-00-2.tfrec"]


# --- 2. One trainer per run directory ---------------------------------------------------

def test_a_second_holder_is_refused_naming_the_first_and_a_dead_ones_lock_is_stale(
        tmp_path):
    lock = locks.acquire(str(tmp_path), "trainer.main")
    with pytest.raises(locks.DirectoryInUse, match=rf"in use by trainer.main \(host "
                       rf"{socket.gethostname()}, pid {os.getpid()}, since 20"):
        locks.acquire(str(tmp_path), "trainer.evaluate")
    lock.release()
    assert not (tmp_path / locks.LOCK_FILE).exists()
    # A holder killed with -9 on this host: its pid is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"token": "old", "host": socket.gethostname(), "pid": dead.pid,
              "since": time.time(), "renewed": time.time(), "command": "trainer.main"}
    (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
    locks.acquire(str(tmp_path), "trainer.main").release()
    # Another machine: alive while it renews its lease, stale after.
    record.update(host="elsewhere", pid=1)
    (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(locks.DirectoryInUse, match="host elsewhere"):
        locks.acquire(str(tmp_path), "trainer.main")
    record["renewed"] = time.time() - locks.LEASE_SECONDS - 1
    (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
    locks.acquire(str(tmp_path), "trainer.main").release()


def test_the_lock_works_on_a_filesystem_without_exclusive_create(monkeypatch):
    monkeypatch.setattr(locks, "SETTLE_SECONDS", 0.01)
    lock = locks.acquire("ram://locked/run", "trainer.main")
    with pytest.raises(locks.DirectoryInUse):
        locks.acquire("ram://locked/run", "trainer.main")
    lock.release()
    locks.acquire("ram://locked/run", "trainer.main").release()


@pytest.mark.long(27)  # seconds, with -n 2
def test_two_trainers_on_one_directory_one_trains_and_a_kill_9_needs_no_cleanup(tmp_path,
                                                                                run):
    model_dir = tmp_path / "run"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    args = [sys.executable, "-m", "trainer.main", *TINY, "--train_steps=100000",
            "--checkpoint_every=2", f"--model_dir={model_dir}"]
    first = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list(model_dir.glob("ckpt-*.index")) and time.time() < deadline:
            time.sleep(0.2)
        config_before = (model_dir / "run_config.json").read_text()
        # The second and third trainers in this process (the first holds the lock).
        status, log = run(*args[3:], "--learning_rate=0.5", "--seed=3")
        assert first.poll() is None, "the first run ended; make it longer"
    finally:
        first.kill()  # kill -9: it leaves its lock
        first.wait()
    assert status == locks.IN_USE_EXIT_CODE, log[-1500:]  # 75: a scheduler retries
    line = log.strip().splitlines()[-1]
    assert line.startswith(f"error: {model_dir} is in use by trainer.main (host "), line
    assert f"pid {first.pid}" in line and "Traceback" not in log
    assert (model_dir / "run_config.json").read_text() == config_before
    assert (model_dir / locks.LOCK_FILE).exists()  # left by the kill -9
    status, log = run(*args[3:-2], "--train_steps=4", f"--model_dir={model_dir}")
    assert status == 0, log[-1500:]
    assert "taking over the stale lock" in log and "Resumed from" in log
    assert not _leftovers(model_dir)


def test_every_file_a_run_writes_is_one_whose_temporary_a_restart_removes(
        finished_tiny, tiny_config):
    # A kill -9 during any of these writes leaves `<name>.tmp-<hex>`; the next start
    # removes it only if checkpoints.written_by_a_run(name) (log.csv was missed once).
    top = [name for name in os.listdir(tiny_config.model_dir)
           if os.path.isfile(os.path.join(tiny_config.model_dir, name))
           and not name.startswith(("ckpt-", "checkpoint"))]
    assert "log.csv" in top and "run_config.json" in top
    assert [name for name in top if not checkpoints.written_by_a_run(name)] == []
    assert not checkpoints.written_by_a_run("notes.txt")


def test_an_evaluator_cannot_write_into_a_directory_a_trainer_holds(tmp_path, capsys):
    lock = locks.acquire(str(tmp_path / "run"), "trainer.main")
    try:
        from trainer import evaluate
        evaluate.define_flags()
        with flagsaver.flagsaver():
            main_lib.FLAGS(["trainer.evaluate", f"--model_dir={tmp_path}/run",
                            f"--output_dir={tmp_path}/run"])
            with pytest.raises(SystemExit) as exit_:
                evaluate.main(["trainer.evaluate"])
    finally:
        lock.release()
    assert exit_.value.code == locks.IN_USE_EXIT_CODE
    assert "is in use by trainer.main" in capsys.readouterr().err


# --- 3. Data counts ---------------------------------------------------------------------

def test_a_shard_cut_at_a_record_boundary_is_one_line_naming_both_counts(tmp_path, run):
    path = small_tfrecord_dataset(tmp_path, per_class=6)  # 12 records in one shard
    records = [r.numpy() for r in tf.data.TFRecordDataset(path)]
    with tf.io.TFRecordWriter(path) as writer:  # cleanly cut: the first 7 records
        for record in records[:7]:
            writer.write(record)
    status, err = run("--model=convnet", "--model_size=tiny",
                       f"--dataset=tfrecord:{path}", "--batch_size=2", "--train_steps=2",
                       f"--model_dir={tmp_path}/run")
    assert status == 2, err[-1500:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: the files '{path}'") and "promise" in line
    assert "but 5 were read" in line or "were read" in line
    # (issue 43: the file and its records too, not only the pattern)
    assert f"read: {path} holds 7 records, its name says 12 (records 7-11 are " in line
    assert "Traceback" not in err


# --- 4. Non-finite settings and weights -------------------------------------------------

@pytest.mark.parametrize("flag", ["--learning_rate=nan", "--learning_rate=inf",
                                  "--weight_decay=-inf", "--distill_alpha=nan",
                                  "--learning_rate=1e39"])
def test_non_finite_float_flags_are_one_line(tmp_path, run, flag):
    status, err = run(*TINY, flag, f"--model_dir={tmp_path}/run")
    line = err.strip().splitlines()[-1]
    assert status == 2 and line.startswith(f"error: {flag.split('=')[0]}="), line
    assert "give a finite number" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.long(10)  # seconds, with -n 2
def test_an_update_that_overflows_the_weights_is_skipped_and_never_saved(
        tmp_path, run):
    # 3e38 is float32's largest order of magnitude: updates overflow, or leave weights
    # so large that the next gradient does.
    status, err = run(*TINY, "--optimizer=sgd", "--learning_rate=3e38",
                       "--on_nan=skip_step", f"--model_dir={tmp_path}/run")
    assert status == 0, err[-1500:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["skipped_steps"] >= 1  # (the step's own test: test_step.py)
    with h5py.File(tmp_path / "run" / "model.weights.h5") as f:
        arrays = []
        f.visititems(lambda k, v: arrays.append(v[()]) if isinstance(v, h5py.Dataset)
                     else None)
    assert arrays and all(np.all(np.isfinite(a)) for a in arrays)
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "ckpt-4"))
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), name
    status, err = run(*TINY, "--optimizer=sgd", "--learning_rate=3e38",
                       "--on_nan=stop", f"--model_dir={tmp_path}/stop")
    assert status == 3 and "non-finite" in err.strip().splitlines()[-1]
    # Issue 43: no "last good checkpoint is kept" when there is none; metrics.json
    # says how the run ended, not "running".
    assert "no checkpoint was saved before it" in err.strip().splitlines()[-1]
    stopped = json.loads((tmp_path / "stop" / "metrics.json").read_text())
    assert stopped["status"] == "diverged" and "non-finite" in stopped["ended_by"]


# --- 5. State files of the wrong shape ---------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("[]", "holds a JSON list, not an object"),
    ('{"model": "cifar_cnn"', "is not valid JSON"),
    ('{"seed": 1}', "has no 'model', 'dataset'"),
])
def test_a_run_config_of_the_wrong_shape_is_one_line(tmp_path, run, text, message):
    (tmp_path / "run_config.json").write_text(text)
    status, err = run(*TINY, f"--model_dir={tmp_path}")
    assert status == 2 and message in err.strip().splitlines()[-1]
    assert "Traceback" not in err and (tmp_path / "run_config.json").read_text() == text


@pytest.mark.long(9)  # seconds, with -n 2
def test_metrics_of_the_wrong_shape_restart_the_history_with_a_warning(tmp_path, run,
                                                                      finished):
    model_dir = _copy(finished, tmp_path)
    (model_dir / "metrics.json").write_text('{"train_history": [{"loss": 1}]}')
    status, err = run(*TINY, f"--model_dir={model_dir}")
    assert status == 0, err[-1500:]
    assert "holds history records without a step; the history restarts" in err
    for path in ("ram://shape/a.json",):
        files.write_atomically(path, "[1]")
        with pytest.raises(files.BadFileError, match="a JSON list, not an object"):
            files.read_json(path)


# --- 6. Stale temporaries ---------------------------------------------------------------

@pytest.mark.long(9)  # seconds, with -n 2
def test_stale_temporaries_are_removed_at_start_up_and_complete_files_kept(
        tmp_path, run, finished):
    model_dir = _copy(finished, tmp_path)
    (model_dir / "ckpt-4_temp").mkdir()  # as a kill -9 mid-save leaves them
    (model_dir / "ckpt-4_temp" / "part-00000-of-00001.data-00000-of-00001").write_text("x")
    (model_dir / f"metrics.json.tmp-{'a' * 32}").write_text("{")
    (model_dir / "notes.tmp").write_text("a user's file")  # not a writer's temporary
    # Named like temporaries, but not what a writer of the run leaves (issue 31):
    # a user's file, a folder of theirs named like TensorFlow's.
    (model_dir / f"notes.tmp-{'b' * 32}").write_text("a user's file")
    (model_dir / "ckpt-9_temp").mkdir()
    (model_dir / "ckpt-9_temp" / "keep.txt").write_text("a user's file")
    status, err = run(*TINY, f"--model_dir={model_dir}")
    assert status == 0, err[-1500:]
    assert "removed 2 temporary file(s)" in err and "ckpt-4_temp" in err
    assert not [path for path in _leftovers(model_dir)
                if not path.endswith((f"notes.tmp-{'b' * 32}", "ckpt-9_temp"))]
    assert (model_dir / "notes.tmp").exists() and (model_dir / "ckpt-2.index").exists()
    assert (model_dir / f"notes.tmp-{'b' * 32}").read_text() == "a user's file"
    assert (model_dir / "ckpt-9_temp" / "keep.txt").read_text() == "a user's file"


# --- 7. SIGTERM during start-up ---------------------------------------------------------

def test_sigterm_during_start_up_exits_75_with_one_line(tmp_path, run, monkeypatch):
    from trainer import inputs
    real = inputs.train_input_fn

    def signalled(*args, **kwargs):  # SIGTERM arrives while the data is prepared
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(inputs, "train_input_fn", signalled)
    status, err = run(*TINY, f"--model_dir={tmp_path}/run")
    assert status == 75
    assert err.strip().splitlines()[-1].startswith("stopped: SIGTERM during start-up")
    assert not _leftovers(tmp_path) and not list((tmp_path / "run").glob("ckpt-*"))


# --- 8. The launcher watches every worker -------------------------------------------------

@pytest.mark.parametrize("dies", [0, 1])
def test_the_launcher_stops_all_when_any_worker_dies_and_exits_4(capsys, dies):
    """Workers that sleep; worker `dies` kills itself with -9 after 1 s."""
    script = ("import json, os, signal, time; "
              "index = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
              f"time.sleep(1); index == {dies} and os.kill(os.getpid(), signal.SIGKILL); "
              "time.sleep(120)")
    start = time.time()
    status = launch.launch(3, [], program=[sys.executable, "-c", script])
    assert status == 4 and time.time() - start < 30
    err = capsys.readouterr().err
    assert f"error: worker {dies} died (killed by signal 9); stopped the others" in err


def test_a_live_holder_here_is_never_taken_over_and_a_reused_pid_is_stale(tmp_path):
    """A holder frozen past its lease (kill -STOP: its lease not renewed) is alive:
    the directory stays in use. A pid that now belongs to another process, or to
    the rerun itself, is stale at once."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"token": "frozen", "host": socket.gethostname(), "pid": holder.pid,
                  "started": locks.process_start(holder.pid), "command": "trainer.main",
                  "since": time.time() - 3600, "renewed": time.time() - 3600}
        (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(locks.DirectoryInUse, match=f"pid {holder.pid}"):
            locks.acquire(str(tmp_path), "trainer.main")
        record["started"] = "another boot:123"  # the pid reused by another process
        (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
        locks.acquire(str(tmp_path), "trainer.main").release()
    finally:
        holder.kill()
        holder.wait()
    record.update(pid=os.getpid(), started=None, renewed=time.time())  # our own pid
    (tmp_path / locks.LOCK_FILE).write_text(json.dumps(record))
    locks.acquire(str(tmp_path), "trainer.main").release()


def test_a_holder_whose_lock_was_taken_over_stops_before_its_next_write(tiny_config,
                                                                        monkeypatch):
    """The first trainer, thawed after another took its directory over, must not
    write again: exit 6 before its next checkpoint, no final outputs."""
    from trainer import loop
    from trainer.output import progress
    original_show = progress.Progress.show

    def taken_over_at_step_2(self, step, learning_rate):
        if step == 2:  # another process's lock, as a takeover leaves it
            lock = os.path.join(tiny_config.model_dir, locks.LOCK_FILE)
            record = {**json.loads(open(lock).read()), "token": "theirs", "pid": 1}
            open(lock, "w").write(json.dumps(record))
        original_show(self, step, learning_rate)

    monkeypatch.setattr(progress.Progress, "show", taken_over_at_step_2)
    with locks.held(tiny_config.model_dir, "trainer.main"):
        with pytest.raises(locks.LockLost, match="was taken over by trainer.main"):
            loop.train_and_evaluate(tiny_config)
        assert tf.train.latest_checkpoint(tiny_config.model_dir) is None
        assert not os.path.exists(os.path.join(tiny_config.model_dir, "model.weights.h5"))
