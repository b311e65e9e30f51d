"""Batched image functions `(images [B, H, W, C], labels [B]) -> (images, labels)`.

They work on whole batches (one vectorized op per batch instead of one map call per
image: on a 2-core CPU the per-image version starved the training step), eagerly or
inside `Dataset.map`. Training augmentation runs on uint8 images before
normalization, and only on the training split.

The soft-target mixes (`mixup`, `cutmix`, `mix`) run after normalization, on float
images: `(images, labels, seed) -> (images, targets [B, num_classes])`.

Everything here is stateless: it takes a `seed` (a [2] int tensor) and is a pure
function of (images, labels, seed). The pipeline derives the seed from (run seed,
epoch, batch), so a resumed run augments exactly as an uninterrupted one.
"""
import functools
from typing import Callable

import tensorflow as tf

Batch = tuple[tf.Tensor, tf.Tensor]


def _seeds(seed: tf.Tensor, count: int) -> list[tf.Tensor]:
    """`count` independent stateless seeds from one."""
    return tf.unstack(tf.random.experimental.stateless_split(seed, num=count))


def pad_crop_flip(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor,
                  pad: int = 4, mode: str = "CONSTANT", flip: bool = True) -> Batch:
    """Per image: a random crop after padding `pad` pixels (zeros, or mode="REFLECT"),
    and a random flip (unless flip=False).

    Both are one gather of row and column indices; a flip is the columns reversed.
    """
    batch = tf.shape(images)[0]
    height, width = images.shape[1], images.shape[2]
    crop_seed, flip_seed = _seeds(seed, 2)
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]], mode=mode)
    offsets = tf.random.stateless_uniform([batch, 2], crop_seed, 0, 2 * pad + 1,
                                          dtype=tf.int32)
    rows = offsets[:, :1] + tf.range(height)[None, :]
    cols = offsets[:, 1:] + tf.range(width)[None, :]
    if flip:
        flips = tf.random.stateless_uniform([batch, 1], flip_seed) < 0.5
        cols = tf.where(flips, tf.reverse(cols, axis=[1]), cols)
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


def _random_bit(indices: tf.Tensor, seed: int) -> tf.Tensor:
    """A fair coin per index, a pure function of (index, seed): the top bit of a
    32-bit integer hash (Wellons' lowbias32) of the index mixed with the seed."""
    x = tf.cast(indices, tf.uint32) ^ tf.constant((seed * 0x9E3779B9) % 2**32, tf.uint32)
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32))) * tf.constant(
            multiplier, tf.uint32)
    x = x ^ tf.bitwise.right_shift(x, tf.constant(16, tf.uint32))
    return tf.cast(tf.bitwise.right_shift(x, tf.constant(31, tf.uint32)), tf.int64)


def alternating_flip(images: tf.Tensor, indices: tf.Tensor, epoch: tf.Tensor,
                     seed: int) -> tf.Tensor:
    """airbench's flip: image i is mirrored in epoch e iff its own random bit (a hash
    of (seed, i)) differs from e's parity. So each image is seen both ways in every
    two epochs, instead of by chance. A pure function of (i, e, seed)."""
    flip = tf.not_equal(_random_bit(indices, seed), tf.cast(epoch, tf.int64) % 2)
    return tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]), images)


TRAIN_AUGMENTATIONS: dict[str, Callable[..., Batch]] = {
    "pad_crop_flip": pad_crop_flip,
    # airbench's: a random 2-pixel translation of the reflect-padded image.
    "translate": functools.partial(pad_crop_flip, pad=2, mode="REFLECT", flip=False),
    "translate_flip": functools.partial(pad_crop_flip, pad=2, mode="REFLECT"),
    "flip_saturation": flip_saturation,
    "crop_flip_saturation": crop_flip_saturation,
    "none": identity,
    # ImageNet's (Inception's) crop, done on cached images; a streaming run does the
    # crop while decoding instead (DECODE_TIME_CROPS) and only flips the batch.
    "inception_crop": lambda images, labels, seed: inception_crop(images, labels, seed),
    "flip": lambda images, labels, seed: flip(images, labels, seed),
}
NO_FLIP = ("translate", "none")  # what --alternating_flip may be combined with


def make_normalize(mean, std) -> Callable[..., Batch]:
    """uint8 [0, 255] -> float32, per-channel standardized (any leading shape).

    The one normalization: training, evaluation, prediction and export all use it."""
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


