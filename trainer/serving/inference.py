"""From pixels to the task's outputs outside training: rebuild a trained model and
its task from its model_dir (with trainer/build.py, as training does), and prepare
images exactly as evaluation does (resize to the model's size, then the dataset's
normalization). Used by predict, export and the pictures.
"""
import os

from absl import logging
import numpy as np
import tensorflow as tf

from data import files, image_limits, sources
from trainer import averaging, build, checkpoints, inputs

WEIGHTS_FILE, BEST_WEIGHTS_FILE = checkpoints.WEIGHTS_FILE, checkpoints.BEST_WEIGHTS_FILE


class InferenceError(RuntimeError):
    """A model_dir or image cannot be used; the message says what to do."""


def decode_file(path: str) -> np.ndarray:
    """An image file (JPEG, PNG, GIF, BMP; grey, RGBA or RGB) -> uint8 [H, W, 3]."""
    if tf.io.gfile.isdir(path):
        raise InferenceError(f"cannot read image {path}: it is a directory; give "
                             f"image files")
    data = None
    try:
        data = tf.io.read_file(path)
        return tf.io.decode_image(data, channels=3, expand_animations=False).numpy()
    except tf.errors.OpError as err:
        if isinstance(err, tf.errors.NotFoundError):
            reason = "no such file"
        elif isinstance(err, tf.errors.InvalidArgumentError):
            # An image refused for its size (a decompression bomb) is an image: say
            # why, with its size from the header and the decoder's limit.
            reason = ((data is not None and image_limits.too_large(data.numpy()))
                      or "not a JPEG, PNG, GIF or BMP image")
        else:
            reason = files.reason_of(err)
        raise InferenceError(f"cannot read image {path}: {reason}") from err


class TrainedModel:
    """The output model of a run (its task's: the classifier, a GAN's generator, a
    mean teacher's teacher), its task and the task's presenter, rebuilt on this machine with
    trainer/build.py from run_config.json and the weights the run evaluated (the
    average with --ema_decay): model.weights.h5 of a finished run; of one that has
    not finished (stopped, or still training) best.weights.h5, else its newest
    checkpoint's. `weights` names which, and a warning line says it when it is not
    model.weights.h5."""

    def __init__(self, model_dir: str):
        config_path = os.path.join(model_dir, checkpoints.RUN_CONFIG)
        if not tf.io.gfile.exists(config_path):
            raise InferenceError(f"{config_path} not found: --model_dir must be the "
                                 f"directory of a training run")
        self.config = build.config_of_run(model_dir)
        self.spec = build.model_input_spec(sources.spec_of_run(self.config.dataset, model_dir),
                                           self.config.model)
        self.data = build.run_data(self.config, self.spec)  # (what evaluation reads)
        self.image_size = self.data.image_shape[0]
        weights, self.weights = checkpoints.weights_to_serve(model_dir)
        if weights:
            run = self._build(build.SERVE)
            run.output_model.load_weights(os.path.join(model_dir, weights))
            self.weights = self.weights or weights
        else:
            run = self._from_checkpoint(model_dir, self.weights)
        self.task, self.model = run.task, run.output_model
        self.presenter = run.task.presenter(run.task)  # what predict and export serve
        if self.weights != WEIGHTS_FILE:
            logging.warning("using %s", self.weights)

    def _build(self, purpose: str, plan: build.Plan | None = None) -> build.Run:
        return build.build_run(self.config, self.spec, plan, tf.distribute.get_strategy(),
                               "float32", purpose=purpose)  # (CPU inference)

    def _from_checkpoint(self, model_dir: str, why: str) -> build.Run:
        """The run with its newest readable checkpoint restored, the output model
        holding the weights evaluation uses (the average with --ema_decay)."""
        # The average lives in the optimizer: then the state evaluation builds,
        # which needs the data's size (as trainer.evaluate).
        averaged = bool(self.config.ema_decay)
        run = (self._build(build.EVALUATE, build.plan(self.config, self.spec, 1))
               if averaged else self._build(build.SERVE))
        path = checkpoints.restore_latest(checkpoints.training_checkpoint(run.state),
                                          model_dir, partial=True)
        if path is None:
            raise InferenceError(
                f"{model_dir} has no {WEIGHTS_FILE}, {BEST_WEIGHTS_FILE} or checkpoint "
                f"yet: train the run longer (its first checkpoint comes after an epoch, "
                f"or --checkpoint_every steps)")
        with averaging.averaged_weights(run.state):
            evaluated = run.output_model.get_weights()
        run.output_model.set_weights(evaluated)  # (the raw weights came back)
        self.weights = (f"{os.path.basename(path)} (step {int(run.state.step.numpy())}; "
                        f"{why}; it has no {BEST_WEIGHTS_FILE})")
        return run

    def serve(self, images: list) -> dict[str, np.ndarray]:
        """The task's serving outputs (e.g. class probabilities) for images of any
        size, resized and normalized as evaluation does."""
        batch = np.stack([inputs.eval_image(self.data, image)
                          for image in images])
        return {key: np.asarray(value)
                for key, value in self.presenter.serve_images(self.model, batch).items()}
