"""Export a trained run as a SavedModel for serving:

    python -m trainer.serving.export --model_dir=DIR --export_dir=OUT

Signatures, each returning what the run's task serves (classification:
`probabilities` [N, classes], `class_index` [N] and `class_name` [N], with the
run's test-time augmentation; autoencoder: `reconstruction` uint8 [N, H, W, 3]):
- `serving_default(image_bytes: string [N])`: encoded JPEG, PNG, GIF or BMP images
  of any size;
- `predict_images(images: uint8 [N, H, W, 3])`: decoded images of any one size.
Both resize to the model's size and normalize exactly as evaluation does, so
clients send plain pixels. Load with `tf.saved_model.load(OUT)`.

With `--tflite`, OUT also holds model.tflite, for the stock `tf.lite.Interpreter`
with builtin ops alone: uint8 [1, size, size, 3] at the model's size (the client
resizes) -> the same numeric outputs (trainer/serving/tflite.py), and labels.txt,
the class names. Before anything is written the file is checked against the
SavedModel's predict_images on a few of the run's test images: a float output
further than 1e-4 from it is one `error:` line, exit 7, and nothing written.
"""
import os
import sys
import time
from typing import Callable

from trainer import cli  # noqa: E402

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags, logging  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import augment, files, sources  # noqa: E402
from trainer import checkpoints, inputs, locks  # noqa: E402
from trainer.serving import inference, tflite as tflite_lib  # noqa: E402
from trainer.settings import message_of  # noqa: E402

FLAGS = flags.FLAGS


def _to_model_size(images: tf.Tensor, size: int, central: bool = False) -> tf.Tensor:
    """uint8 [N, H, W, 3] -> uint8 [N, size, size, 3], as in evaluation: resized
    (data.augment.make_resize) and untouched when already that size, or (central)
    the central 224/256 crop resized, as ImageNet-style runs are evaluated."""
    if central:
        box = augment.central_box(tf.shape(images)[1:3])
        cropped = images[:, box[0]:box[0] + box[2], box[1]:box[1] + box[3]]
        return tf.ensure_shape(augment.resized_uint8(cropped, size), [None, size, size, 3])
    same = tf.reduce_all(tf.equal(tf.shape(images)[1:3], [size, size]))
    resized = tf.cond(same, lambda: images,
                      lambda: augment.make_resize(size)(images, None)[0])
    return tf.ensure_shape(resized, [None, size, size, 3])


def serving_functions(trained: inference.TrainedModel) -> dict:
    """name -> (function, input signature) for the SavedModel."""
    size, presenter, model = trained.image_size, trained.presenter, trained.model
    central = inputs.central_crop(trained.data)

    def predict_images(images):
        return presenter.serve_images(model, _to_model_size(images, size, central))

    def decode_one(data):
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        return _to_model_size(image[None], size, central)[0]

    def serve_bytes(image_bytes):
        images = tf.map_fn(decode_one, image_bytes,
                           fn_output_signature=tf.TensorSpec([size, size, 3], tf.uint8))
        return presenter.serve_images(model, images)

    return {"serving_default": (serve_bytes, [tf.TensorSpec([None], tf.string,
                                                            name="image_bytes")]),
            "predict_images": (predict_images, [tf.TensorSpec([None, None, None, 3],
                                                              tf.uint8, name="images")])}


TFLITE_MISMATCH_EXIT_CODE = 7  # --tflite: the file would not serve as the SavedModel


def export(model_dir: str, export_dir: str, tflite: bool = False,
           say: Callable[[str], None] | None = None) -> str:
    """Writes the SavedModel of the run in model_dir (with `tflite`, model.tflite
    and labels.txt in it too, checked); returns export_dir. `say` gets the lines
    that tell what was written (main: print)."""
    files.refuse_links(export_dir, (model_dir,), "--export_dir")
    if tf.io.gfile.exists(export_dir) and tf.io.gfile.listdir(export_dir):
        raise inference.InferenceError(f"--export_dir={export_dir} exists and is not "
                                       f"empty; choose a new directory")
    trained = inference.TrainedModel(model_dir)
    checkpoints.check_finite([(v.path, v) for v in trained.model.weights],
                             f"the SavedModel {export_dir}")
    # (Before anything is written: a run the file cannot serve is refused here.)
    tflite_function = tflite_lib.serving_function(trained) if tflite else None
    archive = keras.export.ExportArchive()
    archive.track(trained.model)
    functions = trained.presenter.export_functions(
        trained.model, serving_functions(trained) if trained.presenter.serves_images
        else {})
    for name, (fn, signature) in functions.items():
        archive.add_endpoint(name, fn, input_signature=signature)
    # Whole or not at all: written beside export_dir, then renamed to it. The
    # temporary names its writer, so that a later export removes it if killed.
    files.make_parent(export_dir, "--export_dir")  # (a new place: as mkdir -p)
    _remove_killed_exports(export_dir)
    with files.written_whole(export_dir) as tmp:
        tf.io.gfile.makedirs(tmp)
        files.write_json(os.path.join(tmp, _WRITER_FILE), locks.writer_record())
        archive.write_out(tmp, verbose=False)
        written = (_write_tflite(trained, tflite_function, tmp, export_dir)
                   if tflite_function else [])
        tf.io.gfile.remove(os.path.join(tmp, _WRITER_FILE))
    for line in (f"wrote SavedModel {export_dir}", *written) if say else ():
        say(line)
    return export_dir


def _write_tflite(trained: inference.TrainedModel, function, tmp: str,
                  export_dir: str) -> list[str]:
    """Converts `function`, checks the file against the SavedModel written in tmp
    (MismatchError if it disagrees) and writes it there, with labels.txt; the
    lines that say so."""
    data = tflite_lib.convert(function)
    signatures = tf.saved_model.load(tmp).signatures
    if "predict_images" not in signatures:  # (a research presenter's own signatures)
        raise tflite_lib.TFLiteError("the SavedModel has no predict_images signature to "
                                     "check model.tflite against: export it without "
                                     "--tflite")
    images, which = tflite_lib.check_images(trained)
    expected = {key: value.numpy() for key, value in
                signatures["predict_images"](images=tf.constant(images)).items()}
    got = tflite_lib.run(data, images)
    differences = tflite_lib.largest_differences(got, expected)
    shown = ", ".join(f"{key} {value:.1e}" for key, value in differences.items())
    if not tflite_lib.within_tolerance(differences, got):
        raise tflite_lib.MismatchError(
            f"model.tflite does not give the SavedModel's outputs: max |TFLite - "
            f"SavedModel| on {which}: {shown} (at most {tflite_lib.TOLERANCE:g}, a "
            f"uint8 output 1); nothing written (without --tflite: the SavedModel alone)")
    with tf.io.gfile.GFile(os.path.join(tmp, tflite_lib.FILE), "wb") as f:
        f.write(data)
    labels = tflite_lib.labels(trained)
    if labels:
        with tf.io.gfile.GFile(os.path.join(tmp, tflite_lib.LABELS_FILE), "w") as f:
            f.write(labels)
    size = trained.image_size
    return [f"wrote {os.path.join(export_dir, tflite_lib.FILE)} ({len(data) / 1e6:.2f} MB, "
            f"float32): uint8 [1, {size}, {size}, 3] (resize to {size}x{size} first) -> "
            f"{', '.join(got)}"
            + (f"; class names: {os.path.join(export_dir, tflite_lib.LABELS_FILE)}"
               if labels else ""),
            f"  checked: max |TFLite - SavedModel| on {which}: {shown}"]


_WRITER_FILE = "export_writer.json"  # in an export's temporary, until it is renamed


def _remove_killed_exports(export_dir: str) -> None:
    """Removes the temporaries beside export_dir of exports to it that were killed
    (kill -9, a lost machine) before they finished: those whose writer is gone, or
    without a writer record after a minute (killed as it began)."""
    parent, name = os.path.split(export_dir.rstrip("/"))
    for entry in (e.rstrip("/") for e in tf.io.gfile.listdir(parent or ".")):
        path = os.path.join(parent, entry)
        if (not entry.startswith(f"{name}.tmp-") or not files.is_temporary(entry)
                or os.path.islink(path)):
            continue
        writer = os.path.join(path, _WRITER_FILE)
        try:
            gone = locks.writer_gone(files.read_json(writer))
        except files.BadFileError:  # none (yet), or cut short
            gone = time.time() - tf.io.gfile.stat(path).mtime_nsec / 1e9 > 60
        if gone:
            tf.io.gfile.rmtree(path)
            logging.warning("removed %s, left by an export that did not finish", path)


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """export's flags, both required (defining twice is a no-op; --model_dir shares
    its name with trainer.main's, and is required only where export defines it).
    A test calls this inside absl.testing.flagsaver: a required flag left defined
    would fail every later parse of FLAGS in the process."""
    cli.import_user_code(flag_values, sys.argv)
    cli.define_flag(flag_values, flags.DEFINE_boolean, "tflite", False, "Also write "
                    "model.tflite (float32, TFLite's builtin ops alone: uint8 [1, size, "
                    "size, 3] at the model's size -> the outputs, normalization and "
                    "test-time augmentation inside) and labels.txt into --export_dir, "
                    "checked against the SavedModel first (exit 7 if they disagree).")
    for name, text in (("model_dir", "A training run's directory (one that has not "
                        "finished: its best.weights.h5, else its newest checkpoint)."),
                       ("export_dir", "New directory to write the SavedModel to.")):
        if cli.define_flag(flag_values, flags.DEFINE_string, name, None, text):
            flags.mark_flag_as_required(name, flag_values)


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    tf.config.set_visible_devices([], "GPU")
    try:
        export(FLAGS.model_dir, FLAGS.export_dir, FLAGS.tflite, say=print)
    except files.WriteError as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(5)
    except tflite_lib.MismatchError as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(TFLITE_MISMATCH_EXIT_CODE)
    except (inference.InferenceError, tflite_lib.TFLiteError, sources.DatasetError,
            checkpoints.CheckpointError, checkpoints.NonFiniteError,
            ValueError) as err:  # (files.LinkError too)
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
