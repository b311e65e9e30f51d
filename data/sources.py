"""Where examples come from: a table of datasets, TFDS loading, synthetic data.

Every source yields `(image uint8 [H, W, 3], label int32)` and reports its size, so
the pipeline can count steps and pad the evaluation set exactly.
"""
import dataclasses
import json
import os

import numpy as np
import tensorflow as tf

from data import tfrecords
from data.errors import DatasetError  # re-exported: callers catch sources.DatasetError


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_classes: int
    image_shape: tuple[int, int, int]
    train_split: str
    eval_split: str
    mean: tuple[float, float, float]      # per channel, of images scaled to [0, 1]
    std: tuple[float, float, float]
    augment: str                          # a name in data.augment.TRAIN_AUGMENTATIONS
    class_names: tuple[str, ...] = ()
    synthetic_sizes: tuple[int, int] = (0, 0)   # (train, eval) for generated data
    # > 0: the source has one split; this fraction of it is held out for evaluation
    # by a fixed hash of the example index (disjoint, stable across runs).
    holdout_fraction: float = 0.0
    variable_size: bool = False                 # images need resizing to one size


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                   "horse", "ship", "truck")

_SPECS = {
    "cifar10": DatasetSpec(
        "cifar10", 10, (32, 32, 3), "train", "test",
        mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
        augment="pad_crop_flip", class_names=CIFAR10_CLASSES),
    # TFDS has only "train" (3,670 photos); 15% are held out as "validation".
    "tf_flowers": DatasetSpec(
        "tf_flowers", 5, (192, 192, 3), "train", "validation",
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
        augment="flip_saturation", holdout_fraction=0.15, variable_size=True,
        class_names=("dandelion", "daisy", "tulips", "sunflowers", "roses")),
    # Learnable generated data, no files: one fixed random pattern per class plus noise.
    "synthetic": DatasetSpec(
        "synthetic", 10, (32, 32, 3), "train", "test",
        mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), augment="pad_crop_flip",
        class_names=tuple(f"class_{i}" for i in range(10)),
        synthetic_sizes=(10_000, 2_000)),
}


def names() -> tuple[str, ...]:
    return tuple(sorted(_SPECS))


TFRECORD_PREFIX = "tfrecord:"
TFRECORD_METADATA = "dataset.json"  # written beside the shards by data.make_tfrecords


def get_spec(name: str) -> DatasetSpec:
    """A dataset from the table, or `tfrecord:PATTERN` (described by the dataset.json
    that data.make_tfrecords writes beside the files)."""
    if name.startswith(TFRECORD_PREFIX):
        return _tfrecord_spec(name)
    if name not in _SPECS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(names())} or "
                         f"{TFRECORD_PREFIX}PATTERN")
    return _SPECS[name]


def _tfrecord_spec(name: str) -> DatasetSpec:
    pattern = name[len(TFRECORD_PREFIX):]
    path = os.path.join(os.path.dirname(pattern), TFRECORD_METADATA)
    if not os.path.exists(path):
        raise DatasetError(f"no {TFRECORD_METADATA} beside {pattern!r}: write the files "
                           f"with python -m data.make_tfrecords")
    with open(path) as f:
        meta = json.load(f)
    if not 0 < float(meta.get("holdout_fraction", 0.15)) < 1:
        raise DatasetError(f"{path}: holdout_fraction must be in (0, 1): the validation "
                           f"set is held out of the same files")
    base = _SPECS.get(meta.get("source", ""), _SPECS["tf_flowers"])
    size = int(meta.get("image_size") or base.image_shape[0])
    return dataclasses.replace(
        base, name=name, num_classes=len(meta["class_names"]),
        class_names=tuple(meta["class_names"]), image_shape=(size, size, 3),
        train_split="train", eval_split="validation",
        holdout_fraction=float(meta.get("holdout_fraction", 0.15)), variable_size=True)


def load(spec: DatasetSpec, split: str, data_dir: str | None = None,
         download: bool = False,
         context: tf.distribute.InputContext | None = None) -> tuple[tf.data.Dataset, int]:
    """Returns (dataset of (uint8 image, int32 label), number of examples), unshuffled.

    With `context` the dataset is this input worker's shard, disjoint from the other
    workers' (by files for TFRecords when there are enough files, else by records);
    the count stays the total.
    """
    validation = split != spec.train_split
    pipelines = context.num_input_pipelines if context else 1
    worker = context.input_pipeline_id if context else 0
    if spec.synthetic_sizes != (0, 0):
        size = spec.synthetic_sizes[1 if validation else 0]
        ds = synthetic(spec, size, seed=1 if validation else 0)
        return ds.shard(pipelines, worker), size
    if spec.name.startswith(TFRECORD_PREFIX):
        ds, total = tfrecords.load(spec.name[len(TFRECORD_PREFIX):], pipelines, worker)
        return holdout(ds, total, spec.holdout_fraction, validation)
    if spec.holdout_fraction:
        ds, total = load_tfds(spec.name, spec.train_split, data_dir, download)
        ds = ds.enumerate().map(lambda index, example: (*example, index))
        ds, count = holdout(ds.shard(pipelines, worker), total, spec.holdout_fraction,
                            validation)
        return ds, count
    ds, count = load_tfds(spec.name, split, data_dir, download)
    return ds.shard(pipelines, worker), count


