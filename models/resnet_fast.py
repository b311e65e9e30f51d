"""A fast CIFAR-10 residual net in the style of the speed records (Page's ResNet-9,
airbench): conv-BN-ReLU blocks with max-pooling, two residual blocks, global max
pooling and a scaled linear head. Batch-norm uses a low momentum (0.6 in Keras'
convention, PyTorch's 0.4), so the running statistics keep up with a short run.

`width` is the first layer's filters: 64 in Page's ResNet-9; 32 by default here,
which costs a quarter of the FLOPs, so that a 2-core CPU can train it in minutes.
"""
import keras
from keras import layers

import models

BN_MOMENTUM = 0.6
HEAD_SCALE = 0.125  # Page's logit scaling: a cooler softmax early in training


def _conv_bn_relu(x, filters: int):
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                      kernel_initializer="he_normal")(x)
    x = layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=1e-5)(x)
    return layers.Activation("relu")(x)


def _stage(x, filters: int, residual: bool):
    x = layers.MaxPooling2D(2)(_conv_bn_relu(x, filters))
    if residual:
        x = layers.add([x, _conv_bn_relu(_conv_bn_relu(x, filters), filters)])
    return x


@models.register("resnet_fast")
def build(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3),
          tiny: bool = False, width: int = 32) -> keras.Model:
    width = 4 if tiny else width
    inputs = keras.Input(shape=input_shape, name="image")
    x = _conv_bn_relu(inputs, width)
    x = _stage(x, 2 * width, residual=True)
    x = _stage(x, 4 * width, residual=False)
    x = _stage(x, 8 * width, residual=True)
    x = layers.GlobalMaxPooling2D()(x)
    x = layers.Dense(num_classes, use_bias=False, dtype="float32")(x)
    logits = layers.Rescaling(HEAD_SCALE, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="resnet_fast_tiny" if tiny else "resnet_fast")
