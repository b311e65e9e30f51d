"""Write a TFDS dataset or a folder of class sub-folders as sharded TFRecords.

    python -m data.make_tfrecords --source=tf_flowers --output=DIR/flowers --image_size=192
    python -m data.make_tfrecords --source=PHOTOS_DIR --output=DIR/photos --shards=16

Images are resized to image_size x image_size and stored as JPEG (quality 95), in
the flowers codelab's format (see data/tfrecords.py); files are named
PREFIX{shard:02d}-{count}.tfrec, with a dataset.json beside them. Train on them with
`python -m trainer.main --dataset=tfrecord:DIR/flowers*.tfrec`.
"""
import argparse
import json
import os
from typing import Iterator

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True,
                        help="a TFDS name (tf_flowers) or a folder of class folders")
    parser.add_argument("--output", required=True, help="file prefix, e.g. out/flowers")
    parser.add_argument("--image_size", type=int, default=192)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--data_dir", default=None, help="TFDS data dir")
    args = parser.parse_args()
    if os.path.isdir(args.source):
        records, total, classes = records_from_folder(args.source, args.image_size)
        source = ""
    else:
        records, total, classes = records_from_tfds(args.source, args.image_size,
                                                    args.data_dir)
        source = args.source
    paths = tfrecords.write_shards(records, total, args.output, args.shards)
    holdout = sources.get_spec(source).holdout_fraction if source else 0.15
    meta = {"source": source, "class_names": classes, "image_size": args.image_size,
            "records": total, "holdout_fraction": holdout, "files": len(paths)}
    with open(os.path.join(os.path.dirname(args.output) or ".",
                           sources.TFRECORD_METADATA), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {total} records in {len(paths)} files: {paths[0]} ... {paths[-1]}")


if __name__ == "__main__":
    main()
