"""Batched image functions `(images [B, H, W, C], labels [B]) -> (images, labels)`.

They work on whole batches (one vectorized op per batch instead of one map call per
image: on a 2-core CPU the per-image version starved the training step), eagerly or
inside `Dataset.map`. Training augmentation runs on uint8 images before
normalization, and only on the training split.

Augmentations are stateless: they take a `seed` (a [2] int tensor) and are a pure
function of (images, seed). The pipeline derives the seed from (run seed, epoch,
batch), so a resumed run augments exactly as an uninterrupted one.
"""
from typing import Callable

import tensorflow as tf

Batch = tuple[tf.Tensor, tf.Tensor]


def _seeds(seed: tf.Tensor, count: int) -> list[tf.Tensor]:
    """`count` independent stateless seeds from one."""
    return tf.unstack(tf.random.experimental.stateless_split(seed, num=count))


def pad_crop_flip(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor,
                  pad: int = 4) -> Batch:
    """Per image: a random crop after zero-padding `pad` pixels, and a random flip.

    Both are one gather of row and column indices; a flip is the columns reversed.
    """
    batch = tf.shape(images)[0]
    height, width = images.shape[1], images.shape[2]
    crop_seed, flip_seed = _seeds(seed, 2)
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    offsets = tf.random.stateless_uniform([batch, 2], crop_seed, 0, 2 * pad + 1,
                                          dtype=tf.int32)
    rows = offsets[:, :1] + tf.range(height)[None, :]
    cols = offsets[:, 1:] + tf.range(width)[None, :]
    flip = tf.random.stateless_uniform([batch, 1], flip_seed) < 0.5
    cols = tf.where(flip, tf.reverse(cols, axis=[1]), cols)
    images = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(images, cols, axis=2, batch_dims=1), labels


def flip_saturation(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor) -> Batch:
    """The flowers codelab's augmentation: random left-right flip and a random
    saturation factor in [0, 2] per image (0: grey, 1: unchanged, 2: doubled).

    Saturation is a blend with the image's grey version (as PIL's ImageEnhance.Color),
    which is one multiply-add per pixel for the whole batch.
    """
    batch = tf.shape(images)[0]
    flip_seed, saturation_seed = _seeds(seed, 2)
    flip = tf.random.stateless_uniform([batch, 1, 1, 1], flip_seed) < 0.5
    images = tf.where(flip, tf.reverse(images, axis=[2]), images)
    pixels = tf.cast(images, tf.float32)
    grey = tf.image.rgb_to_grayscale(pixels)
    factor = tf.random.stateless_uniform([batch, 1, 1, 1], saturation_seed, 0.0, 2.0)
    pixels = grey + factor * (pixels - grey)
    return tf.cast(tf.round(tf.clip_by_value(pixels, 0.0, 255.0)), tf.uint8), labels


def random_resized_crop(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor,
                        min_area: float = 0.5, max_aspect: float = 4 / 3) -> Batch:
    """Per image: a random box of `min_area`..100% of the area and aspect ratio in
    [1/max_aspect, max_aspect], resized back to the input size (one batched
    crop_and_resize). The object stays mostly in view, unlike ImageNet's 8%-100%."""
    batch = tf.shape(images)[0]
    height, width = images.shape[1], images.shape[2]
    area_seed, aspect_seed, top_seed, left_seed = _seeds(seed, 4)
    area = tf.random.stateless_uniform([batch], area_seed, min_area, 1.0)
    log_aspect = (tf.random.stateless_uniform([batch], aspect_seed, -1.0, 1.0)
                  * tf.math.log(max_aspect))
    box_h = tf.minimum(tf.sqrt(area / tf.exp(log_aspect)), 1.0)
    box_w = tf.minimum(tf.sqrt(area * tf.exp(log_aspect)), 1.0)
    top = tf.random.stateless_uniform([batch], top_seed) * (1.0 - box_h)
    left = tf.random.stateless_uniform([batch], left_seed) * (1.0 - box_w)
    boxes = tf.stack([top, left, top + box_h, left + box_w], axis=1)
    crops = tf.image.crop_and_resize(tf.cast(images, tf.float32), boxes,
                                     tf.range(batch), (height, width))
    return tf.cast(tf.round(tf.clip_by_value(crops, 0.0, 255.0)), tf.uint8), labels


def crop_flip_saturation(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor) -> Batch:
    """`random_resized_crop`, then the codelab's flip and saturation."""
    crop_seed, color_seed = _seeds(seed, 2)
    return flip_saturation(*random_resized_crop(images, labels, crop_seed), color_seed)


def identity(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor | None = None) -> Batch:
    return images, labels


TRAIN_AUGMENTATIONS: dict[str, Callable[..., Batch]] = {
    "pad_crop_flip": pad_crop_flip,
    "flip_saturation": flip_saturation,
    "crop_flip_saturation": crop_flip_saturation,
    "none": identity,
}


def make_normalize(mean, std) -> Callable[..., Batch]:
    """uint8 [0, 255] -> float32, per-channel standardized (any leading shape)."""
    mean = tf.constant(mean, tf.float32) * 255.0
    std = tf.constant(std, tf.float32) * 255.0

    def normalize(images: tf.Tensor, labels: tf.Tensor) -> Batch:
        return (tf.cast(images, tf.float32) - mean) / std, labels

    return normalize


def make_resize(size: int) -> Callable[..., Batch]:
    """Per example, before caching: any size -> size x size uint8 (bilinear, the
    aspect ratio is not kept, as in the codelab's TFRecords)."""
    def resize(image: tf.Tensor, label: tf.Tensor) -> Batch:
        image = tf.image.resize(image, (size, size), antialias=True)
        return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), label
    return resize
