"""A convolutional autoencoder: the image squeezed through a bottleneck and back.

Two stride-2 convolutions take a 32x32x3 image to an 8x8 code of `code_channels`
channels (8 x 8 x 16 = 1,024 numbers for 3,072: a third), two transposed
convolutions bring it back to the input's shape. The output is the reconstructed
image in the model's input space (normalized pixels), float32 whatever the
mixed-precision policy; the `autoencoder` task compares it with the input.
"""
import keras
from keras import layers

import models


def _conv_bn(x, filters: int, strides: int = 1, transpose: bool = False):
    conv = layers.Conv2DTranspose if transpose else layers.Conv2D
    x = conv(filters, 3, strides=strides, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization(momentum=0.9)(x)
    return layers.Activation("gelu")(x)


@models.register("conv_autoencoder", outputs=models.IMAGE)
def build(input_shape: tuple[int, int, int] = (32, 32, 3), tiny: bool = False,
          width: int = 32, code_channels: int = 16) -> keras.Model:
    """Args: width: the first convolution's filters (twice that at half size);
    code_channels: the bottleneck's channels at a quarter of the input's size."""
    if input_shape[0] % 4 or input_shape[1] % 4:
        raise ValueError(f"conv_autoencoder needs an image size divisible by 4, got "
                         f"{input_shape[0]}x{input_shape[1]}; set --image_size")
    if tiny:
        width, code_channels = 4, 4
    inputs = keras.Input(shape=input_shape, name="image")
    x = _conv_bn(inputs, width)
    x = _conv_bn(x, 2 * width, strides=2)
    x = _conv_bn(x, 2 * width, strides=2)
    code = layers.Conv2D(code_channels, 1, name="code")(x)  # the bottleneck
    x = _conv_bn(code, 2 * width, strides=2, transpose=True)
    x = _conv_bn(x, width, strides=2, transpose=True)
    reconstruction = layers.Conv2D(input_shape[-1], 3, padding="same", dtype="float32",
                                   name="reconstruction")(x)
    return keras.Model(inputs, reconstruction,
                       name="conv_autoencoder_tiny" if tiny else "conv_autoencoder")
