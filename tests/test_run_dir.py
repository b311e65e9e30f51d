"""A run directory is one run (issue 31): a start with other settings is one line
listing each and touches nothing; --resume_with_changes continues on purpose and
is recorded, run_config.json never rewritten; a rerun of a finished run changes
nothing; a sweep's points land in runs of their own; a folder that is not a run,
or a symbolic link in a run, is refused; the run records where it came from."""
import json
import os

import pytest
import tensorflow as tf

from data import files
from test_main import TINY
from trainer import checkpoints, config as config_lib, run_dir, run_settings

# finished_tiny's run (tests/conftest.py) as trainer.main's flags.
SAME = [*TINY, "--shuffle_buffer=64", "--image_size=0"]


def _files(directory: str) -> dict[str, bytes]:
    """Every file under `directory` (links not followed) and its bytes."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def test_a_start_with_other_settings_is_one_line_listing_each_and_touches_nothing(
        finished_tiny, tiny_config, run):
    before = _files(tiny_config.model_dir)
    status, log = run(*SAME, f"--model_dir={tiny_config.model_dir}",
                      "--learning_rate=0.01", "--seed=1")
    assert status == 2, log[-2000:]
    errors = _errors(log)
    assert len(errors) == 1, log[-2000:]
    assert "--learning_rate: 0.001 -> 0.01" in errors[0]
    assert "--seed: 0 -> 1" in errors[0] and "--resume_with_changes" in errors[0]
    assert _files(tiny_config.model_dir) == before


def test_a_rerun_of_a_finished_run_says_so_and_leaves_every_file_as_it_was(
        finished_tiny, tiny_config, run):
    before = _files(tiny_config.model_dir)
    status, log = run(*SAME, f"--model_dir={tiny_config.model_dir}",
                      "--eval_every=2")  # (a cadence may differ)
    assert status == 0, log[-2000:]
    assert "is finished (4 steps" in log and "nothing to do" in log
    assert _files(tiny_config.model_dir) == before


@pytest.mark.long(12)  # seconds, with -n 2
def test_resume_with_changes_continues_and_records_them_never_rewriting_the_settings(
        finished_tiny, tiny_config, run):
    model_dir = tiny_config.model_dir
    settings = _files(model_dir)[checkpoints.RUN_CONFIG]
    status, log = run(*SAME, f"--model_dir={model_dir}", "--learning_rate=0.01",
                      "--train_steps=6", "--resume_with_changes")
    assert status == 0 and "Resumed from" in log, log[-2000:]
    assert _files(model_dir)[checkpoints.RUN_CONFIG] == settings  # never rewritten
    with open(os.path.join(model_dir, checkpoints.RUN_HISTORY)) as f:
        history = json.load(f)
    assert history[-1]["changed"]["learning_rate"] == [0.001, 0.01]
    assert history[-1]["changed"]["train_steps"] == [4, 6]
    assert run_dir.read_run_config(model_dir)["learning_rate"] == 0.01
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["steps"] == 6 and metrics["settings"]["learning_rate"] == 0.01
    where = metrics["provenance"]
    assert where["tensorflow"] == tf.__version__ and where["python"] and where["host"]
    assert "2 x cpu" in where["devices"] or "1 x cpu" in where["devices"]
    assert where["git_commit"] is None or len(where["git_commit"]) >= 40
    # The run's settings are now the changed ones: the same start again is a rerun.
    status, log = run(*SAME, f"--model_dir={model_dir}", "--learning_rate=0.01",
                      "--train_steps=6")
    assert status == 0 and "is finished (6 steps" in log, log[-2000:]


def test_a_sweeps_points_get_runs_of_their_own_and_the_same_command_its_run():
    def model_dir(*flags: str) -> str:
        values = {**config_lib.Config().as_dict()}
        values.pop("task_settings")
        explicit = set()
        for flag in flags:
            name, value = flag[2:].split("=")
            values[name] = type(values[name])(value) if values[name] is not None else value
            explicit.add(name)
        return run_settings.resolve(values, explicit)[0].model_dir

    readme = model_dir("--model=cifar_cnn", "--dataset=cifar10")
    assert readme == os.path.join("runs", "cifar_cnn_cifar10")
    assert model_dir("--model=cifar_cnn", "--dataset=cifar10", "--seed=0") == readme
    assert model_dir("--model=cifar_cnn", "--dataset=cifar10", "--epochs=80") == readme
    first = model_dir("--model=cifar_cnn", "--dataset=cifar10", "--seed=1",
                      "--learning_rate=0.01")
    second = model_dir("--model=cifar_cnn", "--dataset=cifar10", "--seed=2",
                       "--learning_rate=0.01")
    assert len({readme, first, second}) == 3
    assert first == os.path.join("runs", "cifar_cnn_cifar10_learning_rate=0.01_seed=1")


def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, run):
    folder = tmp_path / "my_files"
    (folder / "ckpt-3_temp").mkdir(parents=True)
    (folder / "ckpt-3_temp" / "keep.txt").write_text("mine")
    (folder / f"notes.tmp-{'a' * 32}").write_text("mine too")
    (folder / "model.weights.h5").write_text("not ours")
    before = _files(str(folder))
    status, log = run(*SAME, f"--model_dir={folder}")
    assert status == 2 and len(_errors(log)) == 1, log[-2000:]
    assert "holds files that are not a run's" in _errors(log)[0]
    assert _files(str(folder)) == before


@pytest.mark.parametrize("link", ["ckpt-7_temp", f"x.tmp-{'b' * 32}", "train"])
def test_a_symbolic_link_in_a_run_is_refused_and_nothing_outside_is_touched(
        finished_tiny, tiny_config, tmp_path, run, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    if link == "train":  # (TensorBoard's events would land outside)
        tf.io.gfile.rmtree(os.path.join(tiny_config.model_dir, "train"))
    os.symlink(outside, os.path.join(tiny_config.model_dir, link))
    status, log = run(*SAME, f"--model_dir={tiny_config.model_dir}", "--train_steps=6")
    assert status == 2 and len(_errors(log)) == 1, log[-2000:]
    assert "symbolic link" in _errors(log)[0] and link in _errors(log)[0]
    assert (outside / "precious.txt").read_text() == "keep me"
    assert os.listdir(outside) == ["precious.txt"]


def _sha256s(directory) -> dict[str, str]:
    import hashlib
    return {name: hashlib.sha256(data).hexdigest()
            for name, data in _files(str(directory)).items()}


# Every command that writes under a run directory, and a link at each place it
# writes or deletes: (command, its flags with RUN for the run, the link's place in
# the run, a real folder made first). The guard (data/files.refuse_links) must stop
# each before it writes or deletes anything, outside or inside.
_WRITERS = [
    ("trainer.main", [*SAME, "--train_steps=6"], "eval", None),  # TensorBoard's
    ("trainer.main", [*SAME, "--train_steps=6"], "train/plugins", None),  # (deeper)
    ("trainer.main", [*SAME, "--train_steps=6"], ".worker_tmp/worker_1", ".worker_tmp"),
    ("trainer.evaluate", [], "evaluator", None),  # the case
    ("trainer.evaluate", [], "evaluator/eval", "evaluator"),
    ("trainer.evaluate", ["--output_dir=RUN/mine/evaluator"], "mine", None),
    ("trainer.serving.predict", ["--index=0"], "predictions", None),
    ("trainer.serving.predict", ["--index=0", "--output_dir=RUN/out"], "out", None),
    ("trainer.serving.export", ["--export_dir=RUN/exports/model"], "exports", None),
    ("trainer.tools.lr_find", [*SAME, "--output_dir=RUN/lr"], "lr/train", "lr"),
    ("trainer.tools.compare_runs", ["--runs=RUN", "--plot=RUN/plots/a.png"], "plots",
     None),
]


@pytest.mark.parametrize("module,flags,link,folder", _WRITERS,
                         ids=[f"{w[0].rsplit('.', 1)[-1]}:{w[2]}" for w in _WRITERS])
def test_no_command_writes_or_deletes_through_a_link_in_a_run(
        finished_tiny, tiny_config, tmp_path, command, module, flags, link, folder):
    """Issue 43: trainer.evaluate overwrote evaluations.json and deleted a stale
    writer.lock in the folder its RUN/evaluator link pointed to. Each writer: exit
    2, one line naming the link, nothing outside or in the run changed."""
    run_dir = tiny_config.model_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "evaluations.json").write_text('{"evaluations": ["mine"]}')
    (outside / "writer.lock").write_text(json.dumps(  # stale: a takeover deletes it
        {"pid": 999999999, "host": "localhost", "since": 0, "command": "x"}))
    for place in (link, folder):
        if place and os.path.isdir(os.path.join(run_dir, place)):
            tf.io.gfile.rmtree(os.path.join(run_dir, place))
    if folder:
        os.makedirs(os.path.join(run_dir, folder), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.join(run_dir, link)), exist_ok=True)
    os.symlink(outside, os.path.join(run_dir, link))
    outside_before, run_before = _sha256s(outside), _sha256s(run_dir)
    if module != "trainer.tools.compare_runs":
        flags = [*flags, "--model_dir=RUN"]
    args = [f.replace("RUN", run_dir) for f in flags]
    if module == "trainer.serving.export":  # (its required flags would stay defined
        import subprocess, sys  # noqa: E401  in this process's FLAGS for later tests)
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                              text=True, timeout=300)
        status, out, log = done.returncode, done.stdout, done.stderr
    else:
        status, out, log = command(module, *args)
    errors = _errors(log)
    assert status == 2 and len(errors) == 1, (out + log)[-2000:]
    assert "symbolic link" in errors[0] and link in errors[0] and len(errors[0]) < 600
    assert "nothing was touched" in errors[0]
    assert _sha256s(outside) == outside_before and _sha256s(run_dir) == run_before
    assert sorted(os.listdir(outside)) == ["evaluations.json", "precious.txt",
                                           "writer.lock"]


def test_the_folder_a_user_names_may_itself_be_a_link(tmp_path):
    """--model_dir=runs/x where runs/x links to a bigger disk is the user's own
    choice: what is inside it is checked, not where it lives; a path beyond a link
    in the run is refused, and what cannot hold links (ram://, gs://) passes."""
    from data import files
    disk = tmp_path / "disk"
    (disk / "train").mkdir(parents=True)
    os.symlink(disk, tmp_path / "run")
    assert files.links_on(str(tmp_path / "run")) == []
    assert files.links_on(str(tmp_path / "run" / "evaluator"), [str(tmp_path / "run")]) == []
    os.symlink(tmp_path, disk / "train" / "up")
    assert files.links_on(str(tmp_path / "run")) == [str(tmp_path / "run/train/up")]
    assert files.links_on(str(tmp_path / "run/train/up/x/y"), [str(tmp_path / "run")]
                          ) == [str(tmp_path / "run/train/up")]
    with pytest.raises(files.LinkError, match=r"--output_dir=.*run/train/up/x.*"
                       r"run/train/up -> .*; .*or give another --output_dir"):
        files.refuse_links(str(tmp_path / "run/train/up/x"), [str(tmp_path / "run")],
                           "--output_dir")
    assert files.links_on("ram://run/evaluator", ["ram://run"]) == []


def test_more_bad_input_is_one_line_not_a_traceback(tmp_path, run):
    """A --weights file that is not HDF5; weights the tiny xception would ignore;
    a directory given to predict as an image."""
    from trainer.serving import inference
    not_hdf5 = tmp_path / "x.weights.h5"
    not_hdf5.write_text("not HDF5")
    backbone = tmp_path / "notop.h5"
    backbone.write_text("a backbone file")
    for flags, message in [((f"--weights={not_hdf5}",), "does not fit"),
                           (("--model=xception", f"--weights={backbone}"),
                            "the tiny xception has no backbone")]:
        status, log = run(*SAME, f"--model_dir={tmp_path / message[:8]}", *flags)
        errors = _errors(log)
        assert status == 2 and len(errors) == 1 and message in errors[0], log[-2000:]
        assert "Traceback" not in log
    with pytest.raises(inference.InferenceError, match="it is a directory"):
        inference.decode_file(str(tmp_path))


def test_a_full_disk_for_tensorboard_is_a_write_error_not_a_traceback(tmp_path):
    from data import files
    from trainer.output import summaries
    (tmp_path / "train").write_text("a file where the summaries' folder goes")
    with pytest.raises(files.WriteError, match=r"could not write the TensorBoard "
                       r"summaries in .*; choose a --model_dir you can write to"):
        summaries.Writer(str(tmp_path))


@pytest.mark.parametrize("key, value, message", [
    ("eval_batch_size", -5, "eval_batch_size must be >= 0, got -5"),
    ("image_size", 100000, "image_size=100000 is beyond 4096 pixels a side"),
    ("batch_size", "abc", "a value of the wrong type"),
    ("model_options", "x" * 10_000_000, r"model_options: 'x{80}'\.\.\. \(10,000,000 "
     r"characters\) is not an option of cifar_cnn"),
    ("label_smoothing", 5.0, r"label_smoothing is set twice, 5.0 at the top and 0.0 in "
     r"task_settings"),  # (beside task_settings' 0.0, below: an edit of one of them)
    ("task_settings", {"label_smoothing": 5.0}, r"label_smoothing must be in \[0, 1\)")])
def test_a_run_config_no_run_can_have_is_one_line_for_the_commands_on_the_run(
        finished_tiny, tiny_config, key, value, message):
    """predict, evaluate and export read the run's settings with build.config_of_run."""
    from trainer import build
    path = os.path.join(tiny_config.model_dir, checkpoints.RUN_CONFIG)
    with open(path) as f:
        settings = json.load(f)
    if key == "label_smoothing":
        settings["task_settings"] = {**settings.get("task_settings", {}),
                                     "label_smoothing": 0.0}
    with open(path, "w") as f:
        json.dump({**settings, key: value}, f)
    with pytest.raises(checkpoints.CheckpointError, match=(
            f"run_config.json holds a setting no run can have: {message}")) as raised:
        build.config_of_run(tiny_config.model_dir)
    assert len(str(raised.value)) < 300 + len(path)  # (issue 43: it was 10,000,069)


def test_a_teacher_or_classifier_run_config_is_checked_as_flags_are(tmp_path, tiny_config):
    """Issue 43: a --teacher_dir whose run_config.json has a negative batch size, or
    a 10 MB model_options, was accepted (or echoed whole); read back through
    build.config_of_run like the run's own: one line naming the file."""
    from test_check_step import _teacher_run
    from trainer import build
    from trainer.config import ConfigError
    from data import sources
    teacher = _teacher_run(tmp_path / "teacher")
    config = tiny_config.replace(task="distill").with_settings(teacher_dir=teacher)
    spec = sources.get_spec("synthetic")
    builder = build.StateBuilder(config, spec, None, tf.distribute.get_strategy(),
                                 "float32", build.SERVE, build.make_task(config, spec))
    path = os.path.join(teacher, checkpoints.RUN_CONFIG)
    settings = json.loads(open(path).read())
    for key, value, message in [("batch_size", -4, "batch_size must be > 0"),
                                ("learning_rate", -1.0, "learning_rate must be > 0"),
                                ("model_options", "x" * 10_000_000, "10,000,000 char")]:
        with open(path, "w") as f:
            json.dump({**settings, key: value}, f)
        with pytest.raises((checkpoints.CheckpointError, ConfigError)) as raised:
            builder.finished_classifier(teacher, "--teacher_dir", "final")
        assert message in str(raised.value) and path in str(raised.value)
        assert len(str(raised.value)) < 300 + len(path)
    with open(path, "w") as f:  # a teacher resumed and stopped: its final file is old
        json.dump(settings, f)
    files_json = {"status": "stopped", "steps": 600}
    with open(os.path.join(teacher, "metrics.json"), "w") as f:
        json.dump(files_json, f)
    with pytest.raises(ConfigError, match="the run has not finished: its metrics.json "
                       "says 'stopped' at step 600"):
        builder.finished_classifier(teacher, "--teacher_dir", "final")


@pytest.mark.long(8)  # seconds, with -n 2
def test_tfrecord_classes_out_of_range_are_one_line_naming_the_record(tmp_path, run):
    from conftest import small_tfrecord_dataset
    from data import tfrecords
    shard = small_tfrecord_dataset(tmp_path)  # classes a, b: ids 0 and 1
    records = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(shard)]
    bad = tf.train.Example.FromString(records[5])
    bad.features.feature["class"].int64_list.value[:] = [57]
    records[5] = bad.SerializeToString()
    with tf.io.TFRecordWriter(shard) as writer:
        for record in records:
            writer.write(record)
    pattern = os.path.join(os.path.dirname(shard), "x*.tfrec")
    assert "record 5: class 57 is not one of the dataset's 2 classes" in (
        tfrecords.find_corrupt(pattern, 2))
    status, log = run("--model_size=tiny", f"--dataset=tfrecord:{pattern}",
                      "--batch_size=4", "--train_steps=3", "--steps_per_loop=3",
                      "--precision=float32", f"--model_dir={tmp_path / 'run'}")
    assert status == 2 and "Traceback" not in log, log[-2000:]
    assert "class 57 is not one of the dataset's 2 classes" in _errors(log)[0]


