"""TFRecords in the flowers codelab's format: one tf.train.Example per image with the
encoded image bytes (`image`), the integer class (`class`), the class name (`label`),
the image's [height, width] (`size`) and the one-hot class (`one_hot_class`), sharded
into files whose names carry their record count (`flowers00-230.tfrec`), so nothing
has to be read to count them. We also store the example's index in its source
(`index`), so a held-out split made by index (data.sources.in_holdout) is the same
from TFDS and from TFRecords; the codelab's own files have no index.

Every path goes through tf.io.gfile, so `gs://bucket/...` (and TensorFlow's in-memory
`ram://...`) works wherever a local path does.
"""
import math
import os
import posixpath
import re
import struct
from typing import Iterable

from google.protobuf.message import DecodeError
import tensorflow as tf

from data import files as atomic
from data.errors import DatasetError

FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "class": tf.io.FixedLenFeature([], tf.int64),
    "label": tf.io.FixedLenFeature([], tf.string, default_value=""),
    "index": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
}
_COUNT = re.compile(r"-(\d+)\.tfrec$")
SCAN_LIMIT = 10_000  # records read at most to find class names (and counts) in the files


def directory(path: str) -> str:
    """os.path.dirname that keeps a URL's root: os.path.dirname('ram://x') is 'ram:',
    a local relative path, where this gives 'ram://' ('gs://b/x' -> 'gs://b')."""
    scheme, separator, rest = path.partition("://")
    if not separator:
        return os.path.dirname(path)
    return scheme + separator + posixpath.dirname(rest)


def shard_path(prefix: str, shard: int, count: int) -> str:
    return f"{prefix}{shard:02d}-{count}.tfrec"


def shards_of(prefix: str) -> list[str]:
    """The shard files a conversion to `prefix` writes (PREFIX{NN}-{count}.tfrec)
    that exist now, in shard order."""
    name = re.compile(re.escape(os.path.basename(prefix)) + r"\d{2,}-\d+\.tfrec$")
    parent = directory(prefix)
    try:
        found = tf.io.gfile.listdir(parent or ".")
    except tf.errors.NotFoundError:
        return []
    return sorted((os.path.join(parent, n) for n in found if name.match(n)), key=_natural)


def has_count(path: str) -> bool:
    return bool(_COUNT.search(path))


def record_count(path: str) -> int:
    match = _COUNT.search(path)
    if not match:
        raise DatasetError(f"cannot count the records of {path}: TFRecord file names must "
                           f"end in -COUNT.tfrec, as python -m trainer.tools.make_tfrecords writes")
    return int(match.group(1))


