"""The task contract: what a run optimizes and measures, and how its step trains.

A task is one file in trainer/tasks/ with a `Task` subclass decorated with
`@register`; `--task=NAME` picks it. The loop, evaluation and check_step call only
the members below, so nothing outside a task assumes labels, classes or argmax.

The contract has two halves. THIS class is the research author's half, what a new
task reads and writes: its declarations, its state, its step, its evaluation.
The other half, how a trained model is served and drawn (predict's lines, the
SavedModel's signatures, the evaluation pictures), is the task's presenter
(trainer/tasks/presenter.py), named by `presenter`: a task that subclasses a
built-in one inherits its presenter and serves as it does.

Declared (class attributes):
- `name`, and `Settings`: a frozen dataclass of the task's own settings, each
  field made with `settings.setting(default, help)`; every field is a flag
  (trainer/main.py), stored in `Config.task_settings`. Validate in
  `__post_init__` (raise ConfigError).
- `batch_keys`: the batch keys its loss reads ("image", "label", ...); "target"
  among them: it trains on the mixed soft targets --mixup_alpha/--cutmix_alpha
  make (a run that sets them for another task is refused).
- `model_outputs`: the model output kinds it accepts for --model (models.LOGITS,
  HEADS, IMAGE, GENERATOR). A LOGITS/HEADS model is built with the dataset's
  classes (`num_classes(task)`), another number with `build.model(num_classes=N)`.
- `output_model`: the state's model that the weights files hold and that
  evaluation, predict and export use (default "main"; a GAN's generator, a mean
  teacher's teacher).
- `best`: a `Best(metric, higher_is_better, curve)`: the evaluation metric that
  picks best.weights.h5, and the one summary.png plots beside the loss.
- `recipe`: defaults for `--task=NAME` (e.g. its model), under the flags.
- `step_settings`: for a step of its own, the step settings it carries out.
- `presenter`: the Presenter class that serves and draws its output model.

The state and the step (see trainer/state.py and trainer/step.py):
- `create_state(build)`: under the strategy's scope, the TrainState: the models
  (`build.model()`: --model; `build.model(name, ...)`: another registered one),
  their optimizers (`build.optimizer(model)`: the run's, following the schedule
  at the run's step), frozen models it reads (`build.frozen(model)`: a teacher),
  extra variables (`build.variable(...)`). Default: one model and its optimizer.
  `build.purpose` says what the state is for (build.TRAIN, EVALUATE, SERVE):
  build only what that needs, the output model always.
- `train_step(state, batch, options)`: per replica, -> {name: (total, weight)}.
  Default: trainer/step.py's `train_step` (forward, `loss`, THE all-reduce, one
  update). A step of its own composes step.py's pieces (summed_gradients,
  apply_or_skip, gradient_at_offset, per_step) and randomness.py's draws. The
  wrapper advances state.step after it.
- `train_steps(plan)`: several steps and when each runs (step.Steps: 5 critic
  updates then 1 generator update, repeated; a head phase, then the whole
  network); default: `train_step` at every step.
- `eval_step(state, batch)`: per replica; default: `predict` then `eval_metrics`
  on the output model. `before_evaluation(state, evaluator)` runs first on every
  worker (e.g. the features of the training set for a kNN classifier);
  `finish_evaluation(result)` turns the summed metrics into the final ones (e.g.
  a Fréchet distance from summed features).
- `streams()`: several input streams ({name: inputs.Stream}: a labelled subset,
  the unlabelled rest at 7x the batch, each with its own views), the step gets
  {name: batch}; default none: one stream of `training_batch`es.
- `training_batch(images, labels, key, standard, normalize)`: what the input
  pipeline yields for the step, inside tf.data (e.g. two augmented views).
- `training_flops(state, forward, options)`: the float ops of one training step
  per example, for the GFLOP/s of the log lines.
- `callbacks()`: the task's own callbacks (trainer/callbacks.py), outside the
  step: a picture at every evaluation, a stop of its own.

Per replica, inside the default step (tensors in, tensors out):
- `loss(batch, outputs)`: (the per-example training loss [B], {name: (total,
  weight)} of training metrics); the step averages the loss over the GLOBAL
  batch, adds regularizers, and reports it as "loss" beside the metrics.
- `predict(model, images)`: what evaluation and serving read (e.g. TTA logits).
- `eval_metrics(batch, predictions, weights)`: {name: (total, weight)}, with
  "loss" whose weight is the number of examples counted (weights: 0 for padding).
  A non-scalar total (e.g. a confusion matrix) is kept for the pictures.

Module functions the framework calls with a task (not overridden): `num_classes`,
`check_model_kind` / `check_model` (a one-line ConfigError for a model that does
not fit), `makes_own_batches`; and `normalize(spec, images)` / `to_pixels(spec,
normalized)` (uint8 pixels <-> the model's input space), for tasks too.
"""
import dataclasses
import importlib
import os
import pkgutil
from typing import Any, Callable, ClassVar

