"""Write a TFDS dataset or a folder of class sub-folders as sharded TFRecords.

    python -m data.make_tfrecords --source=tf_flowers --output=DIR/flowers --image_size=192
    python -m data.make_tfrecords --source=PHOTOS_DIR --output=DIR/photos --shards=16

Images fill image_size x image_size as the codelab's do (resized so the shorter side
is image_size, aspect ratio kept, then centre-cropped) and are stored as JPEG (quality
95) in the flowers codelab's format (see data/tfrecords.py); files are named
PREFIX{shard:02d}-{count}.tfrec, with a dataset.json beside them. Train on them with
`python -m trainer.main --dataset=tfrecord:DIR/flowers*.tfrec`. Paths may be gs://
(everything goes through tf.io.gfile).

Exit status: 0 written; 2 a source that cannot be read (a one-line error on stderr).
"""
import json
import os
import sys
from typing import Iterator

from absl import app, flags
import tensorflow as tf

from data import sources, tfrecords

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def _listdir(path: str) -> list[str]:
    # GCS lists sub-folders with a trailing "/".
    return sorted(name.rstrip("/") for name in tf.io.gfile.listdir(path))


def _folder_examples(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    classes = [d for d in _listdir(root) if tf.io.gfile.isdir(os.path.join(root, d))]
    if not classes:
        raise sources.DatasetError(f"{root} has no class sub-folders of images")
    examples = [(os.path.join(root, name, f), label) for label, name in enumerate(classes)
                for f in _listdir(os.path.join(root, name))
                if f.lower().endswith(IMAGE_EXTENSIONS)]
    return examples, classes


def fill_square(image: tf.Tensor, size: int) -> tf.Tensor:
    """uint8 [H, W, 3] -> uint8 [size, size, 3] as the codelab makes its TFRecords: the
    shorter side resized to `size` keeping the aspect ratio, then the middle square
    cut out (no distortion, no black bars)."""
    height, width = int(image.shape[0]), int(image.shape[1])
    scale = size / min(height, width)
    new_height, new_width = max(size, round(height * scale)), max(size, round(width * scale))
    image = tf.image.resize(image, (new_height, new_width), antialias=True)
    top, left = (new_height - size) // 2, (new_width - size) // 2
    image = image[top:top + size, left:left + size]
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def _encode(image: tf.Tensor, size: int) -> bytes:
    return tf.io.encode_jpeg(fill_square(image, size), quality=95).numpy()


def _serialize(image: tf.Tensor, size: int, label: int, classes: list[str],
               index: int) -> bytes:
    return tfrecords.serialize(_encode(image, size), label, classes[label], index,
                               num_classes=len(classes), size=(size, size))


def records_from_folder(root: str, size: int) -> tuple[Iterator[bytes], int, list[str]]:
    examples, classes = _folder_examples(root)

    def generate():
        for index, (path, label) in enumerate(examples):
            try:
                image = tfrecords.decode_image(tf.io.read_file(path))
            except tf.errors.InvalidArgumentError as err:
                raise sources.DatasetError(f"cannot decode image {path}") from err
            yield _serialize(image, size, label, classes, index)
    return generate(), len(examples), classes


def records_from_tfds(name: str, size: int, data_dir: str | None
                      ) -> tuple[Iterator[bytes], int, list[str]]:
    spec = sources.get_spec(name)
    ds, total = sources.load_tfds(name, spec.train_split, data_dir)
    classes = list(spec.class_names)

    def generate():
        for index, (image, label) in enumerate(ds):
            yield _serialize(image, size, int(label), classes, index)
    return generate(), total, classes


FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a command: importing this module (tests, conftest)
    must not claim flag names such as --data_dir that trainer.main also defines."""
    flags.DEFINE_string("source", None,
                        "A TFDS name (tf_flowers) or a folder of class folders.")
    flags.DEFINE_string("output", None, "File prefix, e.g. out/flowers.")
    flags.DEFINE_integer("image_size", 192, "Images are resized to this square size.",
                         lower_bound=1)
    flags.DEFINE_integer("shards", 16, "Number of files to write.", lower_bound=1)
    flags.DEFINE_string("data_dir", None, "TFDS data dir.")
    flags.mark_flags_as_required(["source", "output"])


def write(source: str, output: str, image_size: int, shards: int,
          data_dir: str | None) -> list[str]:
    """Writes the shards and their dataset.json; returns the shards' paths."""
    if tf.io.gfile.isdir(source):
        records, total, classes = records_from_folder(source, image_size)
        tfds_name = ""
    elif source in sources.names():
        records, total, classes = records_from_tfds(source, image_size, data_dir)
        tfds_name = source
    else:
        raise sources.DatasetError(
            f"--source={source!r} is neither a folder of class folders nor a dataset "
            f"({', '.join(sources.names())})")
    if not total:
        raise sources.DatasetError(f"{source} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    paths = tfrecords.write_shards(records, total, output, shards)
    holdout = (sources.get_spec(tfds_name).holdout_fraction if tfds_name
               else sources.DEFAULT_HOLDOUT)
    meta = {"source": tfds_name, "class_names": classes, "image_size": image_size,
            "records": total, "holdout_fraction": holdout, "files": len(paths)}
    with tf.io.gfile.GFile(os.path.join(tfrecords.directory(output),
                                        sources.TFRECORD_METADATA), "w") as f:
        json.dump(meta, f, indent=2)
    return paths


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value",
              file=sys.stderr)
        sys.exit(2)
    try:
        paths = write(FLAGS.source, FLAGS.output, FLAGS.image_size, FLAGS.shards,
                      FLAGS.data_dir)
    except sources.DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    records = sum(tfrecords.record_count(path) for path in paths)
    print(f"wrote {records} records in {len(paths)} files: {paths[0]} ... {paths[-1]}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
