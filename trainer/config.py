"""The one frozen config object a run is described by, assembled from the
settings groups declared beside the code that reads them.

Each group is a frozen dataclass whose fields carry everything about their flag
(trainer/settings.py: default, help, --help topic, range or choices, whether a
resume may change it): `StepSettings` (trainer/step.py), `OptimizerSettings`
(trainer/optimizers.py), `ScheduleSettings` (trainer/schedules.py), `DataSettings`
(trainer/inputs.py), `DeviceSettings` (trainer/strategy.py), and below those of the
model, the loop and the run directory (read by trainer/build.py, trainer/loop.py
and trainer/run_dir.py, which import this module). `Config` has every group's
fields, flat: one flag each, under its own name; `config.group(StepSettings)` is
what a reader of that group takes. A new setting is one field in its group and
its use. The run's task has settings of its own, declared in its file
(trainer/tasks/), made into flags the same way and kept in `Config.task_settings`.
This module imports no registry (of tasks, callbacks, recipes): what needs them,
resolving a command line under the recipes and validating it, is
trainer/run_settings.py. Commands parse the flags in their own `main`
(trainer/run_flags.py); library code takes this object, a group, or plain values.
"""
import dataclasses
import os
import re
from typing import Any, TypeVar

from trainer import inputs, optimizers, schedules, settings, step, strategy
from trainer.settings import ConfigError  # noqa: F401 (re-exported)

Group = TypeVar("Group")

