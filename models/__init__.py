"""The model registry: every model is one file in this folder whose builder is
decorated with `@models.register(name, outputs=...)`. Every module here is imported
with the package, so a new model is one new file: no table to edit, and the tests
(tests/test_models.py) iterate over the registry.

A model declares what it outputs, so a task can refuse a model that does not fit
it with one line (trainer/tasks):
- LOGITS: float32 logits [B, classes] (no softmax), whatever the mixed-precision
  policy; the builder takes `num_classes`.
- HEADS: a dict of float32 logits with the main head under "logits" (e.g.
  resnet_aux: also "aux_logits"); the builder takes `num_classes`.
- IMAGE: an image of the input's shape (e.g. an autoencoder's reconstruction);
  the builder takes no `num_classes`.
- GENERATOR: an image of `input_shape` (the data's shape) made from a latent
  vector, its input (e.g. a GAN's generator); the builder takes no `num_classes`.

A model also declares its input contract (`input_range`): what the pipeline feeds
it. STANDARDIZED (every built-in model): per channel (x - mean) / std with the
dataset's mean and std; UNIT: [0, 1]; SYMMETRIC: [-1, 1]; PIXELS: [0, 255] as
floats (a keras.applications model that rescales its input itself, e.g.
EfficientNet). Training, evaluation, predict and export all normalize the same way.

A Keras model of your own (functional, Sequential, subclassed, keras.applications,
a keras_hub backbone with a head) registers with one call, `register_keras(name,
make, ...)`, e.g. in a module given with --import.

Builders share one signature, `build([num_classes,] input_shape, tiny=False,
**options)`: `tiny=True` gives a small variant of the same architecture for tests;
the options are the builder's own keyword arguments, given on the command line as
`--model_options=name=value,...` (e.g. `widths=32:64:128,whiten=false`).
"""
import dataclasses
import functools
import importlib
import inspect
import pkgutil
from typing import Callable

import keras
import tensorflow as tf

Builder = Callable[..., keras.Model]

LOGITS, HEADS, IMAGE, GENERATOR = "logits", "heads", "image", "generator"
OUTPUT_KINDS = {LOGITS: "logits", HEADS: "a dict of heads with the main logits under "
                "'logits'", IMAGE: "an image of the input's shape",
                GENERATOR: "an image of the data's shape from a latent vector"}


STANDARDIZED, UNIT, SYMMETRIC, PIXELS = "standardized", "unit", "symmetric", "pixels"
INPUT_RANGES = {STANDARDIZED: "per-channel (x - mean) / std with the dataset's mean "
                "and std", UNIT: "[0, 1]", SYMMETRIC: "[-1, 1]",
                PIXELS: "[0, 255] as floats"}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    builder: Builder
    outputs: str          # LOGITS | HEADS | IMAGE
    min_image_size: int   # the smallest square input the full model accepts
    input_range: str = STANDARDIZED


def input_normalization(name: str, dataset_mean: tuple, dataset_std: tuple
                        ) -> tuple[tuple, tuple]:
    """(mean, std) per channel, of images scaled to [0, 1], that turn the data into
    what model `name` declares it takes (x -> (x - mean) / std)."""
    input_range = entry(name).input_range
    if input_range == STANDARDIZED:
        return tuple(dataset_mean), tuple(dataset_std)
    mean, std = {UNIT: (0.0, 1.0), SYMMETRIC: (0.5, 0.5), PIXELS: (0.0, 1 / 255)}[
        input_range]
    return (mean,) * len(dataset_mean), (std,) * len(dataset_std)


_REGISTRY: dict[str, ModelEntry] = {}


def register(name: str, outputs: str = LOGITS, min_image_size: int = 32,
             builder: Builder | None = None, input_range: str = STANDARDIZED):
    """`@register("my_net")` above a builder adds it as --model=my_net. With
    `builder=` it registers that callable (e.g. a functools.partial variant) and
    returns it."""
    if outputs not in OUTPUT_KINDS:
        raise ValueError(f"model {name}: outputs={outputs!r}; use one of "
                         f"{', '.join(OUTPUT_KINDS)}")
    if input_range not in INPUT_RANGES:
        raise ValueError(f"model {name}: input_range={input_range!r}; use one of "
                         f"{', '.join(INPUT_RANGES)}")

    def add(function: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name].builder is not function:
            raise ValueError(f"two models are registered as {name!r}")
        _REGISTRY[name] = ModelEntry(name, function, outputs, min_image_size, input_range)
        return function
    return add(builder) if builder is not None else add