# --- ImageNet's preprocessing, per example, fused into the decode -------------------
# (Szegedy et al. 2015's crop as Model Garden's and big_vision's input pipelines do
# it: tf.image.decode_and_crop_jpeg decodes only the crop's pixels of a JPEG.)

CROP_AREA = (0.08, 1.0)          # of the image's area
CROP_ASPECT = (3 / 4, 4 / 3)     # width / height
CROP_ATTEMPTS = 10
CENTRAL_FRACTION = 224 / 256     # evaluation: resize-then-central-crop's ratio


def flip(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor) -> Batch:
    """A random left-right flip per image."""
    flips = tf.random.stateless_uniform([tf.shape(images)[0], 1, 1, 1], seed) < 0.5
    return tf.where(flips, tf.reverse(images, axis=[2]), images), labels


def inception_crop(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor) -> Batch:
    """On a batch of (cached, already resized) images: a random box of 8%-100% of the
    area, aspect 3/4-4/3, resized back, and a random flip."""
    crop_seed, flip_seed = _seeds(seed, 2)
    images, labels = random_resized_crop(images, labels, crop_seed,
                                         min_area=CROP_AREA[0], max_aspect=CROP_ASPECT[1])
    return flip(images, labels, flip_seed)


def encoded_shape(image_bytes: tf.Tensor, channels: int = 3) -> tf.Tensor:
    """[height, width] of an encoded image; a JPEG's from its header, without decoding."""
    return tf.cond(tf.io.is_jpeg(image_bytes),
                   lambda: tf.image.extract_jpeg_shape(image_bytes)[:2],
                   lambda: tf.shape(decode_image(image_bytes, channels))[:2])


def decode_image(image_bytes: tf.Tensor, channels: int = 3) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes -> uint8 [H, W, channels]."""
    image = tf.io.decode_image(image_bytes, channels=channels, expand_animations=False)
    image.set_shape([None, None, channels])
    return image


def decode_crop(image_bytes: tf.Tensor, box: tf.Tensor, channels: int = 3) -> tf.Tensor:
    """The [top, left, height, width] box of an encoded image, uint8; a JPEG decodes
    only that window."""
    def other():
        return tf.image.crop_to_bounding_box(decode_image(image_bytes, channels), *tf.unstack(box))
    image = tf.cond(tf.io.is_jpeg(image_bytes),
                    lambda: tf.image.decode_and_crop_jpeg(image_bytes, box,
                                                          channels=channels),
                    other)
    image.set_shape([None, None, channels])
    return image


def central_box(shape: tf.Tensor, fraction: float = CENTRAL_FRACTION) -> tf.Tensor:
    """[top, left, side, side]: the centred square of `fraction` x the shorter side
    (resize-then-central-crop: a 224 crop of the image resized to 256)."""
    side = tf.cast(fraction * tf.cast(tf.reduce_min(shape), tf.float32), tf.int32)
    side = tf.maximum(side, 1)
    return tf.stack([(shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2, side, side])


def inception_box(shape: tf.Tensor, seed: tf.Tensor, area=CROP_AREA, aspect=CROP_ASPECT,
                  attempts: int = CROP_ATTEMPTS) -> tf.Tensor:
    """[top, left, height, width] of a random box of `area` of the image and
    width/height in `aspect` (TF's sampler, `attempts` tries); when no try fits,
    the central crop, as Inception's and Model Garden's pipelines fall back."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.concat([shape, [3]], 0), tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed,
        min_object_covered=area[0], aspect_ratio_range=aspect, area_range=area,
        max_attempts=attempts, use_image_if_no_bounding_boxes=True)
    box = tf.stack([begin[0], begin[1], size[0], size[1]])
    failed = tf.reduce_all(tf.equal(size[:2], shape))  # the sampler's "whole image"
    return tf.cond(failed, lambda: central_box(shape), lambda: box)


def resized_uint8(image: tf.Tensor, size: int) -> tf.Tensor:
    """[..., H, W, C] -> uint8 [..., size, size, C], bilinear (the crops' resize)."""
    image = tf.image.resize(image, (size, size), method="bilinear")
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def decode_inception_crop(image_bytes: tf.Tensor, seed: tf.Tensor, size: int,
                          channels: int = 3) -> tf.Tensor:
    """Training: a random Inception box decoded (only its pixels, for a JPEG) and
    resized to size x size uint8. A pure function of (bytes, seed)."""
    box = inception_box(encoded_shape(image_bytes, channels), seed)
    return resized_uint8(decode_crop(image_bytes, box, channels), size)


