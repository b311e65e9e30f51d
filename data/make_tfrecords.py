"""Write a TFDS dataset or a folder of class sub-folders as sharded TFRecords.

    python -m data.make_tfrecords --source=tf_flowers --output=DIR/flowers --image_size=192
    python -m data.make_tfrecords --source=PHOTOS_DIR --output=DIR/photos --shards=16

Images are resized to image_size x image_size and stored as JPEG (quality 95), in
the flowers codelab's format (see data/tfrecords.py); files are named
PREFIX{shard:02d}-{count}.tfrec, with a dataset.json beside them. Train on them with
`python -m trainer.main --dataset=tfrecord:DIR/flowers*.tfrec`.

Exit status: 0 written; 2 a source that cannot be read (a one-line error on stderr).
"""
import json
import os
import sys
from typing import Iterator

from absl import app, flags
import tensorflow as tf

from data import augment, sources, tfrecords

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def _folder_examples(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise sources.DatasetError(f"{root} has no class sub-folders of images")
    examples = [(os.path.join(root, name, f), label) for label, name in enumerate(classes)
                for f in sorted(os.listdir(os.path.join(root, name)))
                if f.lower().endswith(IMAGE_EXTENSIONS)]
    return examples, classes


def _encode(image: tf.Tensor, size: int) -> bytes:
    image, _ = augment.make_resize(size)(image, None)
    return tf.io.encode_jpeg(image, quality=95).numpy()


def records_from_folder(root: str, size: int) -> tuple[Iterator[bytes], int, list[str]]:
    examples, classes = _folder_examples(root)

    def generate():
        for index, (path, label) in enumerate(examples):
            try:
                image = tfrecords.decode_image(tf.io.read_file(path))
            except tf.errors.InvalidArgumentError as err:
                raise sources.DatasetError(f"cannot decode image {path}") from err
            yield tfrecords.serialize(_encode(image, size), label, classes[label], index)
    return generate(), len(examples), classes


def records_from_tfds(name: str, size: int, data_dir: str | None
                      ) -> tuple[Iterator[bytes], int, list[str]]:
    spec = sources.get_spec(name)
    ds, total = sources.load_tfds(name, spec.train_split, data_dir)

    def generate():
        for index, (image, label) in enumerate(ds):
            label = int(label)
            yield tfrecords.serialize(_encode(image, size), label, spec.class_names[label],
                                      index)
    return generate(), total, list(spec.class_names)


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
    if os.path.isdir(source):
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
    holdout = sources.get_spec(tfds_name).holdout_fraction if tfds_name else 0.15
    meta = {"source": tfds_name, "class_names": classes, "image_size": image_size,
            "records": total, "holdout_fraction": holdout, "files": len(paths)}
    with open(os.path.join(os.path.dirname(output) or ".",
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