import keras
import tensorflow as tf

import models
from data import sources
from trainer import step
from trainer.distributed import Metric  # (total, weight); tasks write base.Metric
from trainer.settings import ConfigError
from trainer.state import TrainState
# (re-exported: a task file needs `base` alone, for its presenter and its pixels)
from trainer.tasks.presenter import Presenter, normalize, to_pixels  # noqa: F401



@dataclasses.dataclass(frozen=True)
class NoSettings:
    """A task without settings of its own."""


@dataclasses.dataclass(frozen=True)
class Best:
    """The evaluation metric (a key of eval_metrics, without "test_") that picks
    best.weights.h5, early stopping and the summary's best point, which way is
    better, and `curve`: the metric summary.png plots beside the loss (default:
    `metric`)."""
    metric: str = "loss"
    higher_is_better: bool = False
    curve: str = ""

    def __post_init__(self):
        if not self.curve:
            object.__setattr__(self, "curve", self.metric)


class Task:
    """The research author's half of the contract (module docstring); serving and
    pictures are `presenter`'s."""
    name: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings
    batch_keys: ClassVar[tuple[str, ...]] = ("image",)
    model_outputs: ClassVar[tuple[str, ...]] = (models.LOGITS,)
    output_model: ClassVar[str] = "main"
    best: ClassVar[Best] = Best("loss")
    recipe: ClassVar[dict] = {}
    presenter: ClassVar[type[Presenter]] = Presenter

    def __init__(self, settings: Any, spec: sources.DatasetSpec,
                 input_shape: tuple[int, int, int]):
        self.settings, self.spec, self.input_shape = settings, spec, input_shape

    # --- the state and the step ------------------------------------------------------

    def create_state(self, build) -> TrainState:
        """The run's state (under the strategy's scope): one model (--model) and its
        optimizer."""
        model = build.model()
        return build.state({"main": model}, {"main": build.optimizer(model)})

    # A task with a train_step of its own: the step settings (trainer/step.py's
    # SETTINGS: the StepSettings fields) it carries out. A run that sets
    # any other is refused at build, never silently ignored. (The default step
    # carries out all of them.)
    step_settings: tuple[str, ...] = ()

    def train_step(self, state: TrainState, batch: dict, options) -> dict[str, Metric]:
        """One training step on one replica: trainer/step.py's supervised step."""
        return step.train_step(state, self, batch, options)

    def train_steps(self, plan) -> step.Steps:
        """Which training step runs when (trainer/step.py's Steps): by default
        `train_step` at every step. A task with several (5 critic updates, then 1
        generator update; a head phase, then the whole network) returns them with
        their counts; `plan` (trainer/build.py's Plan) gives the run's
        steps_per_epoch and total_steps for phases in epochs. Called before the
        state exists (check_step, the log), so it reads only the settings and plan."""
        return step.Steps((("train", self.train_step, 0),), repeat=False)

    def eval_step(self, state: TrainState, batch: dict) -> dict[str, Metric]:
        """One evaluation batch on one replica: `predict`, then `eval_metrics`."""
        return step.eval_step(state, self, batch)

    def before_evaluation(self, state: TrainState, evaluator) -> None:
        """Runs before each evaluation, on every worker (outside the step)."""

    def finish_evaluation(self, result: dict) -> dict:
        """The evaluation's result from its summed metrics (`test_<name>` means and
        the non-scalar sums under their names)."""
        return result

    def training_batch(self, images: tf.Tensor, labels: tf.Tensor, key: tf.Tensor,
                       standard: Callable, normalize: Callable) -> dict:
        """What the input pipeline yields for the step (inside tf.data, per input
        worker), from a batch of decoded uint8 images [B, H, W, C] at the run's
        size and their labels. `key` ([2] int64) is the batch's place in the stream:
        seed every random choice from it (stateless ops), so the stream stays a pure
        function of (seed, step) and a resume sees the same batches. standard(images,
        labels, key): the run's --augment, normalization and --mixup/--cutmix
        ({"image", "label"[, "target"]}); normalize(images, labels): the dataset's
        normalization alone. The pipeline adds "index"."""
        return standard(images, labels, key)

    def streams(self) -> dict:
        """Named input streams ({name: trainer.inputs.Stream}: a labelled subset at
        the batch size and the whole training split at 7x, each with its own
        views); the step then gets {name: that stream's batch}. Default: none, one
        stream of `training_batch`s."""
        return {}

    def training_flops(self, state: TrainState, forward: Callable[[keras.Model], float],
                       options) -> float:
        """The float ops of one training step per example: 3 x the main model's
        forward pass (`forward(model)`; the backward is about twice the forward),
        twice over with --sam_rho (two passes a step)."""
        return 3.0 * forward(state.models["main"]) * (2 if options.sam_rho else 1)

    def callbacks(self) -> list:
        """The task's own callbacks (trainer/callbacks.py: e.g. a picture logged at
        every evaluation), run with the run's others."""
        return []

    # --- per replica, in the default step ----------------------------------------------

    def loss(self, batch: dict, outputs) -> tuple[tf.Tensor, dict[str, Metric]]:
        raise NotImplementedError

    def predict(self, model: keras.Model, images: tf.Tensor):
        return model(images, training=False)

    def eval_metrics(self, batch: dict, predictions, weights: tf.Tensor
                     ) -> dict[str, Metric]:
        raise NotImplementedError