def decode_central_crop(image_bytes: tf.Tensor, size: int, channels: int = 3) -> tf.Tensor:
    """Evaluation: the central 224/256 square, resized to size x size uint8."""
    box = central_box(encoded_shape(image_bytes, channels))
    return resized_uint8(decode_crop(image_bytes, box, channels), size)


def make_central_crop(size: int) -> Callable[..., Batch]:
    """Per decoded example (evaluation of ImageNet-style data): the central
    224/256 square resized to size x size, as decode_central_crop does."""
    def crop(image: tf.Tensor, label: tf.Tensor) -> Batch:
        box = central_box(tf.shape(image)[:2])
        return resized_uint8(tf.image.crop_to_bounding_box(image, *tf.unstack(box)), size), label
    return crop


# The crop a streaming run does while decoding, for the augmentations that have one:
# name -> (decode(image_bytes, seed, size, channels), what is left for the batch).
DECODE_TIME_CROPS: dict[str, tuple[Callable, str]] = {
    "inception_crop": (decode_inception_crop, "flip"),
}


# Soft-target mixes: after normalization, on float images; they return one-hot
# targets mixed in the same proportion as the pixels.

def _beta(seed: tf.Tensor, alpha: float) -> tf.Tensor:
    """One Beta(alpha, alpha) draw, stateless: X / (X + Y) for X, Y ~ Gamma(alpha)."""
    x_seed, y_seed = _seeds(seed, 2)
    x = tf.random.stateless_gamma([], x_seed, alpha)
    y = tf.random.stateless_gamma([], y_seed, alpha)
    # For small alpha both draws can underflow to 0: then lam = 0, still a valid mix.
    return tf.math.divide_no_nan(x, x + y)


def _mixed_targets(labels: tf.Tensor, lam: tf.Tensor, num_classes: int) -> tf.Tensor:
    """lam * one_hot(labels) + (1 - lam) * one_hot(the reversed batch's labels)."""
    one_hot = tf.one_hot(labels, num_classes, dtype=tf.float32)
    return lam * one_hot + (1.0 - lam) * tf.reverse(one_hot, [0])


def mixup(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor, num_classes: int,
          alpha: float) -> Batch:
    """mixup (Zhang et al. 2018): every image blended with its partner in the reversed
    batch (as timm pairs them: no shuffle to seed) by one lam ~ Beta(alpha, alpha) per
    batch. Returns (images, float32 targets [B, num_classes])."""
    lam = _beta(seed, alpha)
    blend = tf.cast(lam, images.dtype)
    images = blend * images + (1 - blend) * tf.reverse(images, [0])
    return images, _mixed_targets(labels, lam, num_classes)


