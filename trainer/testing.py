"""A kit for unit tests of a task's own step (pytest), for tests kept anywhere.

In the conftest.py of your tests, one line:

    pytest_plugins = ["trainer.testing"]

Loading it splits the host CPU into 2 logical devices before TensorFlow starts
(so MirroredStrategy runs 2 replicas on a laptop) and gives the fixture
`step_config`. Then, in a test (docs/testing.md walks through a whole file):

    from trainer import testing

    def test_my_step(step_config):
        config = step_config(task="moco", queue_size=64)      # tiny, synthetic data
        batches = testing.batches(config, steps=2)            # the task's own batches
        one = testing.train(config, steps=2, replicas=1)      # before, after, metrics
        two = testing.train(config, steps=2, replicas=2)
        verdict = testing.check(config)                       # check_step's verdict
        assert verdict.passed, verdict.report()

Everything is built as training and trainer.check_step build it
(trainer/build.py): what a test sees is what trains. `precision="float64"` (the
default) builds what check_step compares: float64, batch-norm synchronized
across replicas, dropout off, so 1 and 2 replicas agree to float64 rounding;
`precision="run"` builds the run's own precision (mixed_bfloat16 for
`--precision=auto`), what a collective must accept.
"""
import dataclasses
import os
import tempfile
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # (TensorFlow's C++ notes)

from trainer import strategy as strategy_lib  # noqa: E402

DEVICES = strategy_lib.split_cpu(2)  # before anything starts TensorFlow

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import models  # noqa: E402
from data import sources  # noqa: E402
from trainer import build as build_lib, check_step, run_settings  # noqa: E402
from trainer.config import Config  # noqa: E402

# What `config` starts from: the tiny convnet on generated data (seconds, no files).
TINY = dict(model="cifar_cnn", model_size="tiny", dataset="synthetic", batch_size=16,
            eval_batch_size=256, train_steps=4, steps_per_loop=2, log_every=2,
            eval_every=4, checkpoint_every=2, precision="float32", shuffle_buffer=64)


def config(**settings) -> Config:
    """A run's Config from `settings` (any flag's name: the run's and the task's,
    e.g. task="moco", queue_size=64) over TINY, checked as trainer.main checks its
    flags; model_dir defaults to a new temporary folder."""
    settings = {**TINY, **settings}
    settings.setdefault("model_dir", tempfile.mkdtemp(prefix="step_test_"))
    return run_settings.validate(run_settings.from_dict(settings), models.names(),
                                 sources.names())


def strategy(replicas: int = 1) -> tf.distribute.Strategy:
    """One CPU device, or MirroredStrategy over the 2 logical CPU devices."""
    if replicas == 1:
        return tf.distribute.OneDeviceStrategy(DEVICES[0])
    if replicas == 2:
        return strategy_lib.mirrored(tuple(DEVICES))
    raise ValueError(f"the kit runs 1 or 2 replicas, not {replicas}")


def _precision(config_: Config, precision: str) -> str:
    return check_step.run_precision(config_.precision) if precision == "run" else precision


def build(config_: Config, replicas: int = 1, precision: str = "float64"
          ) -> build_lib.Run:
    """The run of `config_` (task, state, step options, steps) built as training
    builds it, on 1 or 2 replicas; float64 as check_step adapts it, else
    `precision` ("run": the run's own)."""
    return _trial(config_, replicas, precision, steps=1).run


def _trial(config_: Config, replicas: int, precision: str, steps: int,
           data: dict | None = None) -> check_step._Trial:  # noqa: SLF001
    spec = build_lib.run_data(config_).spec
    plan = build_lib.plan(config_, spec, num_replicas=2)
    if data is None:
        data = batches(config_, steps)
    policy = keras.mixed_precision.global_policy()
    try:
        return check_step._Trial(strategy(replicas), config_, spec, plan, data, steps,  # noqa: SLF001
                                 precision=_precision(config_, precision))
    finally:
        keras.mixed_precision.set_global_policy(policy)


def batches(config_: Config, steps: int = 1) -> dict:
    """The first `steps` GLOBAL batches of the run's training input (the task's
    own: views, streams), stacked: one dict (of dicts, with streams) of
    [steps x batch, ...] tensors, floats in float64."""
    spec = build_lib.run_data(config_).spec
    return check_step.global_batches(build_lib.run_data(config_, spec),
                                     build_lib.make_task(config_, spec), steps)


@dataclasses.dataclass
class Trained:
    """What `train` did: every variable of the state by check_step's name
    ("main/dense/kernel", "extras/queue", "step", ...), before and after, the
    metric means, and the run (its state holds the values after)."""
    before: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    metrics: dict[str, float]
    run: build_lib.Run

    def pairs(self, other: "Trained") -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(name, this value after, the other's after) for every variable: two
        trainings of the same config, in the state's order."""
        return [(name, mine, theirs) for (name, mine), theirs in
                zip(self.after.items(), other.after.values())]

    def changed(self) -> list[str]:
        """The names of the variables the steps changed."""
        return [name for name in self.before
                if not np.array_equal(self.before[name], self.after[name])]


def train(config_: Config, steps: int = 1, replicas: int = 1,
          precision: str = "float64", start: dict | None = None) -> Trained:
    """Trains `steps` steps of the run's own batches on 1 or 2 replicas, from the
    seeded initial state of `config_`, or from `start` (another call's `before` or
    `after` on the same config: its values in order; Keras numbers the layers of
    every build anew, so two builds' names may differ, never their order)."""
    trial = _trial(config_, replicas, precision, steps)
    names = [name for name, _ in trial.compared]
    if start is not None:
        if len(start) != len(names):
            raise ValueError(f"start holds {len(start)} variables, this state "
                             f"{len(names)}: give a Trained of the same config")
        values = trial.snapshot()
        values[:len(names)] = [np.asarray(v) for v in start.values()]
        trial.restore(values)
    before = dict(zip(names, trial.values()))
    metrics = trial.train()
    return Trained(before, dict(zip(names, trial.values())), metrics, trial.run)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """check_step's verdict (`result`, a check_step.CheckResult) and its report."""
    result: check_step.CheckResult

    @property
    def passed(self) -> bool:
        return self.result.passed

    def report(self) -> str:
        return check_step.report(self.result)


def check(config_: Config, steps: int = 0, start_step: int = 0) -> Verdict:
    """trainer.check_step on the run of `config_`: `steps` steps (0: its default)
    from the schedule's step `start_step`, on 1 and 2 replicas in float64, and on
    2 in the run's own precision."""
    return Verdict(check_step.run_check(config_, steps, devices=list(DEVICES),
                                        start_step=start_step))


@pytest.fixture
def step_config(tmp_path) -> Callable[..., Config]:
    """config(**settings) with the run's model_dir in the test's own tmp_path."""
    def make(**settings) -> Config:
        return config(**{"model_dir": os.path.join(tmp_path, "run"), **settings})
    return make
