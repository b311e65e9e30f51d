"""The flowers codelab's plain convnet: 3x3 convs with max-pooling, then a 3x3/1x1
pair, global average pooling and a dense logits head."""
import keras
from keras import layers

import models

CODELAB_FILTERS = (16, 30, 60, 90, 110)  # a 2x2 max-pool after all but the first


@models.register("convnet")
def build(num_classes: int = 5, input_shape: tuple[int, int, int] = (192, 192, 3),
          tiny: bool = False) -> keras.Model:
    filters, head = ((4, 8, 8), (16, 8)) if tiny else (CODELAB_FILTERS, (130, 40))
    inputs = keras.Input(shape=input_shape, name="image")
    x = inputs
    for index, width in enumerate(filters):
        x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        if index > 0:
            x = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(head[0], 3, padding="same", activation="relu")(x)
    x = layers.Conv2D(head[1], 1, padding="same", activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="convnet_tiny" if tiny else "convnet")
