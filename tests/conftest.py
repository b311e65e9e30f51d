"""Shared fixtures. Two logical CPU devices are made once, before TensorFlow starts,
so MirroredStrategy can run 2 replicas on any machine."""
import gc
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer.config import Config  # noqa: E402

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration()] * 2)
CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]

# Grappler's graph rewrites (remapper, constant folding, layout, ...) preserve what a
# graph computes and cost ~2 s of every tiny in-process run's 7.5 (a third of the
# suite's CPU). In-process tests check what our code computes, so they skip them;
# every test that starts `trainer.main` or another command as a process (the kill,
# multi-worker, CLI and benchmark tests) runs with TensorFlow's defaults, as users do.
_NO_GRAPPLER = {"disable_meta_optimizer": True}
tf.config.optimizer.set_experimental_options(_NO_GRAPPLER)

# Python's garbage collector in a test worker: the imports' objects (TensorFlow,
# Keras) are set aside for good instead of scanned by every full collection, and a
# collection waits for 50,000 new objects instead of 700 (tracing makes millions).
# test_check_step + test_research: 158.8 s -> 151.1 s of user CPU.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 20)


@pytest.fixture(autouse=True)
def _figures_left_blank(request, monkeypatch):
    """Matplotlib's drawing is a tenth of a tiny run's CPU (summary.png and each
    evaluation's TensorBoard pictures: 0.6 s of 6.5), and a hundred runs here check
    what the run computes and writes, not what its pictures show. They get blank
    PNGs of each figure's size; the figures are still made (their data and
    layout), only not drawn. Tests of what a picture shows are marked
    `@pytest.mark.figures` (tests/test_outputs.py), and every test that starts a
    command as a process draws as users see it."""
    if request.node.get_closest_marker("figures"):
        return
    from trainer.output import figures
    monkeypatch.setattr(figures, "png_bytes", _blank_png)


def _blank_png(fig, dpi: int = 100) -> bytes:
    import io
    from PIL import Image
    width, height = (int(round(v * dpi)) for v in fig.get_size_inches())
    buffer = io.BytesIO()
    Image.new("RGBA", (width, height), "white").save(buffer, format="png")
    return buffer.getvalue()


@pytest.fixture
def grappler():
    """TensorFlow's default graph rewrites for one test: a test that compares
    weights bit for bit with a hash recorded by a normal run (the rewrites keep what
    a graph computes, not its rounding)."""
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
    yield
    tf.config.optimizer.set_experimental_options(_NO_GRAPPLER)


def pytest_collection_modifyitems(items):
    """The long tests first, longest first (`@pytest.mark.long(seconds)`): with
    the workers taking one test at a time (-n 3 --dist load --maxschedchunk=1) the
    short ones then fill the gaps, and the workers finish together."""
    def seconds(item) -> float:
        mark = item.get_closest_marker("long")
        return mark.args[0] if mark and mark.args else 0
    items.sort(key=lambda item: -seconds(item))


@pytest.fixture(autouse=True)
def _float32_policy():
    """Runs that set a mixed-precision policy, or --deterministic (op determinism,
    process-wide: XLA then refuses some gradients), must not leak it into other
    tests."""
    yield
    keras.mixed_precision.set_global_policy("float32")
    from tensorflow.python.framework import config as tf_config
    tf_config.disable_op_determinism()


@pytest.fixture(autouse=True)
def _no_example_tasks_left():
    """The docs' example tasks (example_task) are registered for the test that
    imports them only: the registry other tests see is trainer/tasks/'s."""
    yield
    from trainer.tasks import base
    for name, cls in list(base._TASKS.items()):
        if cls.__module__.startswith("docs_examples_"):
            del base._TASKS[name]


@pytest.fixture(params=["one_device", "mirrored"])
def strategy(request) -> tf.distribute.Strategy:
    if request.param == "one_device":
        return tf.distribute.OneDeviceStrategy(CPUS[0])
    return mirrored()


