"""SqueezeNet as in the flowers codelab (80% on tf_flowers in 35 epochs there).

A 3x3 stem, then fire modules (1x1 squeeze -> parallel 1x1 and 3x3 expand,
concatenated) alternating with 2x2 max-pooling, global average pooling, a dense
logits head. Batch-norm after every conv with momentum 0.9: the Keras default 0.99
is too slow for the few dozen batches per epoch of a small dataset.
"""
import keras
from keras import layers

import models

# (squeeze, expand) per fire module; a 2x2 max-pool follows every module but the last.
CODELAB_FIRES = ((24, 48), (48, 96), (64, 128), (48, 96), (24, 48))
BN_MOMENTUM = 0.9


def _conv_bn(x, filters: int, kernel: int):
    x = layers.Conv2D(filters, kernel, padding="same", activation="relu")(x)
    return layers.BatchNormalization(momentum=BN_MOMENTUM)(x)


def fire(x, squeeze: int, expand: int):
    """Output channels: `expand` (expand // 2 from the 1x1 branch + the 3x3 branch)."""
    if expand % 2:
        raise ValueError(f"fire module expand={expand} must be even (two equal branches)")
    x = _conv_bn(x, squeeze, 1)
    return layers.Concatenate()([_conv_bn(x, expand // 2, 1), _conv_bn(x, expand // 2, 3)])


@models.register("squeezenet")
def build(num_classes: int = 5, input_shape: tuple[int, int, int] = (192, 192, 3),
          tiny: bool = False, stem_filters: int = 32,
          fires: tuple[tuple[int, int], ...] = CODELAB_FIRES) -> keras.Model:
    """Args: fires: (squeeze, expand) per module; tiny: 2 narrow modules."""
    if tiny:
        stem_filters, fires = 8, ((4, 8), (4, 8))
    inputs = keras.Input(shape=input_shape, name="image")
    x = _conv_bn(inputs, stem_filters, 3)
    for index, (squeeze, expand) in enumerate(fires):
        x = fire(x, squeeze, expand)
        if index < len(fires) - 1:
            x = layers.MaxPooling2D(2)(x)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="squeezenet_tiny" if tiny else "squeezenet")
