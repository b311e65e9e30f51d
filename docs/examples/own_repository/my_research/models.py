"""Any Keras model, one call each. Each says what its input is: MobileNetV3 and
EfficientNet rescale [0, 255] themselves (PIXELS: no mean/std normalization
before them); the small Sequential takes [0, 1] (UNIT)."""
import keras

import models


def small_convnet(input_shape, num_classes, width=32):
    # A Sequential without a keras.Input: register_keras makes it functional.
    return keras.Sequential([
        keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(num_classes),  # logits: no softmax
    ])


models.register_keras("my_small_convnet", small_convnet, input_range=models.UNIT)
models.register_keras(
    "mnv3small", lambda input_shape, num_classes: keras.applications.MobileNetV3Small(
        input_shape=input_shape, weights=None, classes=num_classes,
        classifier_activation=None),  # include_preprocessing: [0, 255] in
    input_range=models.PIXELS)
models.register_keras(
    "efficientnetb0", lambda input_shape, num_classes: keras.applications.EfficientNetB0(
        input_shape=input_shape, weights=None, classes=num_classes,
        classifier_activation=None),  # rescales and normalizes [0, 255] itself
    input_range=models.PIXELS)