def mirrored() -> tf.distribute.MirroredStrategy:
    """The process-wide 2-CPU MirroredStrategy the trainer itself uses."""
    from trainer import strategy as strategy_lib
    return strategy_lib.mirrored(tuple(CPUS[:2]))


def _tiny(model_dir: str) -> Config:
    return Config(model="cifar_cnn", model_size="tiny", dataset="synthetic",
                  model_dir=model_dir, batch_size=16, eval_batch_size=256,
                  train_steps=4, steps_per_loop=2, log_every=2, eval_every=4,
                  checkpoint_every=2, precision="float32", shuffle_buffer=64)


@pytest.fixture
def tiny_config(tmp_path) -> Config:
    """A few steps of the tiny convnet on generated data: seconds, no files.
    (Evaluation at batch 256: 8 batches of the 2,000 test images, not 125.)"""
    return _tiny(str(tmp_path / "run"))


@pytest.fixture(scope="session")
def _finished_tiny(tmp_path_factory) -> tuple[str, dict]:
    from trainer import loop
    model_dir = str(tmp_path_factory.mktemp("finished_tiny") / "run")
    return model_dir, loop.train_and_evaluate(_tiny(model_dir))


@pytest.fixture
def finished_tiny(_finished_tiny, tiny_config) -> dict:
    """tiny_config's run, finished (checkpoints at steps 2 and 4), copied into
    tiny_config.model_dir: trained once per test worker. Its final metrics."""
    import shutil
    shutil.copytree(_finished_tiny[0], tiny_config.model_dir)
    return dict(_finished_tiny[1])


def small_tfrecord_dataset(root, class_names=("a", "b"), per_class: int = 6,
                           shape=(20, 20, 3)) -> str:
    """PNG photos in class folders under root/photos, written as one TFRecord shard
    root/rec/x00-N.tfrec (16x16) with its dataset.json; returns the shard's path."""
    import json
    import numpy as np
    from data import make_tfrecords, tfrecords
    rng = np.random.default_rng(0)
    for name in class_names:
        (root / "photos" / name).mkdir(parents=True)
        for i in range(per_class):
            tf.io.write_file(str(root / "photos" / name / f"{i}.png"),
                             tf.io.encode_png(rng.integers(0, 255, shape, np.uint8)))
    records, total, _ = make_tfrecords.records_from_folder(str(root / "photos"), 16)
    path = tfrecords.write_shards(records, total, str(root / "rec" / "x"), 1)[0]
    (root / "rec" / "dataset.json").write_text(json.dumps(
        {"class_names": list(class_names), "image_size": 16, "holdout_fraction": 0.25}))
    return path


def step_loop(strategy, model, optimizer, task, options, jit_compile: bool = False):
    """The train loop of trainer/step.py's default step on (model, optimizer), as a
    one-model TrainState made under `strategy`'s scope: (loop, state); the loop
    advances state.step like the run's."""
    from trainer import distributed, state as state_lib, step
    with strategy.scope():
        state = state_lib.single(model, optimizer)

    def replica_step(batch):  # a def, not a lambda: AutoGraph converts what it calls
        return step.train_step(state, task, batch, options)

    loop = distributed.make_train_loop(strategy, replica_step, jit_compile, state=state)
    return loop, state


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docs", "examples")


def example_task(name: str):
    """Imports docs/examples/<name>.py (a task file of the docs' worked examples,
    registered as a task once per process, as if it were in trainer/tasks/)."""
    import importlib.util
    import sys
    module_name = f"docs_examples_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            module_name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    from trainer.tasks import base
    module = sys.modules[module_name]
    for value in vars(module).values():  # registered again after an earlier test
        if (isinstance(value, type) and issubclass(value, base.Task)
                and value.__module__ == module_name and value.name not in base._TASKS):
            base.register(value)
    return module


def classification(**settings):
    """The classification task with `settings` (on the synthetic dataset's spec),
    for steps called by hand."""
    from data import sources
    from trainer import tasks
    spec = sources.get_spec("synthetic")
    return tasks.get("classification")(tasks.make_settings("classification", settings),
                                       spec, spec.image_shape)


