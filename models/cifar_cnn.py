"""The seed's CIFAR-10 convnet (80.79% test in the founding TPU codelab).

Layer for layer as in the seed; the only change is that the last Dense gives logits
(no softmax): the loss applies the softmax with `from_logits=True`, which is
numerically safer, and it stays float32 under mixed precision.
"""
import keras
from keras import layers

import models


@models.register("cifar_cnn")
def build(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3),
          tiny: bool = False) -> keras.Model:
    """Args: tiny: widths divided by 8 (same layers), for fast tests."""
    div = 8 if tiny else 1
    conv = lambda filters, padding="same": layers.Conv2D(  # noqa: E731
        filters // div, 3, padding=padding, activation="relu")
    inputs = keras.Input(shape=input_shape, name="image")
    x = layers.BatchNormalization()(inputs)
    x = conv(32)(x)
    x = conv(32)(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.25)(x)
    x = layers.BatchNormalization()(x)
    x = conv(64)(x)
    x = conv(64, padding="valid")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Dropout(0.25)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(512 // div, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    # float32 logits whatever the mixed-precision policy: softmax/loss need the range.
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="cifar_cnn_tiny" if tiny else "cifar_cnn")
