"""ResNet-50 (He et al. 2016) for ImageNet-sized images, as Model Garden trains it.

Bottleneck blocks (1x1 reduce, 3x3, 1x1 expand, x4 widths) in four stages of
3, 4, 6, 3 blocks, the stride on the 3x3 convolution ("v1.5", as Model Garden and
torchvision: +0.5% top-1 over the original's stride on the first 1x1), a 7x7
stride-2 stem and max-pooling. Each block's last batch-norm starts with gamma 0, so
every residual block begins as the identity (Goyal et al. 2017: what lets batch
4096 train at lr 1.6). 25.6M parameters, 4.1 GFLOP per 224x224 forward pass.

`blocks` and `width` make smaller variants of the same architecture (tiny: one
block per stage, width 8).
"""
import keras
from keras import layers

import models

BN_MOMENTUM, BN_EPSILON = 0.9, 1e-5  # Model Garden's (0.9 is Keras' 0.1 PyTorch-style)


def _conv_bn(x, filters: int, kernel: int, strides: int = 1, zero_gamma: bool = False,
             name: str = ""):
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=name + "_conv")(x)
    return layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON,
                                     gamma_initializer="zeros" if zero_gamma else "ones",
                                     name=name + "_bn")(x)


def bottleneck(x, filters: int, strides: int, name: str):
    shortcut = x
    if strides != 1 or x.shape[-1] != 4 * filters:
        shortcut = _conv_bn(x, 4 * filters, 1, strides, name=name + "_0")
    y = layers.Activation("relu")(_conv_bn(x, filters, 1, name=name + "_1"))
    y = layers.Activation("relu")(_conv_bn(y, filters, 3, strides, name=name + "_2"))
    y = _conv_bn(y, 4 * filters, 1, zero_gamma=True, name=name + "_3")
    return layers.Activation("relu", name=name + "_out")(layers.add([y, shortcut]))


@models.register("resnet50")
def build(num_classes: int = 1000, input_shape: tuple[int, int, int] = (224, 224, 3),
          tiny: bool = False, blocks: tuple[int, ...] = (3, 4, 6, 3),
          width: int = 64) -> keras.Model:
    """Args: blocks: bottleneck blocks per stage; width: the first stage's
    bottleneck width (its output is 4x)."""
    if tiny:
        blocks, width = (1, 1, 1, 1), 4
    inputs = keras.Input(shape=input_shape, name="image")
    x = layers.Activation("relu")(_conv_bn(inputs, width, 7, 2, name="stem"))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for stage, count in enumerate(blocks):
        for block in range(count):
            strides = 2 if stage > 0 and block == 0 else 1
            x = bottleneck(x, width * 2 ** stage, strides, f"stage{stage + 2}_block{block + 1}")
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits",
                          kernel_initializer=keras.initializers.RandomNormal(stddev=0.01))(x)
    name = "resnet50_tiny" if tiny else ("resnet50" if tuple(blocks) == (3, 4, 6, 3)
                                         and width == 64 else "resnet_bottleneck")
    return keras.Model(inputs, logits, name=name)
