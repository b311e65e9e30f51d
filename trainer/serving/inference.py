"""From pixels to class probabilities outside training: rebuild a trained model from
its model_dir, and prepare images exactly as evaluation does (resize to the model's
size, then the dataset's normalization). Used by predict, export and the pictures.
"""
import dataclasses
import json
import os

import keras
import numpy as np
import tensorflow as tf

from data import augment, sources
import models
from trainer import checkpoints, step

WEIGHTS_FILE = "model.weights.h5"
BEST_WEIGHTS_FILE = "best.weights.h5"  # the weights of the best evaluation


class InferenceError(RuntimeError):
    """A model_dir or image cannot be used; the message says what to do."""


def resize_uint8(image, size: int) -> np.ndarray:
    """Any [H, W, 3] image -> uint8 [size, size, 3], resized as evaluation does."""
    image = tf.convert_to_tensor(image)
    if tuple(image.shape[:2]) != (size, size):
        image, _ = augment.make_resize(size)(image, 0)
    return tf.cast(image, tf.uint8).numpy()


def class_probabilities(model: keras.Model, images, spec: sources.DatasetSpec,
                        tta: dict | None = None) -> np.ndarray:
    """Class probabilities for uint8 images [N, size, size, 3]; tta: keyword
    arguments of step.predict_logits (step.tta_of)."""
    normalized, _ = augment.make_normalize(spec.mean, spec.std)(
        tf.convert_to_tensor(images, tf.uint8), None)
    return tf.nn.softmax(step.predict_logits(model, normalized, **(tta or {}))).numpy()


def decode_file(path: str) -> np.ndarray:
    """An image file (JPEG, PNG, GIF, BMP; grey, RGBA or RGB) -> uint8 [H, W, 3]."""
    try:
        data = tf.io.read_file(path)
        return tf.io.decode_image(data, channels=3, expand_animations=False).numpy()
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as err:
        reason = "no such file" if isinstance(err, tf.errors.NotFoundError) else (
            "not a JPEG, PNG, GIF or BMP image")
        raise InferenceError(f"cannot read image {path}: {reason}") from err


class TrainedModel:
    """The model of a finished run, rebuilt on this machine from run_config.json and
    model.weights.h5 (the evaluated weights: the average with --ema_decay)."""

    def __init__(self, model_dir: str):
        config_path = os.path.join(model_dir, checkpoints.RUN_CONFIG)
        weights_path = os.path.join(model_dir, WEIGHTS_FILE)
        for path in (config_path, weights_path):
            if not tf.io.gfile.exists(path):
                raise InferenceError(f"{path} not found: --model_dir must be the "
                                     f"directory of a finished training run")
        with tf.io.gfile.GFile(config_path) as f:
            self.config = json.load(f)
        self.spec = _dataset_spec(self.config["dataset"], model_dir)
        self.image_size = self.config.get("image_size") or self.spec.image_shape[0]
        keras.mixed_precision.set_global_policy("float32")  # CPU inference
        self.model = models.build(
            self.config["model"], self.spec.num_classes,
            (self.image_size, self.image_size, self.spec.image_shape[2]),
            tiny=self.config.get("model_size") == "tiny",
            options=self.config.get("model_options", ""))
        self.model.load_weights(weights_path)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.spec.class_names or tuple(
            str(i) for i in range(self.spec.num_classes))

    def probabilities(self, images: list) -> np.ndarray:
        """Class probabilities [N, classes] for images of any size."""
        batch = np.stack([resize_uint8(image, self.image_size) for image in images])
        return class_probabilities(self.model, batch, self.spec, step.tta_of(self.config))


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