# ({tasks}, {models}, {datasets} in a help text: the registries' names, filled in
# when the flags are made, trainer/run_flags.py: a user's own included.)
_ = settings.section("model")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What is trained (read by trainer/build.py)."""
    task: str = _("classification", "What the run optimizes and measures: {tasks} "
                  "(trainer/tasks/; each has its own settings and recipe).", topic="task",
                  resume=settings.NEVER)
    model: str = _("cifar_cnn", "Model: {models}.", resume=settings.NEVER)
    model_size: str = _("full", "full|tiny (tiny: the small test variant).",
                        choices=("full", "tiny"), resume=settings.NEVER)
    model_options: str = _("", "The model builder's own options, 'name=value,...' (e.g. "
                           "'widths=32:64:128,whiten=false' for airbench; tuples as "
                           "a:b:c).", resume=settings.NEVER)
    weights: str = _("none", "Initial weights: none | imagenet (xception, downloads) | "
                     "PATH (a .weights.h5 of the same model, or for xception Keras' "
                     "notop backbone file).")


_ = settings.section("the loop")


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """How long and how the loop runs, what it measures (read by trainer/loop.py
    and trainer/build.py's Plan)."""
    batch_size: int = _(1024, "GLOBAL batch size, split evenly across all replicas.",
                        topic="optimization", low=0, low_open=True)
    epochs: int = _(50, "Epochs to train (see --train_steps).", topic="optimization",
                    low=0, resume=True)
    train_steps: int = _(0, "If > 0: steps to train, overriding --epochs.",
                         topic="optimization", low=0, resume=True)
    on_nan: str = _("stop", "A step whose loss or summed gradient is not finite never "
                    "updates the weights; then stop (an error naming the steps; "
                    "checkpoints kept) or skip_step (count it and go on).",
                    topic="the training step", choices=("stop", "skip_step"))
    seed: int = _(0, "Seed for weights, shuffling and augmentation.",
                  topic="the training step")
    deterministic: bool = _(False, "Deterministic ops: the same command gives bitwise "
                            "the same weights on the same machine, also across a kill "
                            "and resume (slower on GPU).", topic="the training step")
    steps_per_loop: int = _(10, "Steps per tf.function call (an in-graph loop).",
                            low=0, low_open=True, resume=True)
    log_every: int = _(50, "Steps between log lines (0: per epoch).", low=0, resume=True)
    eval_every: int = _(0, "Steps between evaluations (0: at the end of every epoch).",
                        low=0, resume=True)
    eval_batch_size: int = _(0, "GLOBAL batch size of evaluation (0: --batch_size). "
                             "Evaluation is exact at any size (the last batch is "
                             "padded and masked).", low=0, resume=True)
    early_stop_patience: int = _(0, "Stop when the task's best metric (e.g. test "
                                 "accuracy) has not improved for this many evaluations "
                                 "in a row; the run is then finished (0: off).", low=0,
                                 resume=True)
    early_stop_min_delta: float = _(0.0, "What counts as an improvement for "
                                    "--early_stop_patience: a change beyond this.",
                                    low=0, resume=True)
    measure_peak: bool = _(False, "Measure this device's matmul FLOP/s at start-up (a "
                           "few seconds) and show the step's FLOP/s as a fraction of "
                           "it.", topic="measuring", resume=True)
    profile_steps: str = _("", "'A,B': write a TensorFlow profiler trace of steps A+1 to B "
                           "to the run's TensorBoard directory (model_dir/train, the "
                           "Profile tab); summarise it with python -m "
                           "trainer.tools.profile_summary.", topic="measuring",
                           resume=True)
    histograms: bool = _(False, "Write histograms of every trained weight and of its "
                         "gradient (on one training batch) to TensorBoard at every "
                         "evaluation.", topic="measuring", resume=True)

    def profile_range(self, total_steps: int) -> tuple[int, int] | tuple[()]:
        """--profile_steps as (first, last) steps within a run of `total_steps`
        (ConfigError beyond it); () if not set."""
        if not self.profile_steps:
            return ()
        first, last = profile_range(self.profile_steps)
        if last > total_steps:
            raise ConfigError(f"--profile_steps={self.profile_steps}: the run has "
                              f"{total_steps} steps; profile steps within it")
        return first, last


_ = settings.section("run directory and outputs")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Where the run's files are and what it runs of the user's own code (read by
    trainer/checkpoints.py, trainer/loop.py and the commands)."""
    model_dir: str = _("", "Checkpoints, run_config.json, model.weights.h5, metrics.json "
                       "(default: runs/<model>_<dataset>). A run on a directory with a "
                       "checkpoint resumes from it.", resume=True)
    checkpoint_every: int = _(0, "Steps between checkpoints (0: every epoch's end).",
                              low=0, resume=True)
    keep_checkpoints: int = _(3, "Checkpoints kept.", low=0, low_open=True, resume=True)
    async_checkpoints: bool = _(False, "Write checkpoints in the background: the steps "
                                "wait only while the state is copied to host memory; "
                                "a checkpoint is listed once written whole.",
                                resume=True)
    resume_with_changes: bool = _(False, "Continue the run in --model_dir although "
                                  "settings that change what is trained differ from "
                                  "its own (each change is recorded in its "
                                  "run_history.json; without this, one error line "
                                  "lists them).", resume=True)
    imports: str = _("", "Modules of your own to import first, 'MODULE[,MODULE]' (given "
                     "as --import): they register models, tasks and callbacks "
                     "(models.register_keras, @tasks.register, "
                     "@trainer.callbacks.register). Recorded in the run: evaluate, "
                     "predict and export on it import them themselves.",
                     topic="your own code", resume=True)
    callbacks: str = _("", "Registered callbacks to run, 'NAME[,NAME]' (yours, with "
                       "--import; trainer/callbacks.py). log.csv and early stopping "
                       "are always there.", topic="your own code", resume=True)


# (A dataclass lists its bases' fields last base first: the flags' order is the
# model's, the data's, the optimizer's, ..., the run directory's.)
@dataclasses.dataclass(frozen=True)
class Config(RunSettings, LoopSettings, strategy.DeviceSettings, step.StepSettings,
             schedules.ScheduleSettings, optimizers.OptimizerSettings,
             inputs.DataSettings, ModelSettings):
    """Everything that defines a run: every group's fields. Defaults are the seed's
    CIFAR-10 recipe; each model's recipe (trainer/recipes.py) overrides them, flags
    override both."""
    # --- the task's own settings (not a flag: its fields are, see trainer/tasks/) ---
    task_settings: dict = dataclasses.field(default_factory=dict)

    def group(self, kind: type[Group]) -> Group:
        """This run's settings of group `kind` (e.g. step.StepSettings)."""
        return settings.group_of(self, kind)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """Every setting, flat, in field order: the Config fields and the task's own
        settings given (task_settings) in its place."""
        values = {**self.as_dict(), **self.task_settings}
        values.pop("task_settings")
        return values

    def with_settings(self, **settings: Any) -> "Config":
        """The same run with some of its task's settings changed."""
        return self.replace(task_settings={**self.task_settings, **settings})


_FIELDS = tuple(f for f in dataclasses.fields(Config) if f.name != "task_settings")
FLAG_FIELDS = tuple(f.name for f in _FIELDS)

# What a start may change in a run directory (trainer/run_dir.py): how long it
# trains, how often it logs, evaluates and saves, where its files are and on which
# devices it runs (the replicas change the rounding, not the arithmetic: check_step).
# Each field says so itself (`resume=True`).
MAY_CHANGE_ON_RESUME = tuple(f.name for f in _FIELDS if f.metadata["resume"] is True)
# What the checkpoint's variables depend on: another value would restore wrong
# slots (Keras numbers the optimizer's variables; the EMA's come first) ...
NEVER_CHANGED = tuple(f.name for f in _FIELDS if f.metadata["resume"] == settings.NEVER)
# ... and the settings whose on/off (> 0 or not) decides whether their variables exist.
NEVER_SWITCHED = tuple(f.name for f in _FIELDS
                       if f.metadata["resume"] == settings.ON_OFF)

# The headings of --help in their order (trainer/cli.py); each field names its own
# (`topic`), each task's own settings show under their task, after "task".
TOPIC_ORDER = ("model", "data", "task", "optimization", "the training step", "devices",
               "the loop", "run directory and outputs", "measuring", "your own code")
TOPICS: dict[str, tuple[str, ...]] = {
    topic: tuple(f.name for f in _FIELDS if f.metadata["topic"] == topic)
    for topic in TOPIC_ORDER}
TOPIC_OF = {f.name: f.metadata["topic"] for f in _FIELDS}


def default_model_dir(model: str, dataset: str, task: str = "classification",
                      settings: dict[str, Any] | None = None) -> str:
    """runs/<model>_<dataset>[_<task>][_<name>=<value>...]: no suffix for
    classification; for TFRecords, the data folder's name (not its path); then each
    of `settings` (those given on the command line that change what is trained), so
    that the points of a sweep land in runs of their own and the same command
    resumes its run. A name over 120 characters ends in a hash of the settings."""
    if dataset.startswith("tfrecord:"):
        pattern = dataset[len("tfrecord:"):].split(";")[0].rstrip("/")
        folder = pattern.rsplit("/", 2)[-2] if pattern.count("/") else "data"
        dataset = "tfrecord_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", folder)
    name = f"{model}_{dataset}" + ("" if task == "classification" else f"_{task}")
    given = "_".join(f"{key}={value}" for key, value in sorted((settings or {}).items()))
    if given:
        given = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", given)
        if len(name) + len(given) > 119:
            import hashlib
            given = "settings_" + hashlib.sha256(given.encode()).hexdigest()[:12]
        name += "_" + given
    return os.path.join("runs", name)


def profile_range(text: str) -> tuple[int, int]:
    """'A,B' -> (A, B) with 0 <= A < B; ConfigError otherwise."""
    try:
        first, last = (int(part) for part in text.split(","))
    except ValueError:
        first = last = -1
    if not 0 <= first < last:
        raise ConfigError(f"--profile_steps={text!r}: give two steps 'A,B' with "
                          f"0 <= A < B, e.g. '20,30'")
    return first, last


