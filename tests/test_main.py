"""trainer.main end to end: the command line, bad input, real and mocked TFDS data."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import small_tfrecord_dataset
from data import augment, pipeline, sources
import models
from trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (Evaluation at batch 256: 8 batches of the 2,000 generated test images, not 125.)
TINY = ["--model_size=tiny", "--dataset=synthetic", "--batch_size=16", "--train_steps=4",
        "--steps_per_loop=2", "--log_every=2", "--precision=float32",
        "--eval_batch_size=256"]
REQUIRED_FLAGS = ("clip_grad_norm", "grad_accum_steps", "aux_loss_weight", "mixup_alpha",
                  "cutmix_alpha", "model", "dataset", "data_dir", "model_dir",
                  "batch_size", "epochs", "train_steps", "optimizer", "learning_rate",
                  "lr_schedule", "warmup_epochs", "weight_decay", "tpu", "strategy",
                  "cpu_replicas", "jit_compile", "precision", "steps_per_loop",
                  "log_every", "eval_every", "checkpoint_every", "seed", "task",
                  "sam_rho", "optimizer_options", "teacher_dir", "distill_alpha",
                  "reconstruction_loss")


def _main(*args, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.long(17)  # seconds, with -n 2
def test_cli_trains_and_writes_weights_and_metrics_with_a_quiet_log(tmp_path):
    result = _main(*TINY, "--checkpoint_every=2", f"--model_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Sharding callback" not in result.stderr  # TF's INFO at every checkpoint
    for text in ("Strategy: OneDeviceStrategy", "per replica", "precision float32",
                 "XLA off", "step 4/4", "ETA", "eval at step 4", "test accuracy"):
        assert text in result.stderr
    # Not a terminal: plain lines only, no bar, no control characters, no TF record
    # printed twice (by TF's own handler and absl's).
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    assert "INFO:tensorflow:" not in result.stderr
    # The run's log.txt: every line it printed, in absl's full format (file:line).
    kept = (tmp_path / "log.txt").read_text().splitlines()
    printed = [line for line in result.stderr.splitlines() if line.strip()]
    assert printed and set(printed) <= set(kept), (printed, kept)
    assert any(re.match(r"I\d{4} [\d:.]+ +\d+ progress\.py:\d+\] Strategy: ", line)
               for line in kept), kept
    assert (tmp_path / "summary.png").exists() and (tmp_path / "eval").is_dir()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("test_accuracy", "test_examples", "train_seconds", "images_per_second",
                "steps", "epochs", "model", "dataset", "strategy", "replicas",
                "precision", "jit_compile"):
        assert key in metrics
    assert metrics["test_examples"] == 2000 and metrics["steps"] == 4
    assert (tmp_path / "model.weights.h5").exists()


@pytest.mark.parametrize("flag,message", [
    ("--model=resnet9", "unknown model 'resnet9'; valid: airbench, airbench_small, cifar_cnn"),
    ("--dataset=no_such_set", "unknown dataset 'no_such_set': not one of cifar10, "
     "synthetic, tf_flowers"),
    ("--cpu_replicas=3", "--batch_size=16 does not divide by the 3 replicas"),
    ("--grad_accum_steps=3", "does not divide into --grad_accum_steps=3 micro-batches"),
    ("--model=xception --model_size=full --image_size=32", "at least 71x71"),
    ("--dataset=tfrecord:/nonexistent/x*.tfrec", "no dataset.json beside "
     "'/nonexistent/x*.tfrec'"),
    ("--flagfile /nonexistent/flags.txt", "error: --flagfile=/nonexistent/flags.txt: "
     "cannot read it (No such file or directory); give the path of a file of flags"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, run, flag, message):
    """One case per place a bad value is caught (flag checks, dataset table, batch
    split at start-up, model build, TFRecord description); the other flag checks
    are the in-process test below. (trainer.main's parser and main in this
    process: a traceback would fail the test; test_cli_trains_... runs the
    command itself.)"""
    model_dir = tmp_path / "run"  # (a folder of other files: tests/test_run_dir.py)
    if flag.startswith("--cpu_replicas"):  # devices are made once per process
        result = _main(*TINY, f"--model_dir={model_dir}", *flag.split())
        status, err = result.returncode, result.stderr
        assert "Traceback" not in err
    else:
        status, err = run(*TINY, f"--model_dir={model_dir}", *flag.split())
    assert status == 2, err[-2000:]
    assert message in err
    assert err.strip().splitlines()[-1].startswith("error: ")
    assert not model_dir.exists() or sorted(os.listdir(model_dir)) in (
        [], ["run_config.json"], ["run_config.json", "run_history.json"])


@pytest.mark.long(17)  # seconds, with -n 2
def test_tpu_local_falls_back_with_a_warning_unless_required(tmp_path, run):
    # (with --verbosity=1: the library lines come back; the default's quiet log is
    # test_cli_trains_and_writes_weights_and_metrics_with_a_quiet_log's)
    result = _main(*TINY, "--train_steps=2", "--checkpoint_every=2", "--verbosity=1",
                   "--tpu=local", f"--model_dir={tmp_path}/a")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "NO TPU FOUND" in result.stderr
    assert "Sharding callback" in result.stderr
    status, log = run(*TINY, "--tpu=local", "--require_tpu", f"--model_dir={tmp_path}/b")
    assert status == 2 and "no TPU found at --tpu=local" in log, log[-2000:]


@pytest.mark.parametrize("change,message", [
    ({"optimizer": "adamx"}, "unknown optimizer 'adamx'; valid: adadelta, adafactor"),
    ({"optimizer_options": "beta_3=1"}, "'beta_3=1' is not an option of adam; valid: "
     "beta_1=VALUE"),
    ({"task": "segmentation"}, "unknown task 'segmentation'; valid: autoencoder, "
     "classification, distill, fixmatch, gan, simclr, wgan_gp"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"lr_schedule": "onecycle"}, "unknown lr_schedule 'onecycle'"),
    ({"strategy": "ps"}, "unknown strategy 'ps'"),
    ({"clip_grad_norm": -1.0}, "--clip_grad_norm must be >= 0"),
    ({"on_nan": "retry"}, "unknown on_nan 'retry'; valid: skip_step, stop"),
    ({"augment": "mixup"}, "unknown augment 'mixup'; valid: crop_flip_saturation"),
    # (issue 44: accepted, then trained at learning rate 1 throughout)
    ({"min_learning_rate": 1.0, "learning_rate": 0.001, "lr_schedule": "cosine"},
     "--min_learning_rate=1.0 is above --learning_rate=0.001"),
    ({"model_options": "x" * 10_000}, "--model_options: 'xxxxxxxx"),
])
def test_bad_flag_values_are_named_with_the_valid_ones(tiny_config, change, message):
    from trainer.config import ConfigError
    from trainer.run_settings import validate
    with pytest.raises(ConfigError) as raised:
        validate(tiny_config.replace(**change), models.names(), sources.names())
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_helpfull_documents_every_flag_with_its_default():
    result = _main("--helpfull")  # (absl's own exits 1 after printing it)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in REQUIRED_FLAGS:
        assert f"--{name}" in result.stdout
    assert "(default: '1024')" in result.stdout


def _eval_accuracy(model, spec, data_dir=None):
    ds, n = sources.load(spec, spec.eval_split, data_dir)
    ds = pipeline.make_eval(ds, n, tf.distribute.InputContext(), 100,
                            augment.make_normalize(spec.mean, spec.std))
    correct = count = 0.0
    for batch in ds:
        hits = np.argmax(model(batch["image"], training=False), -1) == batch["label"].numpy()
        correct += float(np.sum(hits * batch["mask"].numpy()))
        count += float(np.sum(batch["mask"].numpy()))
    return correct / count


@pytest.mark.long(10)  # seconds, with -n 2
def test_saved_weights_rebuild_the_trained_model_on_cpu(tiny_config):
    metrics = loop.train_and_evaluate(tiny_config.replace(train_steps=40, eval_every=40))
    spec = sources.get_spec("synthetic")
    fresh = models.build("cifar_cnn", spec.num_classes, spec.image_shape, tiny=True)
    fresh.load_weights(os.path.join(tiny_config.model_dir, "model.weights.h5"))
    assert _eval_accuracy(fresh, spec) == pytest.approx(metrics["test_accuracy"], abs=1e-6)


@pytest.mark.long(13)  # seconds, with -n 2
def test_two_cpu_replicas_train_end_to_end(tiny_config):
    metrics = loop.train_and_evaluate(tiny_config.replace(cpu_replicas=2))
    assert metrics["replicas"] == 2 and metrics["strategy"] == "MirroredStrategy"
    assert metrics["test_examples"] == 2000 and metrics["per_replica_batch_size"] == 8


def _main_in_process(*args) -> dict:
    """trainer.main's own flag parsing and main(), in this process; returns metrics."""
    from absl.testing import flagsaver
    from trainer import main as main_lib
    main_lib.define_flags()
    with flagsaver.flagsaver():
        main_lib.FLAGS(["trainer.main", *args])
        main_lib.main(["trainer.main"])
        model_dir = main_lib.FLAGS.model_dir
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)