def register_keras(name: str, make: Callable[..., keras.Model], outputs: str = LOGITS,
                   input_range: str = STANDARDIZED, min_image_size: int = 32) -> Builder:
    """Registers any Keras model as --model=`name`, in one call:

        models.register_keras("mnv3small", lambda input_shape, num_classes:
            keras.applications.MobileNetV3Small(
                input_shape=input_shape, weights=None, classes=num_classes,
                include_preprocessing=False, classifier_activation=None),
            input_range=models.UNIT)

    make(input_shape, num_classes) (no num_classes for IMAGE/GENERATOR outputs;
    `tiny` too if it takes it; its other keyword arguments are
    --model_options) returns a functional, Sequential or subclassed model. It is
    made a functional model on keras.Input(input_shape) (what the FLOP count, the
    features and export read), with float32 outputs under mixed precision. A model
    that ends in a softmax is refused: models output logits."""
    takes = inspect.signature(make).parameters

    def builder(input_shape, tiny: bool = False, num_classes: int | None = None,
                **options) -> keras.Model:
        given = {"input_shape": tuple(input_shape), "num_classes": num_classes,
                 "tiny": tiny}
        model = make(**{k: v for k, v in given.items() if k in takes}, **options)
        return as_functional(model, tuple(input_shape), name)
    builder.__signature__ = inspect.signature(make)  # its options, for parse_options
    return register(name, outputs, min_image_size, builder, input_range)


def as_functional(model: keras.Model, input_shape: tuple[int, int, int],
                  name: str) -> keras.Model:
    """`model` as a functional model of one keras.Input with float32 outputs: a
    Sequential without an Input gets one (its layers kept as they are), a
    subclassed model is called on one."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"model {name}: its builder returned {type(model).__name__}, "
                         f"not a keras.Model")
    if isinstance(model, keras.Sequential):  # (its `output` fails even with an Input)
        sequential = keras.Sequential([keras.Input(input_shape), *model.layers],
                                      name=model.name)
        model = keras.Model(sequential.inputs[0], sequential.outputs[0], name=model.name)
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # subclassed: never called yet
        inputs = None
    wrapped = not inputs or len(inputs) != 1
    if wrapped:
        inputs = [keras.Input(input_shape, name="image")]
        outputs = model(inputs[0])
    else:
        outputs = model.outputs[0] if len(model.outputs) == 1 else model.output
    last = model.layers[-1] if getattr(model, "layers", None) else None
    if getattr(last, "activation", None) is keras.activations.softmax:
        raise ValueError(f"model {name} ends in a softmax ({last.name}); models output "
                         f"logits (keras.applications: classifier_activation=None)")
    if not keras.tree.is_nested(outputs) and outputs.dtype != "float32":
        outputs = keras.layers.Activation("linear", dtype="float32",  # (mixed
                                          name="float32_outputs")(outputs)  # precision)
        wrapped = True
    return keras.Model(inputs[0], outputs, name=model.name) if wrapped else model


def names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def entry(name: str) -> ModelEntry:
    """The registry entry of `name`; an unknown name is a ValueError listing the
    known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(names())}")
    return _REGISTRY[name]


def names_with_outputs(kinds) -> tuple[str, ...]:
    return tuple(n for n in names() if _REGISTRY[n].outputs in kinds)


def parse_keyword_options(text: str, defaults: dict, flag: str, owner: str) -> dict:
    """'widths=32:64:128,whiten=false' -> keyword arguments, each typed after its
    default in `defaults` (bool, int, float, str, a flat tuple of them as a:b:c;
    a default of None takes a number, true/false or none). An unknown or malformed
    option is a ValueError naming `flag` and the valid options of `owner`. (Also
    used for the optimizer's options.)"""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in defaults or not value:
            raise ValueError(f"{flag}: {_cut(item)} is not an option of {owner}; valid: "
                             f"{', '.join(f'{k}=VALUE' for k in defaults) or 'none'}")
        options[key] = _typed(value, defaults[key], key, flag)
    return options


