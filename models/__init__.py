"""The model table: name -> builder. Every builder returns a Keras model giving
float32 logits (no softmax), whatever the mixed-precision policy, or a dict of them
with the main head under "logits" (e.g. resnet_aux: also "aux_logits").

All builders share one signature, `build(num_classes, input_shape, tiny=False)`:
`tiny=True` gives a small variant of the same architecture for tests.
"""
import functools
import os
from typing import Callable

import keras
import tensorflow as tf

from models import cifar_cnn, convnet, resnet, resnet_fast, squeezenet, xception

Builder = Callable[..., keras.Model]

_BUILDERS: dict[str, Builder] = {
    "cifar_cnn": cifar_cnn.build,
    "convnet": convnet.build,
    "resnet": resnet.build,
    "resnet_aux": functools.partial(resnet.build, aux_head=True),
    "resnet_fast": resnet_fast.build,
    "squeezenet": squeezenet.build,
    "xception": xception.build,
}


def names() -> tuple[str, ...]:
    return tuple(sorted(_BUILDERS))


def build(name: str, num_classes: int, input_shape: tuple[int, int, int],
          tiny: bool = False, weights: str | None = None) -> keras.Model:
    """Builds model `name`; an unknown name is a ValueError listing the known ones.

    weights: None/"none" (random init); a `*.weights.h5` file saved from this model
    (e.g. a run's model.weights.h5); for xception also "imagenet" or Keras' notop
    backbone file.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}")
    weights = None if weights in (None, "", "none") else weights
    if weights and weights != "imagenet" and not tf.io.gfile.exists(weights):
        raise ValueError(f"--weights={weights}: no such file")
    whole_model = weights is not None and weights.endswith(".weights.h5")
    kwargs = {}
    if weights and not whole_model:
        if name != "xception":
            raise ValueError(f"--weights={weights}: {name} takes only a .weights.h5 file "
                             f"saved from the same model")
        kwargs["backbone_weights"] = weights
    model = _BUILDERS[name](num_classes=num_classes, input_shape=input_shape, tiny=tiny,
                            **kwargs)
    if whole_model:
        try:
            model.load_weights(weights)
        except ValueError as err:
            raise ValueError(f"--weights={weights} does not fit {model.name}: "
                             f"{str(err).splitlines()[0]}") from err
    return model