def _bytes(*values: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


def _ints(*values: int) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def serialize(image_bytes: bytes, class_id: int, class_name: str, index: int,
              num_classes: int, size: tuple[int, int]) -> bytes:
    """One record with the codelab's five features (`size` is [height, width]) plus our
    `index`, so a reader written the codelab's way reads our files."""
    one_hot = [0.0] * num_classes
    one_hot[class_id] = 1.0
    feature = {
        "image": _bytes(image_bytes),
        "class": _ints(class_id),
        "label": _bytes(class_name.encode()),
        "size": _ints(*size),
        "one_hot_class": tf.train.Feature(float_list=tf.train.FloatList(value=one_hot)),
        "index": _ints(index),
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    # Map entries sorted: the same bytes from every process (their order otherwise
    # follows the string hash, which Python seeds afresh per process).
    return example.SerializeToString(deterministic=True)


def write_shards(records: Iterable[bytes], total: int, prefix: str,
                 num_shards: int) -> list[str]:
    """Writes serialized examples, in order, into `num_shards` files."""
    parent = directory(prefix)
    if parent:
        tf.io.gfile.makedirs(parent)
    per_shard = math.ceil(total / num_shards)
    paths, records = [], iter(records)
    for shard in range(num_shards):
        count = min(per_shard, total - shard * per_shard)
        if count <= 0:
            break
        path = shard_path(prefix, shard, count)
        with atomic.written_whole(path) as tmp:  # the shard whole or not at all
            with tf.io.TFRecordWriter(tmp) as writer:
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


def _natural(path: str) -> list:
    """Sort key reading digit runs as numbers: shard 100 after shard 99, so the sorted
    files of our writer are in the order it wrote them (the records' index order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def parse_encoded(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(encoded image bytes, int32 class) of a record, nothing decoded."""
    example = tf.io.parse_single_example(record, {"image": FEATURES["image"],
                                                  "class": FEATURES["class"]})
    return example["image"], tf.cast(example["class"], tf.int32)


def files(pattern: str) -> list[str]:
    try:
        paths = sorted(tf.io.gfile.glob(pattern), key=_natural)
    except tf.errors.OpError as err:  # e.g. a bucket that is not there or not readable
        raise DatasetError(f"cannot list {pattern!r}: {err.message.splitlines()[0][:160]}"
                           ) from err
    if not paths:
        raise DatasetError(f"no TFRecord files match {pattern!r}; check the path, or write "
                           f"them with python -m trainer.tools.make_tfrecords")
    return paths


def load(pattern: str, num_workers: int = 1,
         worker: int = 0) -> tuple[tf.data.Dataset, int]:
    """(dataset of (image, class, index), total record count from the file names);
    index is -1 in records without one (the codelab's)."""
    return load_files(files(pattern), num_workers, worker)


def load_files(paths: list[str], num_workers: int = 1,
               worker: int = 0) -> tuple[tf.data.Dataset, int]:
    """`load` of the given files. They are read in parallel (interleaved in a fixed
    order). With several input workers each reads its own files when there are enough
    of them, else every num_workers-th record."""
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


def first_example(path: str) -> tf.train.Example:
    """The first record of a file, as a proto (which features it has, and of what
    kind). Raises a one-line DatasetError naming the file if it cannot be read."""
    try:
        for record in tf.data.TFRecordDataset(path).take(1):
            return tf.train.Example.FromString(record.numpy())
    except (tf.errors.OpError, DecodeError) as err:
        raise DatasetError(corrupt_record([path]) or f"cannot read the first record of "
                           f"{path}: {str(err).splitlines()[0][:120]}") from err
    raise DatasetError(f"{path} holds no records; rewrite it or leave it out of the pattern")


def scan_classes(paths: list[str], num_classes: int | None = None,
                 limit: int = SCAN_LIMIT) -> dict[int, str]:
    """class id -> class name ("" in records without a label), from the files' records
    in order: until ids 0..num_classes-1 have all been seen, or `limit` records."""
    spec = {"class": FEATURES["class"], "label": FEATURES["label"]}
    ds = tf.data.TFRecordDataset(paths).take(limit).batch(64).map(
        lambda records: tf.io.parse_example(records, spec))  # images are not decoded
    names: dict[int, str] = {}
    try:
        for batch in ds:
            for class_id, label in zip(batch["class"].numpy(), batch["label"].numpy()):
                if not names.get(int(class_id)):  # a labelled record wins over one without
                    names[int(class_id)] = label.decode(errors="replace")
            if num_classes and all(i in names for i in range(num_classes)):
                break
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
        raise DatasetError(corrupt_record(paths) or f"cannot read the records of "
                           f"{paths[0]} ...: {str(err).splitlines()[0][:120]}") from err
    return names


# A TFRecord: length (8 bytes) and its CRC (4), the data, the data's CRC (4).
_HEADER, _FOOTER = 12, 4
_BLOCK = 1 << 16  # read at a time: many small records, or one large record's head


def count_records(path: str) -> tuple[int, bool]:
    """(whole records in a TFRecord file, whether it ends inside one: cut short),
    from the records' length headers alone: a file cut at a record boundary reads
    without error, and its data need not be read to count it."""
    size, count, offset = tf.io.gfile.stat(path).length, 0, 0
    block, start = b"", 0  # bytes [start, start + len(block)) of the file
    with tf.io.gfile.GFile(path, "rb") as f:
        while offset + _HEADER <= size:
            if not start <= offset <= start + len(block) - 8:  # read on from there
                f.seek(offset)
                block, start = f.read(_BLOCK), offset
            offset += _HEADER + struct.unpack_from("<Q", block, offset - start)[0] + _FOOTER
            if offset > size:
                return count, True
            count += 1
    return count, offset != size


def find_corrupt(pattern: str, num_classes: int | None = None) -> str | None:
    """Reads every record of every file (slow; call it only after a read failed) and
    returns a one-line description of the first unreadable record, or of the first
    whose class is not one of `num_classes`, or None."""
    return corrupt_record(files(pattern), num_classes)


def corrupt_record(paths: list[str], num_classes: int | None = None) -> str | None:
    """find_corrupt for a list of files."""
    for path in paths:
        index = -1
        try:
            for index, record in enumerate(tf.data.TFRecordDataset(path)):
                class_id = int(parse(record)[1])
                if num_classes and not 0 <= class_id < num_classes:
                    return (f"TFRecord file {path}, record {index}: class {class_id} is "
                            f"not one of the dataset's {num_classes} classes (0-"
                            f"{num_classes - 1}); fix the records, or the class list in "
                            f"their dataset.json (or ;classes=N)")
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
            message = str(err).splitlines()[0].split("}}")[-1].split(" [Op:")[0]
            message = message.split("' failed with ")[0].strip(" '")
            return (f"corrupt or truncated TFRecord file {path} (after record {index}): "
                    f"{message[:120]}; rewrite it with python -m trainer.tools.make_tfrecords")
    return None