@pytest.mark.long(8)  # seconds, with -n 2
def test_main_on_cifar10_under_tfds_mock_data(tmp_path):
    import tensorflow_datasets as tfds
    with tfds.testing.mock_data(num_examples=50, policy=tfds.testing.MockPolicy.USE_CODE):
        metrics = _main_in_process(*TINY, "--dataset=cifar10", f"--model_dir={tmp_path}")
    assert metrics["dataset"] == "cifar10" and metrics["steps"] == 4
    assert metrics["test_examples"] == 50


@pytest.mark.long(21)  # seconds, with -n 2
def test_main_on_real_cifar10_from_tfds_data_dir(tmp_path):
    data_dir = os.environ.get("TFDS_DATA_DIR")
    if not data_dir or not os.path.isdir(os.path.join(data_dir, "cifar10")):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must have real CIFAR-10 in TFDS_DATA_DIR={data_dir!r}")
        pytest.skip("real CIFAR-10 not in TFDS_DATA_DIR")
    metrics = _main_in_process(*TINY, "--dataset=cifar10", "--batch_size=64",
                               "--shuffle_buffer=256", "--train_steps=2",
                               f"--model_dir={tmp_path}")
    assert metrics["test_examples"] == 10_000  # every test image, exactly once
    assert 0.0 <= metrics["test_accuracy"] <= 1.0


