"""From pixels to the task's outputs outside training: rebuild a trained model and
its task from its model_dir (with trainer/build.py, as training does), and prepare
images exactly as evaluation does (resize to the model's size, then the dataset's
normalization). Used by predict, export and the pictures.
"""
import dataclasses
import os

import numpy as np
import tensorflow as tf

from data import files, sources
from trainer import build, checkpoints, inputs

WEIGHTS_FILE, BEST_WEIGHTS_FILE = checkpoints.WEIGHTS_FILE, checkpoints.BEST_WEIGHTS_FILE


class InferenceError(RuntimeError):
    """A model_dir or image cannot be used; the message says what to do."""


def decode_file(path: str) -> np.ndarray:
    """An image file (JPEG, PNG, GIF, BMP; grey, RGBA or RGB) -> uint8 [H, W, 3]."""
    if tf.io.gfile.isdir(path):
        raise InferenceError(f"cannot read image {path}: it is a directory; give "
                             f"image files")
    try:
        data = tf.io.read_file(path)
        return tf.io.decode_image(data, channels=3, expand_animations=False).numpy()
    except tf.errors.OpError as err:
        reason = ("no such file" if isinstance(err, tf.errors.NotFoundError) else
                  "not a JPEG, PNG, GIF or BMP image"
                  if isinstance(err, tf.errors.InvalidArgumentError) else
                  files.reason_of(err))
        raise InferenceError(f"cannot read image {path}: {reason}") from err


class TrainedModel:
    """The output model of a finished run (its task's: the classifier, a GAN's
    generator, a mean teacher's teacher) and its task, rebuilt on this machine with
    trainer/build.py from run_config.json and model.weights.h5 (the evaluated
    weights: the average with --ema_decay)."""

    def __init__(self, model_dir: str):
        config_path = os.path.join(model_dir, checkpoints.RUN_CONFIG)
        weights_path = os.path.join(model_dir, WEIGHTS_FILE)
        for path in (config_path, weights_path):
            if not tf.io.gfile.exists(path):
                raise InferenceError(f"{path} not found: --model_dir must be the "
                                     f"directory of a finished training run")
        self.config = build.config_of_run(model_dir)
        self.spec = build.model_input_spec(_dataset_spec(self.config.dataset, model_dir),
                                           self.config.model)
        self.image_size = inputs.image_shape(self.config, self.spec)[0]
        run = build.build_run(self.config, self.spec, None, tf.distribute.get_strategy(),
                              "float32", purpose=build.SERVE)  # (CPU inference)
        self.task, self.model = run.task, run.output_model
        self.model.load_weights(weights_path)

    def serve(self, images: list) -> dict[str, np.ndarray]:
        """The task's serving outputs (e.g. class probabilities) for images of any
        size, resized and normalized as evaluation does."""
        batch = np.stack([inputs.eval_image(self.config, self.spec, image)
                          for image in images])
        return {key: np.asarray(value)
                for key, value in self.task.serve_images(self.model, batch).items()}


def _dataset_spec(name: str, model_dir: str) -> sources.DatasetSpec:
    """The run's dataset description. A TFRecord run's dataset.json is copied into
    its model_dir at training time, so the data files need not be here."""
    if name.startswith(sources.TFRECORD_PREFIX):
        kept = os.path.join(model_dir, sources.TFRECORD_METADATA)
        if tf.io.gfile.exists(kept):
            # A pattern with no files here: the description alone.
            spec = sources.get_spec(sources.TFRECORD_PREFIX +
                                    os.path.join(model_dir, "no-records-*.tfrec"))
            return dataclasses.replace(spec, name=name)
    return sources.get_spec(name)


def keep_dataset_description(dataset: str, model_dir: str) -> None:
    """Keeps a TFRecord dataset's description (dataset.json) in model_dir, copied or,
    for the codelab's files that have none, written from the data (see _dataset_spec)."""
    if dataset.startswith(sources.TFRECORD_PREFIX):
        sources.save_description(sources.get_spec(dataset), model_dir)
