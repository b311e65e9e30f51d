"""The task contract: what a run optimizes and measures, and how its step trains.

A task is one file in trainer/tasks/ with a `Task` subclass decorated with
`@register`; `--task=NAME` picks it. The loop, evaluation, the pictures, predict,
export and check_step call only the methods below, so nothing outside a task
assumes labels, classes or argmax.

Declared (class attributes):
- `name`, and `Settings`: a frozen dataclass of the task's own settings, each
  field made with `settings.setting(default, help)`; every field is a flag
  (trainer/main.py), stored in `Config.task_settings`. Validate in
  `__post_init__` (raise ConfigError).
- `batch_keys`: the batch keys it reads ("image", "label", ...);
  `soft_targets`: whether it trains on mixed "target"s (--mixup_alpha/--cutmix_alpha).
- `model_outputs`: the model output kinds it accepts for --model (models.LOGITS,
  HEADS, IMAGE, GENERATOR).
- `output_model`: the state's model that the weights files hold and that
  evaluation, predict and export use (default "main"; a GAN's generator, a mean
  teacher's teacher).
- `best_metric`, `higher_is_better`: the evaluation metric that picks
  best.weights.h5; `curve_metric`: the one summary.png plots beside the loss.
- `recipe`: defaults for `--task=NAME` (e.g. its model), under the flags.

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
- `eval_step(state, batch)`: per replica; default: `predict` then `eval_metrics`
  on the output model. `before_evaluation(state, evaluator)` runs first on every
  worker (e.g. the features of the training set for a kNN classifier);
  `finish_evaluation(result)` turns the summed metrics into the final ones (e.g.
  a Fréchet distance from summed features).
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

Outside the step (eager numpy, or the SavedModel's graph for `serve`):
- `check_kind(model_name)`, `check(model_name, model)`: one-line ConfigError if
  the model (declared, then built) does not fit; `check_data(spec)`: if another
  dataset does not (predict --index).
- `serve(predictions)`: the outputs of predict and of the exported SavedModel;
  `export_functions(model, image_functions)`: the SavedModel's signatures
  (default: the image ones); `serves_images`: False for a task whose output model
  takes no image (a generator): predict then calls `report_generated`.
- `report(served, title, image, example, output_stem, top)`: predict's lines for
  one image (`served`: its row of `serve`; `image`: the uint8 input at the model's
  size; `example`: the dataset example, or None for a file; `output_stem`: where
  it may write a file, without extension; `top`: how many items to list).
- `sample_predictions(model, samples)`, `draw_samples(figure, samples)`,
  `pictures(samples, details, title)`: the evaluation pictures (TensorBoard,
  summary.png); `samples` holds the first eval examples ("image" uint8, ...).
"""
import dataclasses
import importlib
import os
import pkgutil
from typing import Any, Callable, ClassVar

import keras
import numpy as np
import tensorflow as tf

import models
from data import augment, sources
from trainer import step
from trainer.distributed import Metric  # (total, weight); tasks write base.Metric
from trainer.settings import ConfigError
from trainer.output import figures
from trainer.state import TrainState



@dataclasses.dataclass(frozen=True)
class NoSettings:
    """A task without settings of its own."""