def test_recipe_defaults_yield_to_explicit_flags():
    from absl.testing import flagsaver
    from trainer import main as main_lib, run_flags
    main_lib.define_flags()
    with flagsaver.flagsaver():
        main_lib.FLAGS(["trainer.main", "--model=squeezenet", "--epochs=3",
                        "--batch_size=32"])
        config = run_flags.config_from_flags(main_lib.FLAGS)
    assert config.dataset == "tf_flowers" and config.image_size == 192  # recipe
    assert config.epochs == 3 and config.batch_size == 32  # flags win
    # (a run of its own: the batch changes what is trained, the epochs do not)
    assert config.model_dir == os.path.join("runs", "squeezenet_tf_flowers_batch_size=32")
    with flagsaver.flagsaver():
        main_lib.FLAGS(["trainer.main", "--model=xception"])
        config = run_flags.config_from_flags(main_lib.FLAGS)
    assert (config.lr_schedule, config.epochs, config.warmup_epochs) == ("rampup", 12, 5.0)


def test_corrupt_tfrecord_stops_the_run_naming_the_file(tmp_path, run):
    path = small_tfrecord_dataset(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[40:60] = b"\xff" * 20
    open(path, "wb").write(bytes(data))
    status, log = run("--model=convnet", "--model_size=tiny", f"--dataset=tfrecord:{path}",
                      "--batch_size=4", "--train_steps=2", f"--model_dir={tmp_path}/run")
    assert status == 2, log[-1500:]
    assert f"corrupt or truncated TFRecord file {path}" in log


@pytest.mark.long(12)  # seconds, with -n 2
def test_trains_on_the_codelab_tfrecords_as_they_are(tmp_path, run):
    """Shards in the flowers codelab's layout: no dataset.json, no index feature."""
    from test_tfrecords import CODELAB_CLASSES, _codelab_files
    _codelab_files(str(tmp_path / "flowers"), [6, 6, 6, 6])
    status, log = run(*TINY, f"--dataset=tfrecord:{tmp_path}/flowers*.tfrec",
                      "--batch_size=4", "--train_steps=2", "--image_size=32",
                      f"--model_dir={tmp_path}/run")
    assert status == 0, log[-2000:]
    assert "Evaluation split: the last 15% of the files" in log
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_examples"] == 6  # the last file, whole
    kept = json.loads((tmp_path / "run" / "dataset.json").read_text())
    assert kept["class_names"] == list(CODELAB_CLASSES)


@pytest.mark.parametrize("asked", ["--help", "-h", "--helpshort"])
def test_help_shows_every_flag_once_under_its_topic_and_exits_0(asked, capsys):
    from absl import flags
    from trainer import cli, run_flags
    flag_values = flags.FlagValues()
    run_flags.define_flags(flag_values)
    cli.define_flag(flag_values, flags.DEFINE_bool, "plot_schedule", False, "A "
                    "command's own flag.")
    flags.DEFINE_integer("check_steps", 3, "A tool's flag defined by absl alone.",
                         flag_values=flag_values, module_name="trainer.check_step")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(["trainer.main", "--model=resnet", asked], flag_values)
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    shown = shown[shown.index("this command:\n") + 14:]  # (after the usage)
    headings = [line for line in shown.splitlines() if line.endswith(":")
                and not line.startswith(" ")]
    assert headings == ["model:", "data:", "task:", "task autoencoder:",
                        "task classification (also distill, fixmatch):", "task distill:",
                        "task fixmatch:", "task gan (also wgan_gp):", "task simclr:",
                        "task wgan_gp:", "optimization:",
                        "the training step:", "devices:", "the loop:",
                        "run directory and outputs:", "measuring:", "your own code:"]
    flag_lines = [line.split("=")[0].split(":")[0].strip() for line in shown.splitlines()
                  if line.startswith("  --")]
    names = [name.replace("--[no]", "--")[2:] for name in flag_lines]
    assert sorted(names) == sorted(set(flag_values))  # every flag, once
    assert names[:2] == ["plot_schedule", "check_steps"]  # the command's own first
    assert len(names) == len(set(names)) and {"batch_size", "teacher_dir",
                                              "import"} <= set(names)
    model = shown.index("\nmodel:\n")
    assert model < shown.index("  --model=cifar_cnn: Model: ") < shown.index("\ndata:\n")


def test_every_setting_has_a_help_topic():
    from trainer import config as config_lib, run_settings, tasks
    for name in [*config_lib.FLAG_FIELDS, *tasks.all_setting_fields()]:
        assert run_settings.help_topic(name) != "other", name
    listed = [name for fields in config_lib.TOPICS.values() for name in fields]
    assert sorted(listed) == sorted(config_lib.FLAG_FIELDS)  # each once, none stale


@pytest.mark.parametrize("installed, says", [
    ({"tensorflow": "2.21.0"}, None),
    ({"tensorflow-tpu": "2.20.0"}, None),
    ({"tensorflow-cpu": "2.20.1"}, None),
    ({}, "TensorFlow is not installed: pip install -e \".[cpu]\""),
    ({"tensorflow": "2.19.1"}, "tensorflow 2.19.1 is installed; this code runs on "
                               "TensorFlow 2.20 or 2.21"),
    ({"tensorflow": "2.21.0", "tensorflow-tpu": "2.20.0"},
     "two TensorFlow builds are installed (tensorflow 2.21.0 and tensorflow-tpu 2.20.0)"
     ", whose files overwrite each other's: uninstall all but tensorflow-tpu"),
])
def test_the_installed_tensorflow_is_checked_in_one_line(monkeypatch, installed, says):
    """What every command checks before TensorFlow loads (trainer/__init__.py):
    none, a version outside 2.20-2.21, or two builds at once (a TPU VM's
    tensorflow-tpu with the CPU wheel over it) is one line and exit 2."""
    from importlib import metadata
    import trainer

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]
    monkeypatch.setattr(metadata, "version", version)
    problem = trainer.tensorflow_problem()
    assert problem == says if says is None else problem.startswith(says), problem


