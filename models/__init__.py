"""The model table: name -> builder. Every builder returns a Keras model giving
float32 logits (no softmax), whatever the mixed-precision policy, or a dict of them
with the main head under "logits" (e.g. resnet_aux: also "aux_logits").

All builders share one signature, `build(num_classes, input_shape, tiny=False,
**options)`: `tiny=True` gives a small variant of the same architecture for tests;
the options are the builder's own keyword arguments, given on the command line as
`--model_options=name=value,...` (e.g. `widths=32:64:128,whiten=false`).
"""
import functools
import inspect
from typing import Callable

import keras
import tensorflow as tf

from models import airbench, cifar_cnn, convnet, resnet, resnet_fast, squeezenet, xception
from models.layers import init_from_data, needs_data  # noqa: F401 (the loop's)

Builder = Callable[..., keras.Model]

_BUILDERS: dict[str, Builder] = {
    "airbench": airbench.build,
    # The 3-minute variant: widths 32:64:128 against 64:256:256 (1/6 of the FLOPs).
    "airbench_small": functools.partial(airbench.build, widths=(32, 64, 128)),
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


def parse_options(name: str, text: str) -> dict:
    """'widths=32:64:128,whiten=false' -> builder keyword arguments, typed after the
    builder's defaults. An unknown or malformed option is a ValueError."""
    if not text:
        return {}
    builder = _BUILDERS[name]
    defaults = {key: p.default for key, p in inspect.signature(builder).parameters.items()
                if key not in ("num_classes", "input_shape", "tiny", "backbone_weights")}
    if isinstance(builder, functools.partial):
        defaults.update({k: v for k, v in builder.keywords.items() if k in defaults})
    # Only what a flag can spell: bool, int, float, str, or a flat tuple of them.
    scalar = lambda v: isinstance(v, (bool, int, float, str))  # noqa: E731
    defaults = {k: v for k, v in defaults.items() if scalar(v) or (
        isinstance(v, tuple) and v and all(scalar(item) for item in v))}
    options = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in defaults or not value:
            raise ValueError(f"--model_options: {item!r} is not an option of {name}; "
                             f"valid: {', '.join(f'{k}=VALUE' for k in defaults) or 'none'}")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                options[key] = value.lower() in ("true", "1")
            elif isinstance(default, tuple):
                options[key] = tuple(type(default[0])(v) for v in value.split(":"))
            else:
                options[key] = type(default)(value)
        except ValueError:
            raise ValueError(f"--model_options: {key}={value!r} is not like the "
                             f"default {default!r}") from None
    return options


def build(name: str, num_classes: int, input_shape: tuple[int, int, int],
          tiny: bool = False, weights: str | None = None, options: str = "") -> keras.Model:
    """Builds model `name`; an unknown name is a ValueError listing the known ones.

    weights: None/"none" (random init); a `*.weights.h5` file saved from this model
    (e.g. a run's model.weights.h5); for xception also "imagenet" or Keras' notop
    backbone file. options: the builder's keyword arguments (see parse_options).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}")
    weights = None if weights in (None, "", "none") else weights
    if weights and weights != "imagenet" and not tf.io.gfile.exists(weights):
        raise ValueError(f"--weights={weights}: no such file")
    whole_model = weights is not None and weights.endswith(".weights.h5")
    kwargs = parse_options(name, options)
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
