"""A run directory is one run (issue 31): a start with other settings is one line
listing each and touches nothing; --resume_with_changes continues on purpose and
is recorded, run_config.json never rewritten; a rerun of a finished run changes
nothing; a sweep's points land in runs of their own; a folder that is not a run,
or a symbolic link in a run, is refused; the run records where it came from."""
import json
import os

import pytest
import tensorflow as tf

from test_main import TINY
from trainer import checkpoints, config as config_lib

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
    assert checkpoints.read_run_config(model_dir)["learning_rate"] == 0.01
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
        return config_lib.resolve(values, explicit)[0].model_dir

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
