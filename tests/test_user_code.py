"""A researcher's own code outside the project (trainer/user_code.py): a package in
a directory of its own with a model (a Sequential without an Input, taking [0, 1]
inputs), a task with a step of its own and a callback, trained with --import;
check_step passes on it, and evaluate, predict and export work on the run without
--import given again (the run recorded it). Any Keras model registers with one
call."""
import json
import os
import sys
import textwrap

import keras
import numpy as np
import pytest

import models
from trainer import build, callbacks, user_code
from trainer.tasks import base

PACKAGE = {
    "__init__.py": "",
    "register.py": '''
        """My research: a model, a task and a callback, outside tfloop."""
        import os

        import keras
        import tensorflow as tf

        import models
        from data import files
        from trainer import callbacks, step, tasks
        from trainer.tasks import classification


        def small_net(input_shape, num_classes, width=8):
            # No keras.Input: made functional by register_keras.
            return keras.Sequential([
                keras.layers.Conv2D(width, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(num_classes)])


        models.register_keras("my_small_net", small_net, input_range=models.UNIT)


        @tasks.register
        class ConfidencePenalty(classification.Classification):
            """Cross-entropy minus 0.1 x the prediction's entropy, with a step of
            its own made of trainer/step.py's pieces."""
            name = "my_confidence_penalty"

            def train_step(self, state, batch, options):
                model = state.models["main"]

                def loss_fn(batch):
                    logits = model(batch["image"], training=True)
                    cross_entropy = keras.losses.sparse_categorical_crossentropy(
                        batch["label"], logits, from_logits=True)
                    entropy = -tf.reduce_sum(tf.nn.softmax(logits)
                                             * tf.nn.log_softmax(logits), -1)
                    return (cross_entropy - 0.1 * entropy,
                            self.accuracy(logits, batch["label"]))

                return step.train_step(state, self, batch, options, step.Objective(
                    loss_fn, model.trainable_variables, (model,),
                    state.optimizers["main"]))


        @callbacks.register("my_notes")
        class Notes(callbacks.Callback):
            """A line per evaluation in model_dir/notes.txt."""
            name = "my_notes"

            def on_train_begin(self, context):
                self.context, self.lines = context, []

            def on_eval(self, step, results, state):
                self.lines.append(f"step {step}: {results['test_accuracy']:.4f}")
                if self.context.is_chief:
                    files.write_atomically(
                        os.path.join(self.context.model_dir, "notes.txt"),
                        "\\n".join(self.lines).encode())

            def state_dict(self):
                return {"lines": self.lines}

            def load_state_dict(self, state):
                self.lines = state["lines"]
    ''',
}
MODULE = "my_research.register"