# --- what the framework asks of any task (functions: nothing here to override) -----

def num_classes(task: Task) -> int | None:
    """The classes a LOGITS/HEADS model of `task` is built with: the dataset's
    (None: the task reads no logits, e.g. an image model)."""
    if set(task.model_outputs) & {models.LOGITS, models.HEADS}:
        return task.spec.num_classes
    return None


def check_model_kind(task: Task, model_name: str) -> None:
    """ConfigError (one line) unless the model declares an output `task` reads
    (models.register(outputs=...)); before the model is built."""
    kind = models.entry(model_name).outputs
    if kind not in task.model_outputs:
        fitting = ", ".join(models.names_with_outputs(task.model_outputs)) or "none"
        raise ConfigError(
            f"task {task.name} needs a model that outputs "
            f"{' or '.join(models.OUTPUT_KINDS[k] for k in task.model_outputs)}; "
            f"{model_name} outputs {models.OUTPUT_KINDS[kind]} (models that fit: "
            f"{fitting})")


def check_model(task: Task, model_name: str, model: keras.Model,
                classes: int | None = None) -> None:
    """ConfigError (one line) unless the built model outputs what `task` reads, in
    exactly the shape it compares it with: (classes,) for logits (default: the
    dataset's, `num_classes`), the input's shape for an image model."""
    check_model_kind(task, model_name)
    output = model.output
    if isinstance(output, dict):  # (also where --model_options added heads)
        if "logits" not in output or models.HEADS not in task.model_outputs:
            raise ConfigError(
                f"{model_name} outputs a dict of {sorted(output)}; task {task.name} "
                f"reads " + (" or ".join(models.OUTPUT_KINDS[k]
                                        for k in task.model_outputs)))
        output = output["logits"]
    shape = tuple(output.shape[1:])
    classes = num_classes(task) if classes is None else classes
    expected = (classes,) if classes is not None else tuple(task.input_shape)
    if shape != expected:
        raise ConfigError(
            f"{model_name} outputs shape {shape} per example, but task {task.name} "
            f"compares it with {expected}; change the model's output (or "
            f"--image_size) so they match exactly")


