"""Per-example image functions `(image, label) -> (image, label)`.

They work eagerly and inside `Dataset.map`. Training augmentation runs on uint8
images, before normalization, and only on the training split.
"""
from typing import Callable

import tensorflow as tf

Example = tuple[tf.Tensor, tf.Tensor]


def pad_crop_flip(image: tf.Tensor, label: tf.Tensor, pad: int = 4) -> Example:
    """Random crop after zero-padding `pad` pixels per side, then random flip."""
    height, width, channels = image.shape
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    image = tf.image.random_crop(padded, (height, width, channels))
    return tf.image.random_flip_left_right(image), label


def identity(image: tf.Tensor, label: tf.Tensor) -> Example:
    return image, label


TRAIN_AUGMENTATIONS: dict[str, Callable[..., Example]] = {
    "pad_crop_flip": pad_crop_flip,
    "none": identity,
}


def make_normalize(mean, std) -> Callable[..., Example]:
    """uint8 [0, 255] -> float32, per-channel standardized."""
    mean = tf.constant(mean, tf.float32) * 255.0
    std = tf.constant(std, tf.float32) * 255.0

    def normalize(image: tf.Tensor, label: tf.Tensor) -> Example:
        return (tf.cast(image, tf.float32) - mean) / std, label

    return normalize