def test_a_tfds_folder_without_its_dataset_info_is_one_line(tmp_path):
    from data import sources
    (tmp_path / "cifar10" / "3.0.2").mkdir(parents=True)
    with pytest.raises(sources.DatasetError, match=r"not prepared in .*3\.0\.2 \(its "
                       r"dataset_info.json is missing or names no split 'train'\)"):
        sources.load_tfds("cifar10", "train", str(tmp_path))


def test_a_conversion_cut_short_is_refused_and_another_of_the_prefix_replaces_it(
        tmp_path, monkeypatch, capsys):
    from data import files, make_tfrecords, sources, tfrecords
    output = str(tmp_path / "data" / "gen")
    generated = make_tfrecords.Generated(num_examples=12, classes=2)
    make_tfrecords.write("generated", output, 8, 4, None, generated=generated)
    assert len(tfrecords.shards_of(output)) == 4
    make_tfrecords.write("generated", output, 8, 2, None, generated=generated)
    assert [os.path.basename(p) for p in tfrecords.shards_of(output)] == [
        "gen00-6.tfrec", "gen01-6.tfrec"]  # the 4 of the first conversion removed
    assert "removed 4 shard(s) of an earlier conversion" in capsys.readouterr().err
    spec = sources.get_spec(f"tfrecord:{output}*.tfrec")
    assert spec.num_classes == 2
    real = tfrecords.write_shards

    def disk_full_after_one_shard(records, total, prefix, num_shards):
        real(records, total // 3, prefix, 1)
        raise files.WriteError("could not write a shard (No space left on device)")

    monkeypatch.setattr(tfrecords, "write_shards", disk_full_after_one_shard)
    with pytest.raises(files.WriteError):
        make_tfrecords.write("generated", output, 8, 3, None, generated=generated)
    with pytest.raises(sources.DatasetError, match=r"dataset.json: the conversion to "
                       r".*gen did not finish .*; run it again"):
        sources.get_spec(f"tfrecord:{output}*.tfrec")


@pytest.mark.long(8)  # seconds, with -n 2
def test_an_export_killed_part_way_is_cleaned_by_the_next(finished_tiny, tiny_config,
                                                          tmp_path):
    from data import files
    from trainer import locks
    from trainer.serving import export
    export_dir = tmp_path / "exported"
    killed = tmp_path / f"exported.tmp-{'c' * 32}"
    killed.mkdir()
    files.write_json(str(killed / export._WRITER_FILE),  # noqa: SLF001
                     {**locks.writer_record(), "pid": 2 ** 22 + 7, "started": "x"})
    running = tmp_path / f"exported.tmp-{'d' * 32}"  # another export, still writing
    running.mkdir()
    parent = os.getppid()  # (a live process that is not this one)
    files.write_json(str(running / export._WRITER_FILE),  # noqa: SLF001
                     {**locks.writer_record(), "pid": parent,
                      "started": locks.process_start(parent)})
    mine = tmp_path / f"exported-notes.tmp-{'e' * 32}"  # not an export's
    mine.mkdir()
    export.export(tiny_config.model_dir, str(export_dir))
    assert not killed.exists() and running.exists() and mine.exists()
    assert tf.io.gfile.exists(str(export_dir / "saved_model.pb"))
    assert not (export_dir / export._WRITER_FILE).exists()  # noqa: SLF001


def test_a_lock_that_cannot_be_written_is_one_line_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    """(A full disk at start-up: the lock is the run's first file.)"""
    from trainer import locks

    def full_disk_name(path, mode="r"):  # created, then the disk refuses its bytes
        open(path, "w").close()
        raise tf.errors.ResourceExhaustedError(None, None, f"{path}.tmp-x; No space "
                                               f"left on device")

    monkeypatch.setattr(tf.io.gfile, "GFile", full_disk_name)
    with pytest.raises(files.WriteError, match=r"cannot write .*writer.lock "
                       r"\(No space left on device\); free space there or choose"):
        locks.acquire(str(tmp_path / "run"), "trainer.main")
    assert not [n for n in os.listdir(tmp_path / "run") if "tmp-" in n]


def test_a_run_directory_that_cannot_be_written_says_why_and_exits_5(tmp_path, run,
                                                                     monkeypatch):
    """A read-only mount or `chattr +i` (root ignores chmod, so the test stands
    them in): the cause and what to do, in one line, and exit 5 (a file that could
    not be written), not a full disk's advice and the exit of bad settings."""
    from trainer import locks

    def read_only(path, mode="r"):
        raise tf.errors.PermissionDeniedError(None, None, f"{path}; Read-only file system")
    monkeypatch.setattr(tf.io.gfile, "GFile", read_only)
    with pytest.raises(files.WriteError, match=r"cannot write .*writer.lock \(Read-only "
                       r"file system\); choose a directory you can write to"):
        locks.acquire(str(tmp_path / "run"), "trainer.main")
    monkeypatch.undo()
    (tmp_path / "a_file").write_text("in the way of the run directory")
    status, log = run(*TINY, f"--model_dir={tmp_path / 'a_file' / 'run'}")
    errors = _errors(log)
    assert status == 5 and len(errors) == 1, log[-2000:]
    assert "cannot create" in errors[0] and "choose a directory you can write" in errors[0]