@pytest.fixture
def command(capsys, caplog):
    """A command in this process, as its command line runs it (cli.parse_flags, the
    parser every command shares, then the command's main):
    command("trainer.tools.benchmark", *flags) -> (exit status, stdout, stderr and
    the log). The process's start-up (TensorFlow's import, its first traces) is paid
    once per test worker instead of once per test."""
    def command(module_name: str, *args: str) -> tuple[int, str, str]:
        import importlib
        from absl.testing import flagsaver
        from trainer import cli
        module = importlib.import_module(module_name)
        module.define_flags()
        status = 0
        caplog.clear()
        capsys.readouterr()
        with flagsaver.flagsaver(), caplog.at_level(logging.INFO, logger="absl"):
            try:
                module.main(cli.parse_flags([module_name, *args, "--verbosity=0"]))
            except SystemExit as exit_:
                status = exit_.code or 0
        log = "\n".join(record.getMessage() for record in caplog.records)
        out, err = capsys.readouterr()
        return status, out, log + "\n" + err
    return command


@pytest.fixture
def run(command):
    """trainer.main in this process (`command`): run(*flags) -> (exit status, stderr
    and the log)."""
    def run(*args) -> tuple[int, str]:
        status, _, log = command("trainer.main", *args)
        return status, log
    return run


@pytest.fixture(scope="session")
def generated_records(tmp_path_factory) -> str:
    """A streamable dataset: 2,048 generated 32x32 JPEGs (10 classes) in 8 TFRecord
    files and 256 validation ones in 2 (python -m trainer.tools.make_tfrecords
    --source=generated); returns its --dataset name."""
    from data import make_tfrecords
    root = tmp_path_factory.mktemp("generated")
    for split, count, shards, seed in (("train", 2048, 8, 0), ("validation", 256, 2, 1)):
        make_tfrecords.write("generated", str(root / split / "gen"), 32, shards, None,
                             generated=make_tfrecords.Generated(num_examples=count,
                                                                classes=10, seed=seed))
    return f"tfrecord:{root}/train/gen*.tfrec;eval={root}/validation/gen*.tfrec"


def stopped_then_resumed(config, monkeypatch, at_step: int) -> dict:
    """trainer.loop's run of `config` stopped (a KeyboardInterrupt) when the loop
    returns to Python at `at_step`, then run again: the resumed run's metrics."""
    from trainer import loop
    from trainer.output import progress
    original_show = progress.Progress.show

    def stopped(self, step, learning_rate):
        if step == at_step:
            raise KeyboardInterrupt
        original_show(self, step, learning_rate)

    monkeypatch.setattr(progress.Progress, "show", stopped)
    with pytest.raises(KeyboardInterrupt):
        loop.train_and_evaluate(config)
    monkeypatch.setattr(progress.Progress, "show", original_show)
    return loop.train_and_evaluate(config)


def plain_and_compiled_states(config, batch: dict, steps: int = 2) -> list[list]:
    """The run of `config` (build.build_run, one CPU device) trained `steps` times on
    `batch` with the plain step, then with jit_compile=True, from the same seed:
    [[(name, value) of the state's compared variables], ...] for the two."""
    from data import sources
    from trainer import build, distributed
    spec = sources.get_spec(config.dataset)
    plan = build.plan(config, spec, 1)
    strategy = tf.distribute.OneDeviceStrategy(CPUS[0])
    states = []
    for jit in (False, True):
        tf.keras.utils.set_random_seed(0)
        run = build.build_run(config, spec, plan, strategy)
        train_loop = distributed.make_train_loop(strategy, run.train_steps, jit,
                                                 state=run.state)
        dataset = tf.data.Dataset.from_tensors(batch).repeat()
        train_loop(iter(strategy.experimental_distribute_dataset(dataset)),
                   tf.constant(steps), tf.constant(0.0))
        states.append([(name, v.numpy()) for name, v in run.state.compared_variables()])
    return states
