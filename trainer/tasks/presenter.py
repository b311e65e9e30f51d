"""How a trained model is served and drawn: the presenter a task names.

A task (trainer/tasks/base.py) says what a run trains and measures; its
presenter, `Task.presenter` (a class, made with the task: `task.presenter(task)`),
says what predict prints, what the exported SavedModel returns and what the
evaluation pictures show. Predict, export, evaluation's sample predictions and the
pictures (TensorBoard, summary.png) call only the methods below. Each built-in
task's presenter is in that task's file; a research task that subclasses a
built-in task inherits its presenter (and serves as it does) without a line.

Outside the step (eager numpy, or the SavedModel's graph for `serve`):
- `serve(predictions)`: the outputs of predict and of the exported SavedModel
  from what `Task.predict` returns; `serve_images(model, images_uint8)` does both
  on uint8 images at the model's size, normalized as evaluation does.
- `export_functions(model, image_functions)`: the SavedModel's signatures
  (default: the image ones); `serves_images`: False for a task whose output model
  takes no image (a generator): predict then calls `report_generated`.
- `report(served, title, image, example, output_stem, top)`: predict's lines for
  one image (`served`: its row of `serve`; `image`: the uint8 input at the model's
  size; `example`: the dataset example, or None for a file; `output_stem`: where
  it may write a file, without extension; `top`: how many items to list).
- `check_data(spec)`: ConfigError if another dataset does not fit the run
  (predict --index on another dataset).
- `sample_predictions(model, samples)`, `draw_samples(figure, samples)`,
  `pictures(samples, details, title)`: the evaluation pictures; `samples` holds
  the first eval examples ("image" uint8, ...); `tiles_per_sample`: the image
  tiles `draw_samples` draws per example.

`normalize(spec, images)` and `to_pixels(spec, normalized)` map between uint8
pixels and the model's input space of a dataset; tasks use them too (through
`base`).
"""
from typing import Any, ClassVar

import keras
import numpy as np
import tensorflow as tf

from data import augment, sources
from trainer.output import figures
from trainer.settings import ConfigError


def normalize(spec: sources.DatasetSpec, images_uint8) -> tf.Tensor:
    """uint8 pixels -> the model's input, exactly as evaluation prepares them."""
    normalized, _ = augment.make_normalize(spec.mean, spec.std)(
        tf.convert_to_tensor(images_uint8, tf.uint8), None)
    return normalized


def to_pixels(spec: sources.DatasetSpec, normalized: tf.Tensor) -> tf.Tensor:
    """The model's input space -> float pixels in [0, 1] (unclipped)."""
    mean = tf.constant(spec.mean, normalized.dtype)
    std = tf.constant(spec.std, normalized.dtype)
    return normalized * std + mean


class Presenter:
    """Serves and draws the output model of `task` (a trainer.tasks.base.Task:
    not imported here, base imports this module)."""
    serves_images: ClassVar[bool] = True
    tiles_per_sample: ClassVar[int] = 1  # image tiles draw_samples draws per example

    def __init__(self, task: Any):
        self.task, self.spec = task, task.spec

    def serve(self, predictions) -> dict[str, tf.Tensor]:
        raise NotImplementedError(f"task {self.task.name}'s presenter serves nothing: "
                                  f"give the task a presenter with `serve`")

    def serve_images(self, model: keras.Model, images_uint8) -> dict[str, tf.Tensor]:
        """`serve` of uint8 images at the model's size, normalized as evaluation
        does: what predict prints and the SavedModel returns."""
        return self.serve(self.task.predict(model, normalize(self.spec, images_uint8)))

    def export_functions(self, model: keras.Model, image_functions: dict) -> dict:
        """name -> (function, input signature) of the exported SavedModel; default
        the image ones (serving_default of encoded images, predict_images)."""
        return image_functions

    def check_data(self, spec: sources.DatasetSpec) -> None:
        """ConfigError if another dataset's examples do not fit this run (predict
        --index on another dataset)."""

    def report(self, served: dict[str, np.ndarray], title: str, image: np.ndarray,
               example: dict | None, output_stem: str, top: int = 5) -> list[str]:
        """top: how many items to list, where the task lists any (classes)."""
        raise NotImplementedError

    def report_generated(self, model: keras.Model, output_stem: str, count: int,
                         seed: int) -> list[str]:
        """predict's lines for a task whose output model takes no image
        (serves_images False), e.g. a grid of `count` generated samples."""
        raise ConfigError(f"task {self.task.name} serves images: give predict image "
                          f"files or --index")

    def sample_predictions(self, model: keras.Model, samples: dict) -> dict:
        """samples + what the pictures show of the model's predictions (eager, on
        this worker alone: no collective, so the chief may do it by itself)."""
        return {**samples, **{key: np.asarray(value) for key, value in
                              self.serve_images(model, samples["image"]).items()}}

    def draw_samples(self, figure, samples: dict) -> None:
        """Draws the sample predictions into a matplotlib (sub)figure (a presenter
        that draws none does not override this)."""

    def draws_samples(self) -> bool:
        return type(self).draw_samples is not Presenter.draw_samples

    def pictures(self, samples: dict | None, details: dict, title: str) -> dict:
        """{TensorBoard tag: Figure} at an evaluation: the sample predictions."""
        if samples is None or not self.draws_samples():
            return {}
        figure = figures.new_figure(len(samples["image"]) * self.tiles_per_sample)
        self.draw_samples(figures.titled(figure, title), samples)
        return {"predictions": figure}
