"""The model table: name -> builder. Every builder returns a Keras model giving logits.

All builders share one signature, `build(num_classes, input_shape, tiny=False)`:
`tiny=True` gives a small variant of the same architecture for tests.
"""
from typing import Callable

import keras

from models import cifar_cnn

Builder = Callable[..., keras.Model]

_BUILDERS: dict[str, Builder] = {
    "cifar_cnn": cifar_cnn.build,
}


def names() -> tuple[str, ...]:
    return tuple(sorted(_BUILDERS))


def build(name: str, num_classes: int, input_shape: tuple[int, int, int],
          tiny: bool = False) -> keras.Model:
    """Builds model `name`; an unknown name is a ValueError listing the known ones."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}")
    return _BUILDERS[name](num_classes=num_classes, input_shape=input_shape, tiny=tiny)