def _forget_the_package() -> None:
    """As in a new process: the module not imported, nothing of it registered."""
    for name in [n for n in sys.modules if n.startswith("my_research")]:
        del sys.modules[name]
    models._REGISTRY.pop("my_small_net", None)
    base._TASKS.pop("my_confidence_penalty", None)
    callbacks._REGISTRY.pop("my_notes", None)


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    root = tmp_path / "elsewhere"
    (root / "my_research").mkdir(parents=True)
    for name, text in PACKAGE.items():
        (root / "my_research" / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    yield root
    _forget_the_package()


@pytest.mark.long(12)  # seconds, with -n 3
def test_a_package_of_ones_own_is_trained_checked_evaluated_predicted_exported(
        user_package, tmp_path, command):
    model_dir = str(tmp_path / "run")
    common = ["--model=my_small_net", "--task=my_confidence_penalty",
              "--dataset=synthetic", "--batch_size=16", "--eval_batch_size=256",
              "--precision=float32"]
    # What `python -m trainer.main --import=...` does before it defines its flags.
    user_code.import_for_command(["trainer.main", f"--import={MODULE}"])
    status, _, log = command("trainer.main", f"--import={MODULE}", "--callbacks=my_notes",
                             f"--model_dir={model_dir}", "--train_steps=4",
                             "--eval_every=2", "--log_every=2", *common)
    assert status == 0, log
    with open(os.path.join(model_dir, "run_config.json")) as f:
        assert json.load(f)["imports"] == MODULE
    with open(os.path.join(model_dir, "notes.txt")) as f:
        assert [line.split(":")[0] for line in f.read().splitlines()] == ["step 2", "step 4"]

    status, out, log = command("trainer.check_step", f"--import={MODULE}",
                               f"--model_dir={tmp_path / 'check'}", *common)
    assert status == 0 and "PASS" in out + log, out + log

    _forget_the_package()  # a later command, in a new process, on the run alone
    status, out, log = command("trainer.evaluate", f"--model_dir={model_dir}")
    assert status == 0 and "accuracy" in out + log, out + log
    _forget_the_package()
    image = tmp_path / "image.png"
    keras.utils.save_img(str(image), np.full((32, 32, 3), 128, np.uint8))
    from trainer.serving import predict
    lines = predict.run(predict.parse([f"--model_dir={model_dir}", str(image)]))
    assert "my_small_net" in lines[0] and len(lines) > 1, lines
    _forget_the_package()
    from trainer.serving import export  # (its command's required flags stay out of
    export.export(model_dir, str(tmp_path / "export"))  # this process's FLAGS)
    assert os.path.isfile(tmp_path / "export" / "saved_model.pb")


def test_an_unknown_module_is_one_error_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as stopped:
        user_code.import_for_command(["trainer.main", "--import=no_such_research"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: --import=no_such_research: no module named 'no_such_research' (is its")


class _Subclassed(keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(num_classes)

    def call(self, images):
        return self.head(self.pool(images))


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed",
                                  "application", "softmax"])
def test_any_keras_model_registers_with_one_call(kind):
    makers = {
        "functional": lambda input_shape, num_classes: keras.Model(
            inputs := keras.Input(input_shape), keras.layers.Dense(num_classes)(
                keras.layers.Flatten()(inputs))),
        "sequential": lambda input_shape, num_classes: keras.Sequential(
            [keras.layers.Flatten(), keras.layers.Dense(num_classes)]),
        "subclassed": lambda input_shape, num_classes: _Subclassed(num_classes),
        "application": lambda input_shape, num_classes, alpha=0.25:
            keras.applications.MobileNetV2(input_shape=input_shape, alpha=alpha,
                                           weights=None, classes=num_classes,
                                           classifier_activation=None),
        "softmax": lambda input_shape, num_classes: keras.applications.MobileNetV2(
            input_shape=input_shape, alpha=0.35, weights=None, classes=num_classes),
    }
    name = f"test_user_{kind}"
    models.register_keras(name, makers[kind], input_range=models.SYMMETRIC)
    try:
        if kind == "softmax":
            with pytest.raises(ValueError, match="ends in a softmax"):
                models.build(name, 10, (32, 32, 3))
            return
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        model = models.build(name, 10, (32, 32, 3),
                             options="alpha=0.35" if kind == "application" else "")
        assert model.output.shape == (None, 10) and model.output.dtype == "float32"
        assert model(np.zeros((2, 32, 32, 3), np.float32)).shape == (2, 10)
        if kind == "subclassed":  # no get_config: check_step cannot copy it, one line
            from trainer import check_step
            from trainer.config import ConfigError
            with pytest.raises(ConfigError, match="give that layer or subclassed model"):
                check_step.checkable(model)
        # The pipeline gives it [-1, 1]: pixel 0 -> -1, 255 -> 1.
        from data import sources
        from trainer.config import Config
        spec = build.model_input_spec(sources.get_spec("synthetic"), name)
        mean, std = np.array(spec.mean) * 255, np.array(spec.std) * 255
        np.testing.assert_allclose((np.array([0.0, 255.0])[:, None] - mean) / std,
                                   [[-1.0] * 3, [1.0] * 3])
        assert Config().model != name
    finally:
        models._REGISTRY.pop(name)


def test_an_installed_packages_entry_point_is_imported_by_every_command(tmp_path,
                                                                        monkeypatch):
    # What `pip install` of a package with a "tfloop.plugins" entry point leaves.
    (tmp_path / "my_plugin.py").write_text("LOADED = True\n")
    info = tmp_path / "my_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tfloop.plugins]\nmy_plugin = my_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "my_plugin" in user_code.import_entry_points()
        assert sys.modules["my_plugin"].LOADED
    finally:
        sys.modules.pop("my_plugin", None)


@pytest.mark.long(15)  # seconds, with -n 3
def test_a_task_file_may_import_any_trainer_module_at_its_top(tmp_path):
    """Issue 44: a task file in trainer/tasks/ that imports trainer.build at its top
    trained, but predict and export on its run died with `ImportError: cannot import
    name 'Config' from partially initialized module 'trainer.config'` (config.py
    imported the tasks package, which imported every task file, which imported
    build, which imported config). Each command's module first, in a process of its
    own, in a copy of the project holding such a file."""
    import shutil
    import subprocess
    from test_main import ROOT
    copy = tmp_path / "project"
    for package in ("trainer", "models", "data"):
        shutil.copytree(os.path.join(ROOT, package), copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "trainer" / "tasks" / "my_task.py").write_text(textwrap.dedent('''
        from trainer import build  # noqa: F401 (what the issue's researcher wrote)
        from trainer.tasks import base, classification


        @base.register
        class MyTask(classification.Classification):
            name = "my_task"
    '''))
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "from trainer import tasks; assert 'my_task' in tasks.names(), tasks.names()")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(copy))
    commands = ["trainer.serving.predict", "trainer.serving.export", "trainer.evaluate",
                "trainer.main", "trainer.check_step"]
    started = [subprocess.Popen([sys.executable, "-c", code, module], cwd=copy, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for module in commands]
    for module, process in zip(commands, started):
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{module}: {err[-1500:]}"


@pytest.mark.long(60)  # seconds, with -n 2
def test_the_testing_kits_example_passes_from_outside_the_repository(tmp_path):
    """docs/examples/testing/ (a MoCo-style task, its tests and the one-line
    conftest.py that takes trainer.testing) copied into a folder of its own and run
    with pytest there, as a researcher's tests are: all pass."""
    import shutil
    import subprocess
    from test_main import ROOT
    folder = tmp_path / "my_tests"
    shutil.copytree(os.path.join(ROOT, "docs", "examples", "testing"), folder,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": ""}  # (only what the installed package gives)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(folder)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout
