"""Where examples come from: a table of datasets, TFDS loading, synthetic data.

Every source yields `(image uint8 [H, W, 3], label int32)` and reports its size, so
the pipeline can count steps and pad the evaluation set exactly.
"""
import dataclasses
import os

import tensorflow as tf


class DatasetError(RuntimeError):
    """The data could not be found or read; the message says what to do."""


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


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                   "horse", "ship", "truck")

_SPECS = {
    "cifar10": DatasetSpec(
        "cifar10", 10, (32, 32, 3), "train", "test",
        mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
        augment="pad_crop_flip", class_names=CIFAR10_CLASSES),
    # Learnable generated data, no files: one fixed random pattern per class plus noise.
    "synthetic": DatasetSpec(
        "synthetic", 10, (32, 32, 3), "train", "test",
        mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), augment="pad_crop_flip",
        class_names=tuple(f"class_{i}" for i in range(10)),
        synthetic_sizes=(10_000, 2_000)),
}


def names() -> tuple[str, ...]:
    return tuple(sorted(_SPECS))


def get_spec(name: str) -> DatasetSpec:
    if name not in _SPECS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(names())}")
    return _SPECS[name]


def load(spec: DatasetSpec, split: str, data_dir: str | None = None,
         download: bool = False) -> tuple[tf.data.Dataset, int]:
    """Returns (dataset of (uint8 image, int32 label), number of examples), unshuffled."""
    if spec.synthetic_sizes != (0, 0):
        size = spec.synthetic_sizes[0 if split == spec.train_split else 1]
        return synthetic(spec, size, seed=0 if split == spec.train_split else 1), size
    return load_tfds(spec.name, split, data_dir, download)


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

    def make_example(index):
        key = tf.stack([tf.cast(index, tf.int32), seed])
        label = tf.random.stateless_uniform((), key, maxval=spec.num_classes,
                                            dtype=tf.int32)
        noise = tf.random.stateless_normal(shape, key + 7, stddev=40.0)
        image = tf.clip_by_value(patterns[label] * 0.6 + 50.0 + noise, 0.0, 255.0)
        return tf.cast(image, tf.uint8), label

    return tf.data.Dataset.range(size).map(make_example)
