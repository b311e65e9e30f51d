"""Write a TFDS dataset or a folder of class sub-folders as sharded TFRecords.

    python -m data.make_tfrecords --source=tf_flowers --output=DIR/flowers --image_size=192
    python -m data.make_tfrecords --source=PHOTOS_DIR --output=DIR/photos --shards=16

Images fill image_size x image_size as the codelab's do (resized so the shorter side
is image_size, aspect ratio kept, then centre-cropped) and are stored as JPEG (quality
95; `--encoding=png` stores them losslessly) in the flowers codelab's format (see
data/tfrecords.py); files are named
PREFIX{shard:02d}-{count}.tfrec, with a dataset.json beside them. Train on them with
`python -m trainer.main --dataset=tfrecord:DIR/flowers*.tfrec`. Paths may be gs://
(everything goes through tf.io.gfile).

What a lossy copy costs, measured: `--jpeg_round_trip=75` passes every image once
more through JPEG at quality 75 before storing it (our CIFAR-10 copy went through
JPEG ~75 once; see docs/results.md):

    python -m data.make_tfrecords --source=cifar10 --image_size=32 --encoding=png \
        --jpeg_round_trip=75 --output=DIR/train/cifar10 --shards=8
    python -m data.make_tfrecords ... --split=test --output=DIR/test/cifar10

Exit status: 0 written; 2 a source that cannot be read (a one-line error on stderr).
"""
import json
import os
import sys
from typing import Callable, Iterator

from absl import app, flags
import tensorflow as tf

from data import files, sources, tfrecords

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


ENCODINGS = ("jpeg", "png")


def jpeg_round_trip(image: tf.Tensor, quality: int, offset: int = 4) -> tf.Tensor:
    """uint8 [H, W, 3] after one more JPEG pass at `quality`, its 8x8 blocks `offset`
    pixels off the image's own grid (reflect-padded, encoded, decoded, cropped back):
    a fresh set of compression errors, where an aligned second pass at the same
    quality would nearly repeat the first."""
    height, width = int(image.shape[0]), int(image.shape[1])
    padded = tf.pad(image, [[offset, offset], [offset, offset], [0, 0]], mode="REFLECT")
    decoded = tf.io.decode_jpeg(tf.io.encode_jpeg(padded, quality=quality), channels=3)
    return decoded[offset:offset + height, offset:offset + width]


def _encode(image: tf.Tensor, size: int, encoding: str, round_trip: int) -> bytes:
    image = fill_square(image, size)
    if round_trip:
        image = jpeg_round_trip(image, round_trip)
    if encoding == "png":
        return tf.io.encode_png(image).numpy()
    return tf.io.encode_jpeg(image, quality=95).numpy()


def _serializer(size: int, classes: list[str], encoding: str, round_trip: int
                ) -> Callable[[tf.Tensor, int, int], bytes]:
    def serialize(image: tf.Tensor, label: int, index: int) -> bytes:
        return tfrecords.serialize(_encode(image, size, encoding, round_trip), label,
                                   classes[label], index, num_classes=len(classes),
                                   size=(size, size))
    return serialize


def records_from_folder(root: str, size: int, encoding: str = "jpeg", round_trip: int = 0
                        ) -> tuple[Iterator[bytes], int, list[str]]:
    examples, classes = _folder_examples(root)
    serialize = _serializer(size, classes, encoding, round_trip)

    def generate():
        for index, (path, label) in enumerate(examples):
            try:
                image = tfrecords.decode_image(tf.io.read_file(path))
            except tf.errors.InvalidArgumentError as err:
                raise sources.DatasetError(f"cannot decode image {path}") from err
            yield serialize(image, label, index)
    return generate(), len(examples), classes


def records_from_tfds(name: str, size: int, data_dir: str | None, split: str = "",
                      encoding: str = "jpeg", round_trip: int = 0
                      ) -> tuple[Iterator[bytes], int, list[str]]:
    """The dataset's `split` (default: its training split)."""
    spec = sources.get_spec(name)
    ds, total = sources.load_tfds(name, split or spec.train_split, data_dir)
    classes = list(spec.class_names)
    serialize = _serializer(size, classes, encoding, round_trip)

    def generate():
        for index, (image, label) in enumerate(ds):
            yield serialize(image, int(label), index)
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
    flags.DEFINE_string("split", "", "A TFDS source's split (default: its training "
                        "split), e.g. test.")
    flags.DEFINE_enum("encoding", "jpeg", ENCODINGS, "How images are stored: jpeg "
                      "(quality 95) or png (lossless).")
    flags.DEFINE_integer("jpeg_round_trip", 0, "If > 0: pass each image once more "
                         "through JPEG at this quality (blocks 4 px off the image grid) "
                         "before storing it, to measure what compression costs.",
                         lower_bound=0, upper_bound=100)
    flags.mark_flags_as_required(["source", "output"])


def write(source: str, output: str, image_size: int, shards: int,
          data_dir: str | None, split: str = "", encoding: str = "jpeg",
          round_trip: int = 0) -> list[str]:
    """Writes the shards and their dataset.json; returns the shards' paths."""
    if encoding not in ENCODINGS:
        raise sources.DatasetError(f"encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    if tf.io.gfile.isdir(source):
        if split:
            raise sources.DatasetError(f"--split={split!r} is for a TFDS source; a "
                                       f"folder of class folders has one set of images")
        records, total, classes = records_from_folder(source, image_size, encoding,
                                                      round_trip)
        tfds_name = ""
    elif source in sources.names():
        split = split or sources.get_spec(source).train_split
        records, total, classes = records_from_tfds(source, image_size, data_dir, split,
                                                    encoding, round_trip)
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
            "records": total, "holdout_fraction": holdout, "files": len(paths),
            "split": split, "encoding": encoding, "jpeg_round_trip": round_trip}
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
                      FLAGS.data_dir, FLAGS.split, FLAGS.encoding, FLAGS.jpeg_round_trip)
    except sources.DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except files.WriteError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)
    records = sum(tfrecords.record_count(path) for path in paths)
    print(f"wrote {records} records in {len(paths)} files: {paths[0]} ... {paths[-1]}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