def explain_read_error(spec: DatasetSpec) -> str | None:
    """After a failed read: which file is broken, if it can be found (TFRecords)."""
    if spec.name.startswith(TFRECORD_PREFIX):
        return tfrecords.find_corrupt(spec.name[len(TFRECORD_PREFIX):])
    return None


HOLDOUT_SEED = 20260101  # fixed: every run and every seed uses the same validation set


def in_holdout(indices, fraction: float):
    """Knuth multiplicative hash of the index, in [0, 1) -> held out if < fraction.
    Works on numpy arrays and tf tensors alike (int64)."""
    hashed = (indices * 2654435761 + HOLDOUT_SEED) % 4294967296
    return hashed < int(fraction * 4294967296)


def holdout(ds: tf.data.Dataset, total: int, fraction: float,
            validation: bool) -> tuple[tf.data.Dataset, int]:
    """From (image, label, index) examples, indices 0..total-1: the held-out part
    (validation=True) or the rest, as (image, label)."""
    held = int(np.sum(in_holdout(np.arange(total, dtype=np.int64), fraction)))
    wanted = (lambda index: in_holdout(index, fraction)) if validation else (
        lambda index: tf.logical_not(in_holdout(index, fraction)))
    ds = ds.filter(lambda image, label, index: wanted(index))
    return ds.map(lambda image, label, index: (image, label)), (
        held if validation else total - held)


def load_tfds(name: str, split: str, data_dir: str | None = None,
              download: bool = False) -> tuple[tf.data.Dataset, int]:
    """tfds.load honouring data_dir, then TFDS_DATA_DIR; a clear error if absent."""
    import tensorflow_datasets as tfds  # heavy import, only when TFDS is used
    data_dir = data_dir or os.environ.get("TFDS_DATA_DIR") or None
    try:
        ds, info = tfds.load(name, split=split, data_dir=data_dir, download=download,
                             as_supervised=True, shuffle_files=False, with_info=True)
    except (AssertionError, tfds.core.registered.DatasetNotFoundError) as err:
        where = data_dir or "the default TFDS data dir (~/tensorflow_datasets)"
        raise DatasetError(
            f"dataset {name!r} split {split!r} not found in {where} and not downloaded: "
            f"pass --data_dir=DIR or set TFDS_DATA_DIR to a prepared TFDS data dir "
            f"(or add --download_data where the network allows)") from err
    try:
        num_examples = info.splits[split].num_examples
    except KeyError:  # no split metadata (e.g. tfds.testing.mock_data): count
        num_examples = int(ds.cardinality())
        if num_examples < 0:
            num_examples = int(ds.reduce(0, lambda count, *_: count + 1))
    ds = ds.map(lambda image, label: (image, tf.cast(label, tf.int32)))
    return ds, int(num_examples)


def synthetic(spec: DatasetSpec, size: int, seed: int) -> tf.data.Dataset:
    """Generated, learnable data: a smooth class pattern + noise, a pure function of the index."""
    shape = spec.image_shape
    # Smooth (4x4 upsampled) class patterns survive the crop and flip augmentation.
    coarse = tf.random.stateless_uniform((spec.num_classes, 4, 4, shape[2]),
                                         seed=(1234, 0), minval=0.0, maxval=255.0)
    patterns = tf.image.resize(coarse, shape[:2], method="bilinear")

    block = 256  # generated 256 at a time: one op per block, not per image

    def make_block(first):
        key = tf.stack([tf.cast(first // block, tf.int32), seed])
        count = tf.cast(tf.minimum(tf.constant(block, tf.int64), size - first), tf.int32)
        labels = tf.random.stateless_uniform((count,), key, maxval=spec.num_classes,
                                             dtype=tf.int32)
        noise = tf.random.stateless_normal(tf.concat([[count], shape], 0), key + 7,
                                           stddev=40.0)
        images = tf.clip_by_value(tf.gather(patterns, labels) * 0.6 + 50.0 + noise,
                                  0.0, 255.0)
        return tf.data.Dataset.from_tensor_slices((tf.cast(images, tf.uint8), labels))

    return tf.data.Dataset.range(0, size, block).flat_map(make_block)