def has_own_step(task: Task) -> bool:
    """Whether `task` trains with a step of its own (`train_step` or `train_steps`
    overridden) rather than trainer/step.py's default."""
    return (type(task).train_step is not Task.train_step
            or type(task).train_steps is not Task.train_steps)


def makes_own_batches(task: Task) -> bool:
    """Whether `task` overrides `training_batch` (else the pipeline's standard
    batch, without the call)."""
    return type(task).training_batch is not Task.training_batch


_TASKS: dict[str, type[Task]] = {}
_FOLDER_IMPORTED = False


def _import_the_folder() -> None:
    """Imports every module of trainer/tasks/ (a task is one file there) once, at
    the first look-up rather than with the package: a task file may then import
    any trainer module at its top (trainer.build imports trainer.config, which
    imports this package)."""
    global _FOLDER_IMPORTED
    if _FOLDER_IMPORTED:
        return
    _FOLDER_IMPORTED = True  # (before: a task module may look tasks up as it loads)
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if module.name not in ("__init__", "base", "presenter"):
            importlib.import_module(f"trainer.tasks.{module.name}")


# Task members that moved (issue 44): a task that still defines one would have it
# silently ignored, so registering it says where it went.
_MOVED = {**dict.fromkeys(("serve", "serve_images", "export_functions", "serves_images",
                           "report", "report_generated", "check_data",
                           "sample_predictions", "draw_samples", "draws_samples",
                           "pictures", "tiles_per_sample"), "its presenter's (a "
                          "`presenter = ...` Presenter subclass, trainer/tasks/presenter.py)"),
          **dict.fromkeys(("best_metric", "higher_is_better", "curve_metric"),
                          "`best = base.Best(metric, higher_is_better, curve)`"),
          "soft_targets": '"target" in `batch_keys`',
          "num_classes": "`build.model(num_classes=N)` in create_state",
          "expected_output_shape": "`build.model(num_classes=N)` in create_state",
          **dict.fromkeys(("normalize", "to_pixels"), "`base.normalize(self.spec, x)` / "
                          "`base.to_pixels(self.spec, x)`"),
          **dict.fromkeys(("check", "check_kind", "makes_own_batches"),
                          "the framework's (base.check_model, base.makes_own_batches)")}


def register(cls: type[Task]) -> type[Task]:
    """`@register` above a Task subclass makes it --task=<cls.name>."""
    if not cls.name or cls.name in _TASKS:
        raise ValueError(f"task {cls.__name__} needs a unique `name` (got {cls.name!r})")
    for klass in cls.__mro__:
        moved = [name for name in vars(klass) if name in _MOVED]
        if moved and klass is not Task:
            raise ValueError(f"task {cls.name}: {klass.__name__}.{moved[0]} is no longer "
                             f"a Task member; it is now {_MOVED[moved[0]]}")
    _TASKS[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    _import_the_folder()
    return tuple(sorted(_TASKS))


def get(name: str) -> type[Task]:
    _import_the_folder()
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; valid: {', '.join(names())}")
    return _TASKS[name]


def setting_fields(name: str) -> dict[str, dataclasses.Field]:
    """The settings of task `name`, by field name."""
    return {f.name: f for f in dataclasses.fields(get(name).Settings)}


def all_setting_fields() -> dict[str, dataclasses.Field]:
    """Every task's settings (a name shared by tasks is one setting: a subclass's
    Settings extends its parent's); a flag each."""
    fields: dict[str, dataclasses.Field] = {}
    for task in names():
        for name, field in setting_fields(task).items():
            if name in fields and field.default != fields[name].default:
                raise ValueError(f"task setting {name!r} has two defaults")
            fields.setdefault(name, field)
    return fields


def owners(setting: str) -> list[str]:
    """The tasks that have `setting`."""
    return [task for task in names() if setting in setting_fields(task)]


def make_settings(name: str, values: dict) -> Any:
    """Task `name`'s Settings from `values` (missing ones: defaults); ConfigError
    for a value its __post_init__ refuses or a setting of another task."""
    known = setting_fields(name)
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ConfigError(f"--{unknown[0]} is a setting of task(s) "
                          f"{', '.join(owners(unknown[0])) or 'none'}, not of "
                          f"{name}; pass --task=... or drop the flag")
    return get(name).Settings(**values)