class Task:
    name: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings
    batch_keys: ClassVar[tuple[str, ...]] = ("image",)
    soft_targets: ClassVar[bool] = False
    model_outputs: ClassVar[tuple[str, ...]] = (models.LOGITS,)
    output_model: ClassVar[str] = "main"
    serves_images: ClassVar[bool] = True
    best_metric: ClassVar[str] = "loss"
    higher_is_better: ClassVar[bool] = False
    curve_metric: ClassVar[str] = "loss"
    tiles_per_sample: ClassVar[int] = 1  # image tiles draw_samples draws per example
    recipe: ClassVar[dict] = {}

    def __init__(self, settings: Any, spec: sources.DatasetSpec,
                 input_shape: tuple[int, int, int]):
        self.settings, self.spec, self.input_shape = settings, spec, input_shape

    # --- set-up --------------------------------------------------------------------

    def num_classes(self) -> int | None:
        """What a LOGITS/HEADS model is built with (None: the task needs no classes)."""
        return self.spec.num_classes

    def expected_output_shape(self) -> tuple[int, ...]:
        """One example's model output (the main head's, for HEADS)."""
        return (self.num_classes(),)

    def check_kind(self, model_name: str) -> None:
        """ConfigError (one line) unless the model declares an output this task
        reads (models.register(outputs=...)); before the model is built."""
        kind = models.entry(model_name).outputs
        if kind not in self.model_outputs:
            fitting = ", ".join(models.names_with_outputs(self.model_outputs)) or "none"
            raise ConfigError(
                f"task {self.name} needs a model that outputs "
                f"{' or '.join(models.OUTPUT_KINDS[k] for k in self.model_outputs)}; "
                f"{model_name} outputs {models.OUTPUT_KINDS[kind]} (models that fit: "
                f"{fitting})")

    def check(self, model_name: str, model: keras.Model) -> None:
        """ConfigError (one line) unless the built model outputs what this task
        reads, in exactly the shape it compares it with."""
        self.check_kind(model_name)
        output = model.output
        if isinstance(output, dict):  # (also where --model_options added heads)
            if "logits" not in output or models.HEADS not in self.model_outputs:
                raise ConfigError(
                    f"{model_name} outputs a dict of {sorted(output)}; task {self.name} "
                    f"reads " + (" or ".join(models.OUTPUT_KINDS[k]
                                            for k in self.model_outputs)))
            output = output["logits"]
        shape = tuple(output.shape[1:])
        if shape != self.expected_output_shape():
            raise ConfigError(
                f"{model_name} outputs shape {shape} per example, but task {self.name} "
                f"compares it with {self.expected_output_shape()}; change the model's "
                f"output (or --image_size) so they match exactly")

    def check_data(self, spec: sources.DatasetSpec) -> None:
        """ConfigError if another dataset's examples do not fit this run (predict
        --index on another dataset)."""

    # --- the state and the step ------------------------------------------------------

    def create_state(self, build) -> TrainState:
        """The run's state (under the strategy's scope): one model (--model) and its
        optimizer."""
        model = build.model()
        return build.state({"main": model}, {"main": build.optimizer(model)})

    # A task with a train_step of its own: the step settings (trainer/step.py's
    # SETTINGS: --clip_grad_norm, --sam_rho, ...) it carries out. A run that sets
    # any other is refused at build, never silently ignored. (The default step
    # carries out all of them.)
    step_settings: tuple[str, ...] = ()

    def train_step(self, state: TrainState, batch: dict, options) -> dict[str, Metric]:
        """One training step on one replica: trainer/step.py's supervised step."""
        return step.train_step(state, self, batch, options)

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

    def makes_own_batches(self) -> bool:
        return type(self).training_batch is not Task.training_batch

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

    # --- outside the step -------------------------------------------------------------

    def serve(self, predictions) -> dict[str, tf.Tensor]:
        raise NotImplementedError

    def export_functions(self, model: keras.Model, image_functions: dict) -> dict:
        """name -> (function, input signature) of the exported SavedModel; default
        the image ones (serving_default of encoded images, predict_images)."""
        return image_functions

    def report_generated(self, model: keras.Model, output_stem: str, count: int,
                         seed: int) -> list[str]:
        """predict's lines for a task whose output model takes no image
        (serves_images False), e.g. a grid of `count` generated samples."""
        raise ConfigError(f"task {self.name} serves images: give predict image files "
                          f"or --index")

    def report(self, served: dict[str, np.ndarray], title: str, image: np.ndarray,
               example: dict | None, output_stem: str, top: int = 5) -> list[str]:
        """top: how many items to list, where the task lists any (classes)."""
        raise NotImplementedError

    def serve_images(self, model: keras.Model, images_uint8) -> dict[str, tf.Tensor]:
        """`serve` of uint8 images at the model's size, normalized as evaluation
        does: what predict prints and the SavedModel returns."""
        return self.serve(self.predict(model, self.normalize(images_uint8)))

    def sample_predictions(self, model: keras.Model, samples: dict) -> dict:
        """samples + what the pictures show of the model's predictions (eager, on
        this worker alone: no collective, so the chief may do it by itself)."""
        return {**samples, **{key: np.asarray(value) for key, value in
                              self.serve_images(model, samples["image"]).items()}}

    def draw_samples(self, figure, samples: dict) -> None:
        """Draws the sample predictions into a matplotlib (sub)figure (a task that
        draws none does not override this)."""

    def draws_samples(self) -> bool:
        return type(self).draw_samples is not Task.draw_samples

    def pictures(self, samples: dict | None, details: dict, title: str) -> dict:
        """{TensorBoard tag: Figure} at an evaluation: the sample predictions."""
        if samples is None or not self.draws_samples():
            return {}
        figure = figures.new_figure(len(samples["image"]) * self.tiles_per_sample)
        self.draw_samples(figures.titled(figure, title), samples)
        return {"predictions": figure}

    # --- shared helpers -----------------------------------------------------------

    def normalize(self, images_uint8) -> tf.Tensor:
        """uint8 pixels -> the model's input, exactly as evaluation prepares them."""
        normalized, _ = augment.make_normalize(self.spec.mean, self.spec.std)(
            tf.convert_to_tensor(images_uint8, tf.uint8), None)
        return normalized

    def to_pixels(self, normalized: tf.Tensor) -> tf.Tensor:
        """The model's input space -> float pixels in [0, 1] (unclipped)."""
        mean = tf.constant(self.spec.mean, normalized.dtype)
        std = tf.constant(self.spec.std, normalized.dtype)
        return normalized * std + mean


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
        if module.name not in ("__init__", "base"):
            importlib.import_module(f"trainer.tasks.{module.name}")


def register(cls: type[Task]) -> type[Task]:
    """`@register` above a Task subclass makes it --task=<cls.name>."""
    if not cls.name or cls.name in _TASKS:
        raise ValueError(f"task {cls.__name__} needs a unique `name` (got {cls.name!r})")
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
