"""A run's serving as a TFLite file that the stock `tf.lite.Interpreter` runs with
TFLite's builtin ops alone (no Select TF ops, no custom ops): export's `--tflite`.

The file takes one uint8 image at the model's size, [1, size, size, 3] (the client
resizes: the SavedModel's antialiased resize, tf.ScaleAndTranslate, is neither a
builtin nor a Select TF op), and does the rest inside: what `predict_images` does
to an image of that size (a run evaluated on the central 224/256 crop takes that
crop and its plain bilinear resize, as predict_images does), the run's
normalization, the task's test-time augmentation, the model in float32 and the
presenter's numeric outputs (classification: `probabilities` [1, classes] and
`class_index` [1]). TFLite carries no strings: the class names go to labels.txt
beside it, line i naming class i.
"""
import contextlib
import functools
import re
from typing import Iterator
import warnings

import keras
import numpy as np
import tensorflow as tf
# Private: TFLite's converter leaves a Keras 3 model's variables as VAR_HANDLE ops
# without their values (NaN out), from a concrete function or a SavedModel alike;
# made constants first, they are folded (batch-norm into the convolutions).
# tests/test_private_apis.py checks it.
from tensorflow.python.framework import convert_to_constants

from data import augment, quiet, sources
from models import fused
from trainer import inputs
from trainer.serving import inference

FILE, LABELS_FILE = "model.tflite", "labels.txt"
TOLERANCE = 1e-4   # the most |TFLite - SavedModel| of a float output may be
CHECK_IMAGES = 8   # export checks the file on this many of the run's test images


class TFLiteError(RuntimeError):
    """The run cannot be served by TFLite's builtin ops; the message says why."""


class MismatchError(RuntimeError):
    """The converted file does not give the SavedModel's outputs."""


def serving_function(trained: inference.TrainedModel):
    """The concrete function the file is made of: uint8 [1, size, size, 3] ->
    the presenter's numeric outputs, as predict_images serves an image of that
    size."""
    if not trained.presenter.serves_images:
        raise TFLiteError(f"a {trained.config.task} run serves no images, and --tflite "
                          f"converts the image serving: export it without --tflite")
    size, presenter, model = trained.image_size, trained.presenter, trained.model
    crop = None
    if inputs.central_crop(trained.data):  # (the box of a size x size image: constant)
        crop = [int(v) for v in augment.central_box(tf.constant([size, size])).numpy()]

    def serve(images):
        if crop:  # (in float32: TFLite resizes no uint8 to float; the same values)
            top, left, side, _ = crop
            images = augment.resized_uint8(
                tf.cast(images[:, top:top + side, left:left + side], tf.float32), size)
        served = presenter.serve_images(model, images)
        return {key: value for key, value in served.items() if value.dtype != tf.string}

    with _builtin_activations(model):
        return tf.function(serve, input_signature=[
            tf.TensorSpec([1, size, size, 3], tf.uint8, name="images")
        ]).get_concrete_function()


# An activation TFLite has no builtin for -> the same function in the form its
# converter makes a builtin of: models/fused.py's exact GELU (tf.math.erf, one XLA
# kernel) -> Keras' own, TFLite's GELU (equal to 1e-6; export's check covers it).
_BUILTIN_ACTIVATIONS = {fused.gelu: functools.partial(keras.activations.gelu,
                                                      approximate=False)}


@contextlib.contextmanager
def _builtin_activations(model: keras.Model) -> Iterator[None]:
    """Traced inside, the model's activation layers use _BUILTIN_ACTIVATIONS' forms."""
    swapped = []
    for layer in _all_layers(model):
        if (isinstance(layer, keras.layers.Activation)
                and layer.activation in _BUILTIN_ACTIVATIONS):
            swapped.append((layer, layer.activation))
            layer.activation = _BUILTIN_ACTIVATIONS[layer.activation]
    try:
        yield
    finally:
        for layer, activation in swapped:
            layer.activation = activation


def _all_layers(model: keras.Model) -> Iterator[keras.layers.Layer]:
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)