def _typed(value: str, default, key: str, flag: str):
    try:
        if isinstance(default, bool) or (default is None and value.lower() in (
                "true", "false")):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if default is None:
            if value.lower() == "none":
                return None
            return int(value) if value.lstrip("-").isdigit() else float(value)
        if isinstance(default, tuple):
            return tuple(type(default[0])(v) for v in value.split(":"))
        return type(default)(value)
    except ValueError:
        raise ValueError(f"{flag}: {key}={_cut(value)} is not like the default "
                         f"{default!r}") from None


def _cut(text: str, limit: int = 80) -> str:
    """repr(text) as an error line echoes it: at most `limit` characters, and its
    length when cut ('xxxx...' (10,000,000 characters))."""
    return (repr(text) if len(text) <= limit
            else f"{text[:limit]!r}... ({len(text):,} characters)")


def parse_options(name: str, text: str) -> dict:
    """'widths=32:64:128,whiten=false' -> the builder's keyword arguments, typed
    after its defaults. An unknown or malformed option is a ValueError."""
    if not text:
        return {}
    builder = entry(name).builder
    defaults = {key: p.default for key, p in inspect.signature(builder).parameters.items()
                if key not in ("num_classes", "input_shape", "tiny", "backbone_weights")}
    if isinstance(builder, functools.partial):
        defaults.update({k: v for k, v in builder.keywords.items() if k in defaults})
    # Only what a flag can spell: bool, int, float, str, or a flat tuple of them.
    scalar = lambda v: isinstance(v, (bool, int, float, str))  # noqa: E731
    defaults = {k: v for k, v in defaults.items() if scalar(v) or (
        isinstance(v, tuple) and v and all(scalar(item) for item in v))}
    return parse_keyword_options(text, defaults, "--model_options", name)


def build(name: str, num_classes: int | None, input_shape: tuple[int, int, int],
          tiny: bool = False, weights: str | None = None, options: str = "") -> keras.Model:
    """Builds model `name`; an unknown name is a ValueError listing the known ones.

    num_classes: for LOGITS and HEADS models (ignored by IMAGE models).
    weights: None/"none" (random init); a `*.weights.h5` file saved from this model
    (e.g. a run's model.weights.h5); for xception also "imagenet" or Keras' notop
    backbone file. options: the builder's keyword arguments (see parse_options).
    """
    model_entry = entry(name)
    weights = None if weights in (None, "", "none") else weights
    if weights and weights != "imagenet" and not tf.io.gfile.exists(weights):
        raise ValueError(f"--weights={weights}: no such file")
    whole_model = weights is not None and weights.endswith(".weights.h5")
    kwargs = parse_options(name, options)
    if weights and not whole_model:
        if not takes_backbone_weights(name):
            raise ValueError(f"--weights={weights}: {name} takes only a .weights.h5 file "
                             f"saved from the same model")
        kwargs["backbone_weights"] = weights
    if model_entry.outputs not in (IMAGE, GENERATOR):
        kwargs["num_classes"] = num_classes
    model = model_entry.builder(input_shape=input_shape, tiny=tiny, **kwargs)
    if whole_model:
        try:
            model.load_weights(weights)
        except (ValueError, OSError, KeyError, TypeError) as err:  # (h5py: OSError)
            raise ValueError(f"--weights={weights} does not fit {model.name}: "
                             f"{str(err).splitlines()[0]}") from err
    return model


def takes_backbone_weights(name: str) -> bool:
    """Whether model `name` loads a pretrained backbone (--weights=imagenet or a
    backbone file, e.g. xception's): without one, it starts from random weights."""
    return "backbone_weights" in inspect.signature(entry(name).builder).parameters


def features_of(model: keras.Model) -> keras.Model:
    """A classifier's features: the model from its input to the input of its head
    (the Dense layer named "logits", else its last Dense layer), sharing weights:
    what a kNN evaluation or a Fréchet distance compares."""
    names = {layer.name: layer for layer in model.layers}
    head = names.get("logits")
    if not isinstance(head, keras.layers.Dense):
        dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
        if not dense:
            raise ValueError(f"{model.name} has no Dense head to take features before")
        head = dense[-1]
    return keras.Model(model.inputs, head.input, name=f"{model.name}_features")


# Every model file registers itself when imported; import them all.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from models.layers import init_from_data, needs_data  # noqa: E402,F401 (the loop's)
