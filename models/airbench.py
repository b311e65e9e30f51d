"""The airbench94 network (Jordan, arXiv 2404.00498): 94% on CIFAR-10 in under 10
epochs. A frozen 2x2 patch-whitening convolution, then three groups of
conv-pool-BN-GELU-conv-BN-GELU, a 3x3 max-pool and a linear head whose logits are
scaled down by 1/9. Batch-norm has no scale (only the bias trains, with a high
learning rate in its recipe) and momentum 0.6 (PyTorch's 0.4); 3x3 convolutions
start as the identity on their first channels.

Options (`--model_options=widths=32:64:128,whiten=false`): `widths` of the three
groups, `whiten` (false: an ordinary trained 2x2 conv), `dirac` (false: no identity
init), for the ablation; `fused` (false: Keras' own batch-norm and GELU instead of
models/fused.py's, which compute the same in fewer kernels).
"""
import functools

import keras
from keras import layers

import models
from models import fused as fused_ops
from models.layers import Dirac, PatchWhitening, torch_default_init

BN_MOMENTUM = 0.6
HEAD_SCALE = 1 / 9


def _conv(filters: int, dirac: bool) -> layers.Conv2D:
    init = Dirac(torch_default_init()) if dirac else torch_default_init()
    return layers.Conv2D(filters, 3, padding="same", use_bias=False,
                         kernel_initializer=init)


def _gelu(fused: bool) -> layers.Activation:
    return layers.Activation(fused_ops.gelu if fused else "gelu")


def _bn_gelu(x, fused: bool):
    batch_norm = fused_ops.BatchNormalization if fused else layers.BatchNormalization
    x = batch_norm(momentum=BN_MOMENTUM, epsilon=1e-12, scale=False)(x)
    return _gelu(fused)(x)


def _group(x, filters: int, dirac: bool, fused: bool):
    x = layers.MaxPooling2D(2)(_conv(filters, dirac)(x))
    x = _bn_gelu(x, fused)
    return _bn_gelu(_conv(filters, dirac)(x), fused)


@models.register("airbench")
def build(num_classes: int = 10, input_shape: tuple[int, int, int] = (32, 32, 3),
          tiny: bool = False, widths: tuple[int, int, int] = (64, 256, 256),
          whiten: bool = True, dirac: bool = True, fused: bool = True) -> keras.Model:
    """airbench94's net: 2x2 patch whitening (or, whiten=False, a trained 2x2 conv),
    three groups of conv-pool-BN-GELU-conv-BN-GELU at `widths`, max-pool, a linear
    head scaled by 1/9. dirac=False: plain (PyTorch-default) init. fused=False:
    Keras' batch-norm and GELU (the same function, more kernels)."""
    widths = (4, 8, 8) if tiny else tuple(widths)
    inputs = keras.Input(shape=input_shape, name="image")
    if whiten:
        x = PatchWhitening(input_shape[-1], kernel_size=2, name="whiten")(inputs)
    else:
        x = layers.Conv2D(2 * 2 * 2 * input_shape[-1], 2, padding="valid",
                          kernel_initializer=torch_default_init(), name="first_conv")(inputs)
    x = _gelu(fused)(x)
    for filters in widths:
        x = _group(x, filters, dirac, fused)
    x = layers.GlobalMaxPooling2D()(x)  # the 3x3 max-pool over the last 3x3 map
    x = layers.Dense(num_classes, use_bias=False, dtype="float32",
                     kernel_initializer=torch_default_init())(x)
    logits = layers.Rescaling(HEAD_SCALE, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="airbench_tiny" if tiny else "airbench")


# The 3-minute variant: widths 32:64:128 against 64:256:256 (1/6 of the FLOPs).
models.register("airbench_small", builder=functools.partial(build, widths=(32, 64, 128)))
