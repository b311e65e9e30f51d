"""A small residual network for 32x32 images (He et al. 2016, CIFAR ResNet-6n+2).

Three stages of `blocks` basic blocks (two 3x3 conv-BN, identity shortcut; a 1x1
projection where the stage halves the size and doubles the width). The default,
ResNet-20 (0.27M parameters), is a modern CIFAR-10 baseline that a CPU can train.

`aux_head=True` adds an auxiliary classifier after the second stage (as Inception's
auxiliary heads): the model then returns {"logits", "aux_logits"} (registered as
resnet_aux, outputs HEADS); the classification task adds the auxiliary loss,
evaluation and serving use "logits".
"""
import functools

import keras
from keras import layers

import models


def _conv_bn(x, filters: int, strides: int = 1, kernel: int = 3):
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False,
                      kernel_initializer="he_normal")(x)
    return layers.BatchNormalization(momentum=0.9)(x)


def basic_block(x, filters: int, strides: int = 1):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, strides, kernel=1)
    y = layers.Activation("relu")(_conv_bn(x, filters, strides))
    y = _conv_bn(y, filters)
    return layers.Activation("relu")(layers.add([y, shortcut]))


@models.register("resnet")
def build(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3),
          tiny: bool = False, blocks: int = 3, width: int = 16,
          aux_head: bool = False) -> keras.Model:
    """Args: blocks: per stage (depth = 6 * blocks + 2); width: first stage's filters;
    aux_head: also return "aux_logits" from a head on the second stage."""
    if tiny:
        blocks, width = 1, 4
    inputs = keras.Input(shape=input_shape, name="image")
    x = layers.Activation("relu")(_conv_bn(inputs, width))
    aux_logits = None
    for stage in range(3):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            x = basic_block(x, width * 2 ** stage, strides)
        if aux_head and stage == 1:
            pooled = layers.GlobalAveragePooling2D()(x)
            aux_logits = layers.Dense(num_classes, dtype="float32", name="aux_logits")(pooled)
    x = layers.GlobalAveragePooling2D()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    name = ("resnet_tiny" if tiny else f"resnet{6 * blocks + 2}") + ("_aux" if aux_head else "")
    outputs = {"logits": logits, "aux_logits": aux_logits} if aux_head else logits
    return keras.Model(inputs, outputs, name=name)


# ResNet-20 with an auxiliary classifier after the second stage: {"logits", "aux_logits"}.
models.register("resnet_aux", outputs=models.HEADS,
                builder=functools.partial(build, aux_head=True))
