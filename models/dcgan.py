"""DCGAN (Radford, Metz and Chintala 2016) for small images, as the `gan` task uses
it: a generator ("dcgan": a latent vector -> an image in [-1, 1]) and a
discriminator ("dcgan_discriminator": an image -> one logit, real or not).

Generator: Dense to 4x4x(8 width), then transposed 4x4 convolutions of stride 2
halving the channels and doubling the size up to the image's (4 -> 8 -> 16 -> 32
for CIFAR-10), batch-norm and ReLU after each but the last, tanh out. The
discriminator mirrors it with strided 4x4 convolutions and LeakyReLU(0.2) and no
batch-norm (its statistics would mix the real and the generated batch, and every
pass would move them), then one logit.
"""
import math

import keras
from keras import layers

import models


def _upsamplings(size: int) -> int:
    steps = math.log2(size / 4)
    if size < 8 or steps != int(steps):
        raise ValueError(f"dcgan makes images of 4 x 2^k pixels (8, 16, 32, 64, ...), "
                         f"not {size}; set --image_size")
    return int(steps)


@models.register("dcgan", outputs=models.GENERATOR, min_image_size=8)
def generator(input_shape=(32, 32, 3), tiny: bool = False, latent_dim: int = 128,
              width: int = 64) -> keras.Model:
    """latent [latent_dim] -> image of input_shape, tanh (float32)."""
    latent_dim, width = (16, 8) if tiny else (latent_dim, width)
    steps = _upsamplings(input_shape[0])
    channels = width * 2 ** (steps - 1)
    latent = keras.Input((latent_dim,), name="latent")
    x = layers.Dense(4 * 4 * channels, use_bias=False)(latent)
    x = layers.Reshape((4, 4, channels))(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    for _ in range(steps - 1):
        channels //= 2
        x = layers.Conv2DTranspose(channels, 4, strides=2, padding="same",
                                   use_bias=False)(x)
        x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.Conv2DTranspose(input_shape[2], 4, strides=2, padding="same")(x)
    image = layers.Activation("tanh", dtype="float32", name="image")(x)
    return keras.Model(latent, image, name="dcgan_tiny" if tiny else "dcgan")


@models.register("dcgan_discriminator", min_image_size=8)
def discriminator(num_classes: int = 1, input_shape=(32, 32, 3), tiny: bool = False,
                  width: int = 64) -> keras.Model:
    """image -> num_classes logits (1: real or not), float32."""
    width = 8 if tiny else width
    steps = _upsamplings(input_shape[0])
    image = keras.Input(input_shape, name="image")
    x, channels = image, width
    for _ in range(steps):
        x = layers.Conv2D(channels, 4, strides=2, padding="same")(x)
        x = layers.LeakyReLU(0.2)(x)
        channels *= 2
    x = layers.Flatten()(x)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(image, logits, name="dcgan_discriminator_tiny" if tiny
                       else "dcgan_discriminator")
