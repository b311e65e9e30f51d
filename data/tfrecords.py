"""TFRecords in the flowers codelab's format: one tf.train.Example per image with the
encoded image bytes, the integer class and the class name, sharded into files whose
names carry their record count (`flowers00-230.tfrec`), so nothing has to be read to
count them. We also store the example's index in its source, so a held-out split
made by index (data.sources.in_holdout) is the same from TFDS and from TFRecords.
"""
import glob
import math
import os
import re
from typing import Iterable

import tensorflow as tf

from data.errors import DatasetError

FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "class": tf.io.FixedLenFeature([], tf.int64),
    "label": tf.io.FixedLenFeature([], tf.string, default_value=""),
    "index": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
}
_COUNT = re.compile(r"-(\d+)\.tfrec$")


def shard_path(prefix: str, shard: int, count: int) -> str:
    return f"{prefix}{shard:02d}-{count}.tfrec"


def record_count(path: str) -> int:
    match = _COUNT.search(path)
    if not match:
        raise DatasetError(f"cannot count the records of {path}: TFRecord file names must "
                           f"end in -COUNT.tfrec, as python -m data.make_tfrecords writes")
    return int(match.group(1))


def serialize(image_bytes: bytes, class_id: int, class_name: str, index: int) -> bytes:
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image_bytes])),
        "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[class_id])),
        "label": tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[class_name.encode()])),
        "index": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_shards(records: Iterable[bytes], total: int, prefix: str,
                 num_shards: int) -> list[str]:
    """Writes serialized examples round-robin-free, in order, into `num_shards` files."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    per_shard = math.ceil(total / num_shards)
    paths, records = [], iter(records)
    for shard in range(num_shards):
        count = min(per_shard, total - shard * per_shard)
        if count <= 0:
            break
        path = shard_path(prefix, shard, count)
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(count):
                writer.write(next(records))
        paths.append(path)
    return paths


def decode_image(image_bytes: tf.Tensor) -> tf.Tensor:
    """JPEG (also CMYK and grayscale), PNG, GIF or BMP bytes -> uint8 RGB [H, W, 3]."""
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    example = tf.io.parse_single_example(record, FEATURES)
    return (decode_image(example["image"]), tf.cast(example["class"], tf.int32),
            example["index"])


def files(pattern: str) -> list[str]:
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise DatasetError(f"no TFRecord files match {pattern!r}; check the path, or write "
                           f"them with python -m data.make_tfrecords")
    return paths


def load(pattern: str, num_workers: int = 1,
         worker: int = 0) -> tuple[tf.data.Dataset, int]:
    """(dataset of (image, class, index), total record count from the file names).

    Files are read in parallel (interleaved in a fixed order). With several input
    workers each reads its own files when there are enough of them, else every
    num_workers-th record.
    """
    paths = files(pattern)
    total = sum(record_count(path) for path in paths)
    by_files = num_workers > 1 and len(paths) >= num_workers
    if by_files:
        paths = paths[worker::num_workers]
    ds = tf.data.Dataset.from_tensor_slices(paths).interleave(
        tf.data.TFRecordDataset, cycle_length=min(len(paths), 16),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if num_workers > 1 and not by_files:
        ds = ds.shard(num_workers, worker)
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE), total


def find_corrupt(pattern: str) -> str | None:
    """Reads every record of every file (slow; call it only after a read failed) and
    returns a one-line description of the first unreadable record, or None."""
    for path in files(pattern):
        index = -1
        try:
            for index, record in enumerate(tf.data.TFRecordDataset(path)):
                parse(record)
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
            message = str(err).splitlines()[0].split("}}")[-1].split(" [Op:")[0]
            message = message.split("' failed with ")[0].strip(" '")
            return (f"corrupt or truncated TFRecord file {path} (after record {index}): "
                    f"{message[:120]}; rewrite it with python -m data.make_tfrecords")
    return None
