"""Xception (depthwise-separable convolutions) with a dense logits head.

`keras.applications.Xception(include_top=False)`, global average pooling and a dense
head; every layer trainable. The codelab fine-tuned it from ImageNet weights to 96.8%
on flowers. Backbone weights: None (random), "imagenet" (Keras' download, which
needs the network) or the path of Keras' notop weights file.
"""
import keras
from keras import layers

import models

IMAGENET_FILE = "xception_weights_tf_dim_ordering_tf_kernels_notop.h5"
MIN_SIZE = 71  # keras.applications.Xception's smallest input


def _tiny_backbone(inputs):
    """Entry conv and two residual separable blocks, as in Xception, 1000x smaller."""
    x = layers.Conv2D(8, 3, strides=2, use_bias=False)(inputs)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    for filters in (16, 32):
        shortcut = layers.Conv2D(filters, 1, strides=2, padding="same", use_bias=False)(x)
        x = layers.SeparableConv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.Activation("relu")(layers.BatchNormalization()(x))
        x = layers.SeparableConv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(layers.BatchNormalization()(x))
        x = layers.add([x, shortcut])
    return x


def _backbone(inputs, weights: str | None):
    try:
        return keras.applications.Xception(include_top=False, weights=weights,
                                           input_tensor=inputs).output
    except Exception as err:  # Keras raises several types for a failed download/read
        if weights == "imagenet":
            raise ValueError(
                f"could not get Xception's ImageNet weights ({type(err).__name__}); put "
                f"{IMAGENET_FILE} in ~/.keras/models/ or pass --weights=PATH") from err
        raise ValueError(f"could not load Xception weights from {weights}: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                         ) from err


@models.register("xception", min_image_size=MIN_SIZE)
def build(num_classes: int = 5, input_shape: tuple[int, int, int] = (192, 192, 3),
          tiny: bool = False, backbone_weights: str | None = None) -> keras.Model:
    if not tiny and min(input_shape[:2]) < MIN_SIZE:
        raise ValueError(f"xception needs images of at least {MIN_SIZE}x{MIN_SIZE}, got "
                         f"{input_shape[0]}x{input_shape[1]}; raise --image_size")
    if tiny and backbone_weights:
        raise ValueError(f"--weights={backbone_weights}: the tiny xception has no "
                         f"backbone to load it into; drop --weights or --model_size=tiny")
    inputs = keras.Input(shape=input_shape, name="image")
    x = _tiny_backbone(inputs) if tiny else _backbone(inputs, backbone_weights)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="xception_tiny" if tiny else "xception")