def cutmix(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor, num_classes: int,
           alpha: float) -> Batch:
    """CutMix (Yun et al. 2019): one box per batch, of area (1 - lam) for lam ~
    Beta(alpha, alpha) and a uniformly random centre, clipped to the image, gets the
    reversed batch's pixels. The targets' weights are the pixel fractions actually
    kept and pasted (the clipping shrinks the box). Returns (images, float32 targets)."""
    lam_seed, row_seed, col_seed = _seeds(seed, 3)
    lam = _beta(lam_seed, alpha)
    height, width = tf.shape(images)[1], tf.shape(images)[2]
    side = tf.sqrt(1.0 - lam)
    box_h = tf.cast(tf.cast(height, tf.float32) * side, tf.int32)
    box_w = tf.cast(tf.cast(width, tf.float32) * side, tf.int32)
    centre_row = tf.random.stateless_uniform([], row_seed, 0, height, tf.int32)
    centre_col = tf.random.stateless_uniform([], col_seed, 0, width, tf.int32)
    top = tf.clip_by_value(centre_row - box_h // 2, 0, height)
    bottom = tf.clip_by_value(centre_row - box_h // 2 + box_h, 0, height)
    left = tf.clip_by_value(centre_col - box_w // 2, 0, width)
    right = tf.clip_by_value(centre_col - box_w // 2 + box_w, 0, width)
    rows, cols = tf.range(height), tf.range(width)
    in_rows = (rows >= top) & (rows < bottom)
    in_cols = (cols >= left) & (cols < right)
    in_box = (in_rows[:, None] & in_cols[None, :])[None, :, :, None]
    images = tf.where(in_box, tf.reverse(images, [0]), images)
    pasted = tf.cast((bottom - top) * (right - left), tf.float32) / tf.cast(
        height * width, tf.float32)
    return images, _mixed_targets(labels, 1.0 - pasted, num_classes)


def _check_alphas(mixup_alpha: float, cutmix_alpha: float) -> None:
    if mixup_alpha < 0 or cutmix_alpha < 0:
        raise ValueError(f"mixup_alpha and cutmix_alpha must be >= 0, not "
                         f"{mixup_alpha} and {cutmix_alpha}")


def mix(images: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor, num_classes: int,
        mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> Batch:
    """mixup or CutMix, whichever has alpha > 0; with both, one of the two per batch
    with probability 1/2 each (as timm's Mixup). With neither: the images unchanged
    and one-hot targets. Returns (images, float32 targets [B, num_classes]), each
    example's targets summing to 1."""
    _check_alphas(mixup_alpha, cutmix_alpha)
    if mixup_alpha > 0 and cutmix_alpha > 0:
        choice_seed, mix_seed = _seeds(seed, 2)
        use_cutmix = tf.random.stateless_uniform([], choice_seed) < 0.5
        return tf.cond(use_cutmix,
                       lambda: cutmix(images, labels, mix_seed, num_classes, cutmix_alpha),
                       lambda: mixup(images, labels, mix_seed, num_classes, mixup_alpha))
    if mixup_alpha > 0:
        return mixup(images, labels, seed, num_classes, mixup_alpha)
    if cutmix_alpha > 0:
        return cutmix(images, labels, seed, num_classes, cutmix_alpha)
    return images, tf.one_hot(labels, num_classes, dtype=tf.float32)


def make_mix(num_classes: int, mixup_alpha: float = 0.0,
             cutmix_alpha: float = 0.0) -> Callable[..., Batch] | None:
    """The pipeline's `mix(images, labels, seed)`, or None when both alphas are 0: a
    run without mixing then keeps exactly the batches (and augmentation seeds) it
    had before mixing existed."""
    _check_alphas(mixup_alpha, cutmix_alpha)
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    return functools.partial(mix, num_classes=num_classes, mixup_alpha=mixup_alpha,
                             cutmix_alpha=cutmix_alpha)


# --- SimCLR's views (Chen et al. 2020, appendix A), batched and stateless ------------

def color_jitter(images: tf.Tensor, seed: tf.Tensor, strength: float = 0.5,
                 probability: float = 0.8) -> tf.Tensor:
    """Per image, with `probability`: brightness, contrast and saturation factors in
    1 +- 0.8 strength and a hue shift of +- 0.2 strength (SimCLR's jitter; CIFAR-10:
    strength 0.5), in that fixed order (torchvision's is random). float pixels in
    [0, 255] in and out."""
    batch = tf.shape(images)[0]
    coin, bright, contrast, saturation, hue = _seeds(seed, 5)
    spread = 0.8 * strength

    def factor(key):
        return tf.random.stateless_uniform([batch, 1, 1, 1], key, 1 - spread, 1 + spread)
    x = images / 255.0
    jittered = tf.clip_by_value(x * factor(bright), 0.0, 1.0)
    mean = tf.reduce_mean(tf.image.rgb_to_grayscale(jittered), axis=[1, 2, 3],
                          keepdims=True)
    jittered = tf.clip_by_value((jittered - mean) * factor(contrast) + mean, 0.0, 1.0)
    grey = tf.image.rgb_to_grayscale(jittered)
    jittered = tf.clip_by_value(grey + (jittered - grey) * factor(saturation), 0.0, 1.0)
    hsv = tf.image.rgb_to_hsv(jittered)
    shift = tf.random.stateless_uniform([batch, 1, 1], hue, -0.2 * strength,
                                        0.2 * strength)
    hsv = tf.concat([tf.math.floormod(hsv[..., :1] + shift[..., None], 1.0), hsv[..., 1:]],
                    axis=-1)
    jittered = tf.image.hsv_to_rgb(hsv)
    chosen = tf.random.stateless_uniform([batch, 1, 1, 1], coin) < probability
    return tf.where(chosen, jittered, x) * 255.0


def random_grayscale(images: tf.Tensor, seed: tf.Tensor, probability: float = 0.2
                     ) -> tf.Tensor:
    """Per image, with `probability`: its grey version in every channel."""
    chosen = tf.random.stateless_uniform([tf.shape(images)[0], 1, 1, 1], seed) < probability
    grey = tf.image.rgb_to_grayscale(images)
    return tf.where(chosen, tf.broadcast_to(grey, tf.shape(images)), images)


def gaussian_blur(images: tf.Tensor, seed: tf.Tensor, probability: float = 0.5,
                  sigma=(0.1, 2.0)) -> tf.Tensor:
    """Per image, with `probability`: a Gaussian blur of sigma in `sigma` (pixels),
    kernel 10% of the image's side (odd), as SimCLR's ImageNet views; one separable
    depthwise convolution for the whole batch (the images stacked as channels).
    Needs a static batch size."""
    batch, height, width, channels = images.shape
    coin, spread = _seeds(seed, 2)
    radius = max(1, int(0.1 * height) // 2)
    sigmas = tf.random.stateless_uniform([batch, 1], spread, *sigma)
    offsets = tf.range(-radius, radius + 1, dtype=tf.float32)[None, :]
    kernels = tf.exp(-0.5 * tf.square(offsets / sigmas))
    kernels /= tf.reduce_sum(kernels, axis=1, keepdims=True)  # [B, K]
    per_channel = tf.repeat(kernels, channels, axis=0)  # [B * C, K]
    stacked = tf.reshape(tf.transpose(images, [1, 2, 0, 3]), [1, height, width, -1])
    padded = tf.pad(stacked, [[0, 0], [radius, radius], [radius, radius], [0, 0]],
                    mode="REFLECT")
    vertical = tf.transpose(per_channel)[:, None, :, None]  # [K, 1, B*C, 1]
    horizontal = tf.transpose(per_channel)[None, :, :, None]  # [1, K, B*C, 1]
    blurred = tf.nn.depthwise_conv2d(padded, vertical, [1, 1, 1, 1], "VALID")
    blurred = tf.nn.depthwise_conv2d(blurred, horizontal, [1, 1, 1, 1], "VALID")
    blurred = tf.transpose(tf.reshape(blurred, [height, width, batch, channels]),
                           [2, 0, 1, 3])
    chosen = tf.random.stateless_uniform([batch, 1, 1, 1], coin) < probability
    return tf.where(chosen, blurred, images)


def simclr_view(images: tf.Tensor, seed: tf.Tensor, min_area: float = 0.08,
                jitter_strength: float = 0.5, blur: bool = False) -> tf.Tensor:
    """One SimCLR view of each uint8 image: a random resized crop (min_area..100%
    of the area, aspect 3/4..4/3), a flip, colour jitter (p 0.8), grey (p 0.2) and,
    with `blur`, a Gaussian blur (p 0.5; SimCLR's ImageNet views, not its CIFAR
    ones). uint8 out, a pure function of `seed`."""
    crop_seed, flip_seed, jitter_seed, grey_seed, blur_seed = _seeds(seed, 5)
    images, _ = random_resized_crop(images, None, crop_seed, min_area=min_area,
                                    max_aspect=CROP_ASPECT[1])
    images, _ = flip(images, None, flip_seed)
    pixels = color_jitter(tf.cast(images, tf.float32), jitter_seed, jitter_strength)
    pixels = random_grayscale(pixels, grey_seed)
    if blur:
        pixels = gaussian_blur(pixels, blur_seed)
    return tf.cast(tf.round(tf.clip_by_value(pixels, 0.0, 255.0)), tf.uint8)


# --- FixMatch's strong view: RandAugment (2 random operations of random strength per
# image) and Cutout, batched and stateless ----------------------------------------------

def _blend(images: tf.Tensor, other: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """other + factor (images - other), per image (factor [B]): PIL's ImageEnhance."""
    return other + factor[:, None, None, None] * (images - other)


def _affine(images: tf.Tensor, transforms: tf.Tensor) -> tf.Tensor:
    """Each float image [B, H, W, C] through its projective transform [B, 8]
    (output -> input coordinates), grey (128) outside the image."""
    shape = tf.shape(images)
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=images, transforms=transforms, output_shape=shape[1:3],
        fill_value=128.0, interpolation="BILINEAR", fill_mode="CONSTANT")


def _random_augment_ops(images: tf.Tensor, magnitude: tf.Tensor) -> list[tf.Tensor]:
    """Each of RandAugment's operations (FixMatch's set, without equalize) applied to
    every float image [B, H, W, C] in [0, 255], at its magnitude in [0, 1] [B]."""
    batch, height, width = tf.shape(images)[0], images.shape[1], images.shape[2]
    signed = magnitude * tf.where(magnitude * 1e4 % 2 < 1, 1.0, -1.0)  # either way
    grey = tf.reduce_mean(images, axis=-1, keepdims=True)
    low = tf.reduce_min(images, axis=[1, 2], keepdims=True)
    high = tf.reduce_max(images, axis=[1, 2], keepdims=True)
    smooth = tf.nn.depthwise_conv2d(
        tf.pad(images, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="SYMMETRIC"),
        tf.tile(tf.constant([[1., 1, 1], [1, 5, 1], [1, 1, 1]])[:, :, None, None] / 13.0,
                [1, 1, images.shape[3], 1]), [1, 1, 1, 1], "VALID")
    zeros, ones = tf.zeros([batch]), tf.ones([batch])
    shear, move, angle = 0.3 * signed, 0.3 * signed, signed * 3.14159265 / 6.0
    cos, sin = tf.cos(angle), tf.sin(angle)
    cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
    transforms = {  # (a0 a1 a2 b0 b1 b2 c0 c1): input = (a0 x + a1 y + a2, b0 x + b1 y + b2)
        "shear_x": [ones, shear, -shear * cy, zeros, ones, zeros, zeros, zeros],
        "shear_y": [ones, zeros, zeros, shear, ones, -shear * cx, zeros, zeros],
        "translate_x": [ones, zeros, move * width, zeros, ones, zeros, zeros, zeros],
        "translate_y": [ones, zeros, zeros, zeros, ones, move * height, zeros, zeros],
        "rotate": [cos, -sin, cx - cos * cx + sin * cy, sin, cos,
                   cy - sin * cx - cos * cy, zeros, zeros]}
    factor = 1.0 + 0.9 * signed  # enhancement factors in [0.1, 1.9]
    bits = tf.cast(8 - tf.round(magnitude * 4), tf.int32)  # posterize: 8..4 bits
    step = tf.cast(tf.bitwise.left_shift(1, 8 - bits), tf.float32)[:, None, None, None]
    return [images,                                                     # identity
            tf.math.divide_no_nan(images - low, high - low) * 255.0,   # autocontrast
            _blend(images, tf.zeros_like(images), factor),             # brightness
            _blend(images, tf.reduce_mean(grey, axis=[1, 2, 3], keepdims=True), factor),
            _blend(images, grey, factor),                              # colour
            _blend(images, smooth, factor),                            # sharpness
            tf.floor(images / step) * step,                            # posterize
            tf.where(images >= 256.0 * (1.0 - magnitude)[:, None, None, None],
                     255.0 - images, images),                          # solarize
            *(_affine(images, tf.stack(t, axis=1)) for t in transforms.values())]


RANDOM_AUGMENT_OPS = 13  # (the list above)


def strong_view(images: tf.Tensor, seed: tf.Tensor, operations: int = 2,
                cutout: float = 0.5) -> tf.Tensor:
    """FixMatch's strong augmentation of each uint8 image: a flip and a 4-pixel
    translation (the weak view's), `operations` RandAugment operations, each
    chosen and of a strength drawn per image, then Cutout (a grey square of
    `cutout` x the side, anywhere). uint8 out, a pure function of `seed`."""
    weak_seed, cut_seed, *op_seeds = _seeds(seed, 2 + 2 * operations)
    images, _ = pad_crop_flip(images, None, weak_seed, pad=4, mode="REFLECT")
    pixels = tf.cast(images, tf.float32)
    batch = tf.shape(images)[0]
    for choice_seed, strength_seed in zip(op_seeds[::2], op_seeds[1::2]):
        chosen = tf.random.stateless_uniform([batch], choice_seed, 0, RANDOM_AUGMENT_OPS,
                                             dtype=tf.int32)
        strength = tf.random.stateless_uniform([batch], strength_seed)
        options = tf.stack(_random_augment_ops(pixels, strength), axis=1)  # [B, ops, ...]
        pixels = tf.clip_by_value(tf.gather(options, chosen, axis=1, batch_dims=1),
                                  0.0, 255.0)
    height, width = images.shape[1], images.shape[2]
    side = int(round(cutout * min(height, width)))
    centres = tf.random.stateless_uniform([batch, 2], cut_seed)
    rows = tf.range(height, dtype=tf.float32)[None, :, None]
    cols = tf.range(width, dtype=tf.float32)[None, None, :]
    top = centres[:, 0, None, None] * height - side / 2
    left = centres[:, 1, None, None] * width - side / 2
    inside = ((rows >= top) & (rows < top + side) & (cols >= left) & (cols < left + side))
    pixels = tf.where(inside[..., None], 128.0, pixels)
    return tf.cast(tf.round(pixels), tf.uint8)