def test_a_command_without_a_supported_tensorflow_stops_in_one_line(tmp_path):
    """The check runs first in the command itself: here TensorFlow's metadata
    says 2.19 (a fake distribution shadowing the real one's on sys.path)."""
    fake = tmp_path / "site" / "tensorflow-2.19.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorflow\n"
                                   "Version: 2.19.1\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}:{ROOT}")
    result = subprocess.run([sys.executable, "-m", "trainer.main", "--help"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    # (2.19 alone, or beside a tensorflow-cpu build: two builds)
    assert len(lines) == 1 and lines[0].startswith("error: ") and (
        "tensorflow 2.19.1" in lines[0]), lines


def test_a_models_or_data_of_the_users_never_stands_in_for_the_projects(tmp_path):
    """The distribution's import names `models` and `data` are common in
    researchers' own folders. Wherever such a module sits, in the working directory
    or on PYTHONPATH before the project, the commands import the project's own
    (trainer/__init__.py); `--import` of such a name, or a script that imported its
    own `models` before trainer, is one line saying what to rename."""
    theirs = 'print("THEIRS WAS IMPORTED")\nLOGITS = None\n'
    places = {"models.py here": tmp_path / "a", "data/ package here": tmp_path / "b",
              "data/ folder of files here": tmp_path / "c",
              "models.py and data/ on PYTHONPATH": tmp_path / "d"}
    for place in places.values():
        place.mkdir()
    (tmp_path / "a" / "models.py").write_text(theirs)
    (tmp_path / "b" / "data").mkdir()
    (tmp_path / "b" / "data" / "__init__.py").write_text(theirs)
    (tmp_path / "c" / "data").mkdir()
    (tmp_path / "c" / "data" / "train.csv").write_text("x,y\n1,2\n")
    path_dir = tmp_path / "on_path"
    (path_dir / "data").mkdir(parents=True)
    (path_dir / "models.py").write_text(theirs)
    (path_dir / "data" / "__init__.py").write_text(theirs)

    def command(args, cwd, pythonpath=None):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        if pythonpath:
            env["PYTHONPATH"] = f"{pythonpath}:{env.get('PYTHONPATH', '')}"
        return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    helps = {name: command(["-m", "trainer.main", "--help"], place,
                           path_dir if "PYTHONPATH" in name else None)
             for name, place in places.items()}
    for name, process in helps.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, (name, err[-2000:])
        assert "Traceback" not in err and "THEIRS" not in out + err, (name, err[-2000:])
        assert "--model_dir" in out, name  # the help itself

    one_line = {"--import=models": command(["-m", "trainer.main", "--import=models",
                                            "--help"], tmp_path / "a"),
                "their models first": command(["-c", "import models; import trainer"],
                                              tmp_path / "a")}
    errors = {name: process.communicate(timeout=300)[1].strip().splitlines()
              for name, process in one_line.items()}
    for name, lines in errors.items():
        assert "another name" in lines[-1] and "my_models" in lines[-1], (name, lines)
    # (the command: one line and the status of bad input; a script: an ImportError)
    assert one_line["--import=models"].returncode == 2, errors
    assert len(errors["--import=models"]) == 1, errors
    assert one_line["their models first"].returncode == 1, errors
    assert errors["their models first"][-1].startswith("ImportError: "), errors