def convert(function) -> bytes:
    """The float32 TFLite file of `function` (a concrete function of uint8 images),
    builtin ops only; TFLiteError naming the ops that are not."""
    frozen = convert_to_constants.convert_variables_to_constants_v2(function)
    # Freezing flattens the outputs; named again, they name the file's signature's.
    named = tf.function(
        lambda images: tf.nest.pack_sequence_as(function.structured_outputs,
                                                frozen(images)),
        input_signature=function.structured_input_signature[0]).get_concrete_function()
    # (A trackable object, even an empty one, keeps the signature: without it the
    # converter's frozen-graph path drops the names.)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([named], tf.Module())
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    converter.allow_custom_ops = False
    try:
        with quiet.native_stderr_muted(unless_verbose=True):  # (what fails is raised)
            return converter.convert()
    except Exception as err:  # (its ConverterError is not public)
        ops = sorted(set(re.findall(r"'tf\.(\w+)' op is neither", str(err))))
        if not ops:
            raise
        raise TFLiteError(f"the model uses TensorFlow ops that TFLite has no builtin "
                          f"for: {', '.join(ops)}; export it without --tflite") from err


def interpreter(data: bytes) -> tf.lite.Interpreter:
    """The stock interpreter on `data`, its tensors allocated (this fails on a
    custom or Select TF op)."""
    # (Quiet: its deprecation notice, and "INFO: Created TensorFlow Lite XNNPACK
    # delegate for CPU" from its C++ whatever TensorFlow's log level.)
    with warnings.catch_warnings(), quiet.native_stderr_muted(unless_verbose=True):
        warnings.simplefilter("ignore", UserWarning)
        runner = tf.lite.Interpreter(model_content=data)
        runner.allocate_tensors()
    return runner


def run(data: bytes, images: np.ndarray) -> dict[str, np.ndarray]:
    """The file's outputs for uint8 images [N, size, size, 3], one at a time."""
    runner = interpreter(data).get_signature_runner()
    rows = [runner(images=image[None]) for image in images]
    return {key: np.concatenate([row[key] for row in rows]) for key in rows[0]}


def largest_differences(tflite: dict[str, np.ndarray], saved_model: dict
                        ) -> dict[str, float]:
    """max |TFLite - SavedModel| of each output compared: the float ones, and the
    uint8 ones (pixels, e.g. a reconstruction); an index (class_index) is the
    argmax of a float output compared, and a near tie may flip it."""
    return {key: float(np.max(np.abs(value.astype(np.float64)
                                     - np.asarray(saved_model[key], np.float64))))
            for key, value in tflite.items()
            if value.dtype.kind == "f" or value.dtype == np.uint8}


def within_tolerance(differences: dict[str, float], tflite: dict[str, np.ndarray]) -> bool:
    """Floats within TOLERANCE; uint8 outputs within one level (the rounding of
    a value a float's last bits put on either side of .5)."""
    return all(difference <= (1 if tflite[key].dtype == np.uint8 else TOLERANCE)
               for key, difference in differences.items())


def check_images(trained: inference.TrainedModel, count: int = CHECK_IMAGES
                 ) -> tuple[np.ndarray, str]:
    """(uint8 [count, size, size, 3], what they are): the first images of the run's
    test split, prepared as evaluation does; random images if it cannot be read
    here (never downloaded)."""
    data, size = trained.data, trained.image_size
    try:
        ds, _ = sources.load(data.spec, data.spec.eval_split, data.settings.data_dir)
        images = [inputs.eval_image(data, example[0].numpy()) for example in ds.take(count)]
        if images:
            return np.stack(images), f"{len(images)} {data.spec.name} test images"
    except (sources.DatasetError, tf.errors.OpError, OSError, ValueError, ImportError):
        pass
    images = np.random.default_rng(0).integers(0, 256, (count, size, size, 3), np.uint8)
    return images, f"{count} random images ({data.spec.name}'s test split is not readable here)"


def labels(trained: inference.TrainedModel) -> str | None:
    """labels.txt's text for a presenter with class names (classification's): TFLite
    carries no strings, so its class_name output is not in the file."""
    names = getattr(trained.presenter, "class_names", None)
    return "".join(f"{name}\n" for name in names) if names else None
