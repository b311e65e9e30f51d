"""Where examples come from: a table of datasets, TFDS loading, TFRecords, synthetic data.

Every source yields `(image uint8 [H, W, 3], label int32)` and reports its size, so
the pipeline can count steps and pad the evaluation set exactly.

TFRecord datasets are named (quote it in a shell: `;` ends a command there)

    tfrecord:TRAIN_PATTERN[;eval=EVAL_PATTERN][;classes=N]

e.g. `'tfrecord:gs://bucket/flowers/train*.tfrec;eval=gs://bucket/flowers/val*.tfrec'`.
Patterns are tf.io.gfile globs: gs:// works wherever a local path does. The files are
our writer's (python -m trainer.tools.make_tfrecords, with a dataset.json beside them) or the
flowers codelab's as they are (no dataset.json, no `index` feature):
- classes: dataset.json's class names, else `classes=N`, else the length of the first
  record's `one_hot_class`, else the largest `class` + 1 in the first
  tfrecords.SCAN_LIMIT records. Names: dataset.json's, else each class's `label` in the
  first records (read until every class is seen, at most SCAN_LIMIT), else "0", "1", ...
- image size: dataset.json's, else the first record's `size`, else its image's.
- validation set: the `eval=` files; else, when records carry an `index` (ours), a fixed
  hash of it holds out holdout_fraction of the records (the same split as from TFDS);
  else (the codelab's) the last ceil(holdout_fraction x files) of the sorted files, at
  least one. holdout_fraction is dataset.json's, else 0.15.
- record counts: from the file names (`flowers00-230.tfrec` holds 230).
"""
import dataclasses
import functools
import json
import logging
import math
import os
from typing import Callable

import numpy as np
import tensorflow as tf

from data import files, tfrecords
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
    # TFRecords (`tfrecord:` names): the training files' pattern, and the validation
    # files' when they are separate files (then nothing is held out of the training files).
    tfrecord_pattern: str = ""
    eval_pattern: str = ""
    # Records without an index (the codelab's files): hold out whole files instead, the
    # last ceil(holdout_fraction x files) of the sorted files (see split_files).
    holdout_files: bool = False
    # TFDS data: the data dir get_spec was given (None: $TFDS_DATA_DIR), where a
    # message after a failed read looks for the file at fault (find_miscounted).
    data_dir: str | None = None


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
    """The datasets with settings of their own; any other TFDS image-classification
    dataset works by name too (tfds_spec)."""
    return tuple(sorted(_SPECS))


TFRECORD_PREFIX = "tfrecord:"
TFRECORD_METADATA = "dataset.json"  # written beside the shards by data.make_tfrecords
TFRECORD_SYNTAX = "tfrecord:TRAIN_PATTERN[;eval=EVAL_PATTERN][;classes=N]"
_TFRECORD_OPTIONS = ("eval", "classes")
DEFAULT_HOLDOUT = _SPECS["tf_flowers"].holdout_fraction  # files without a dataset.json
VARIABLE_SIZE = 224  # the training size of datasets whose images vary in size
# Per-channel statistics of ImageNet (of [0, 1] images): the usual choice for photos.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_spec(name: str, data_dir: str | None = None, train_split: str = "",
             eval_split: str = "") -> DatasetSpec:
    """A dataset from the table, a TFRecord dataset (TFRECORD_SYNTAX, described in
    the module docstring), or any TFDS image-classification dataset, NAME[:VERSION]
    (tfds_spec). train_split / eval_split: TFDS split names (or slices, e.g.
    'train[:90%]') instead of the dataset's own."""
    if name.startswith(TFRECORD_PREFIX):
        if train_split or eval_split:
            raise DatasetError("--train_split/--eval_split choose TFDS splits; a TFRecord "
                               "dataset's validation files are ;eval=EVAL_PATTERN")
        return _tfrecord_spec(name)
    spec = _SPECS.get(name) or _SPECS.get(name.partition(":")[0])
    if spec is None:
        return tfds_spec(name, data_dir, train_split, eval_split)
    spec = dataclasses.replace(spec, name=name, data_dir=data_dir)
    if spec.synthetic_sizes != (0, 0):
        if train_split or eval_split:
            raise DatasetError("the synthetic dataset has no splits to choose")
        return spec
    if train_split or eval_split:
        tfds_spec(name, data_dir, train_split, eval_split)  # checks the split names
    if eval_split:  # a split of its own: nothing is held out of the training split
        spec = dataclasses.replace(spec, eval_split=eval_split, holdout_fraction=0.0)
    return dataclasses.replace(spec, train_split=train_split or spec.train_split)


def _tfds_dir(data_dir: str | None) -> str | None:
    return data_dir or os.environ.get("TFDS_DATA_DIR") or None


class _NoVariantScanWarnings(logging.Filter):
    """Drops TFDS' 'Variant folder DIR has no dataset_info.json': it warns so for each
    version folder it looks for in a data dir that lacks the dataset, before our one
    error line (not_prepared) says where we looked and how to prepare it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Variant folder")


_VARIANT_SCAN_FILTER = _NoVariantScanWarnings()


def _tfds():
    """tensorflow_datasets: a heavy import, only when TFDS is used."""
    import tensorflow_datasets as tfds
    absl_logger = logging.getLogger("absl")  # where TFDS' absl.logging goes
    if _VARIANT_SCAN_FILTER not in absl_logger.filters:
        absl_logger.addFilter(_VARIANT_SCAN_FILTER)
    return tfds


def tfds_spec(name: str, data_dir: str | None = None, train_split: str = "",
              eval_split: str = "") -> DatasetSpec:
    """Any TFDS image-classification dataset, from its own DatasetInfo: its classes
    (the supervised label's ClassLabel), image shape and splits. Evaluation uses
    `eval_split`, else 'validation', else 'test', else holds 15% of the training
    split out (by a fixed hash of the index, as flowers). Images that vary in size
    train at VARIABLE_SIZE with ImageNet's crop; fixed small ones with pad-crop-flip.
    The data need not be prepared yet (tfds.testing.mock_data has none): a missing
    dataset is a one-line error when it is read (load_tfds)."""
    tfds = _tfds()
    data_dir = _tfds_dir(data_dir)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except (tfds.core.registered.DatasetNotFoundError, ValueError) as err:
        raise DatasetError(f"unknown dataset {name!r}: not one of {', '.join(names())}, "
                           f"not {TFRECORD_PREFIX}PATTERN and not a TFDS dataset name "
                           f"(NAME or NAME:VERSION, see tfds.list_builders())") from err
    info = builder.info
    image_key, label_key = info.supervised_keys or ("image", "label")
    features = info.features
    image = features[image_key] if image_key in features.keys() else None
    label = features[label_key] if label_key in features.keys() else None
    if not isinstance(image, tfds.features.Image) or not isinstance(
            label, tfds.features.ClassLabel):
        raise DatasetError(f"TFDS dataset {name!r} is not image classification (its "
                           f"supervised keys are {info.supervised_keys}; an Image and a "
                           f"ClassLabel are needed)")
    height, width, channels = image.shape
    splits = set(info.splits.keys())  # empty when not prepared (or mocked)
    train_split = train_split or "train"
    holdout = 0.0
    if not eval_split:
        if "validation" in splits or not splits:
            eval_split = "validation"
        elif "test" in splits:
            eval_split = "test"
        else:  # only a training split (as tf_flowers): hold a fixed part out
            eval_split, holdout = "validation", DEFAULT_HOLDOUT
    for split in (train_split, eval_split if not holdout else train_split):
        base = split.split("[")[0]
        if splits and base not in splits:
            raise DatasetError(f"TFDS dataset {name!r} has no split {base!r}; it has "
                               f"{', '.join(sorted(splits))} (--train_split/--eval_split)")
    variable = height is None or width is None
    size = VARIABLE_SIZE if variable else max(height, width)
    small = not variable and size <= 64
    return DatasetSpec(
        name, label.num_classes, (size, size, channels or 3), train_split, eval_split,
        mean=(0.5,) * 3 if small else IMAGENET_MEAN,
        std=(0.25,) * 3 if small else IMAGENET_STD,
        augment="pad_crop_flip" if small else "inception_crop",
        class_names=tuple(label.names), holdout_fraction=holdout,
        variable_size=variable or height != width, data_dir=data_dir)


def parse_tfrecord_name(name: str) -> tuple[str, dict[str, str]]:
    """'tfrecord:P;eval=E;classes=N' -> ('P', {'eval': 'E', 'classes': 'N'})."""
    pattern, *parts = name[len(TFRECORD_PREFIX):].split(";")
    if not pattern:
        raise DatasetError(f"dataset {name!r} has no file pattern; write {TFRECORD_SYNTAX}")
    options: dict[str, str] = {}
    for part in parts:
        key, equals, value = part.partition("=")
        if key not in _TFRECORD_OPTIONS or not equals or not value or key in options:
            raise DatasetError(f"dataset {name!r}: {part!r} is not eval=EVAL_PATTERN or "
                               f"classes=N (each once); write {TFRECORD_SYNTAX}")
        options[key] = value
    if "classes" in options and not (options["classes"].isdigit()
                                     and int(options["classes"]) > 0):
        raise DatasetError(f"dataset {name!r}: classes={options['classes']} is not a "
                           f"positive whole number; write {TFRECORD_SYNTAX}")
    return pattern, options


def _read_metadata(path: str) -> dict | None:
    if not tf.io.gfile.exists(path):
        return None
    try:
        meta = files.read_json(path, dict, keys=("class_names",))
        if not isinstance(meta["class_names"], list):
            raise TypeError("class_names is not a list")
        meta["class_names"] = [str(name) for name in meta["class_names"]]
    except (ValueError, TypeError) as err:
        raise DatasetError(f"{path} is not a dataset description with a class_names list "
                           f"({type(err).__name__}); rewrite it with python -m "
                           f"trainer.tools.make_tfrecords, or delete it") from err
    if meta.get("complete") is False:  # (descriptions from before it: complete)
        raise DatasetError(f"{path}: the conversion to {meta.get('output', 'these files')} "
                           f"did not finish (python -m trainer.tools.make_tfrecords stopped part "
                           f"way: a full disk, a kill); run it again")
    return meta


def _kind(features, key: str) -> str | None:
    return features[key].WhichOneof("kind") if key in features else None


def _tfrecord_spec(name: str) -> DatasetSpec:
    pattern, options = parse_tfrecord_name(name)
    meta_path = os.path.join(tfrecords.directory(pattern), TFRECORD_METADATA)
    meta = _read_metadata(meta_path)
    # No files is fine beside a dataset.json: predict reads a run's kept description.
    paths = _glob(pattern)
    if meta is None and not paths:
        raise DatasetError(f"no {TFRECORD_METADATA} beside {pattern!r} and no TFRecord "
                           f"files match it: check the path, or write them with python -m "
                           f"trainer.tools.make_tfrecords")
    eval_pattern = options.get("eval", "")
    if eval_pattern:
        shared = set(paths) & set(tfrecords.files(eval_pattern))
        if shared:
            raise DatasetError(f"{min(shared)} matches both the training pattern and "
                               f"eval={eval_pattern}: the two must name different files")
    override = int(options["classes"]) if "classes" in options else None
    if meta is None:
        for path in paths:  # fail now, naming the file, if a name carries no count
            tfrecords.record_count(path)
        features = tfrecords.first_example(paths[0]).features.feature
        if _kind(features, "image") != "bytes_list" or _kind(features, "class") != (
                "int64_list"):
            raise DatasetError(f"{paths[0]}: the records have features {sorted(features)}, "
                               f"not an image (bytes) and a class (int64) as the flowers "
                               f"codelab and python -m trainer.tools.make_tfrecords write them")
        base = _SPECS["tf_flowers"]
        class_names = _class_names(paths, features, override)
        size = _image_size(paths[0], features)
        fraction, has_index = DEFAULT_HOLDOUT, "index" in features
    else:
        base = _SPECS.get(meta.get("source", ""), _SPECS["tf_flowers"])
        class_names = tuple(meta["class_names"])
        if override is not None and override != len(class_names):
            raise DatasetError(f"classes={override} in {name!r}, but {meta_path} names "
                               f"{len(class_names)} classes: drop one of them")
        size = int(meta.get("image_size") or base.image_shape[0])
        fraction = float(meta.get("holdout_fraction", DEFAULT_HOLDOUT))
        has_index = _has_index(paths)
    if not eval_pattern and not 0 < fraction < 1:
        raise DatasetError(f"{meta_path}: holdout_fraction must be in (0, 1): the "
                           f"validation set is held out of the same files (or give "
                           f";eval=EVAL_PATTERN)")
    if not eval_pattern and not has_index:
        split_files(paths, fraction, pattern)  # refuses a single file now, not mid-run
    return dataclasses.replace(
        base, name=name, num_classes=len(class_names), class_names=class_names,
        image_shape=(size, size, 3), train_split="train", eval_split="validation",
        holdout_fraction=0.0 if eval_pattern else fraction, variable_size=True,
        tfrecord_pattern=pattern, eval_pattern=eval_pattern,
        holdout_files=not eval_pattern and not has_index)


def _glob(pattern: str) -> list[str]:
    try:
        return tfrecords.files(pattern)
    except DatasetError:
        return []


def _has_index(paths: list[str]) -> bool:
    """Whether the records beside a dataset.json carry an index (ours do). Without
    readable files, yes: a broken file is named when it is read (explain_read_error)."""
    countable = [path for path in paths if tfrecords.has_count(path)]
    if not countable:
        return True
    try:
        return "index" in tfrecords.first_example(countable[0]).features.feature
    except DatasetError:
        return True


def _class_names(paths: list[str], features, override: int | None) -> tuple[str, ...]:
    """Codelab files: the class count from `classes=N` or the one-hot length, else the
    largest class id seen; each class's name from its records' `label`."""
    one_hot = _kind(features, "one_hot_class") == "float_list" and len(
        features["one_hot_class"].float_list.value)
    num_classes = override or one_hot or None
    if num_classes and _kind(features, "label") != "bytes_list":
        return tuple(str(i) for i in range(num_classes))
    seen = tfrecords.scan_classes(paths, num_classes)
    if num_classes is None:
        num_classes = max(seen) + 1
        if num_classes < 1:
            raise DatasetError(f"{paths[0]}: class ids must be 0, 1, ...; found "
                               f"{sorted(seen)[:5]}")
    return tuple(seen.get(i) or str(i) for i in range(num_classes))


def _image_size(path: str, features) -> int:
    """The square size to train at: the first record's `size` [height, width], else its
    decoded image's (the larger side, when not square)."""
    size = list(features["size"].int64_list.value) if _kind(features, "size") else []
    if len(size) != 2 or min(size) < 1:
        try:
            size = tfrecords.decode_image(features["image"].bytes_list.value[0]).shape[:2]
        except tf.errors.InvalidArgumentError as err:
            raise DatasetError(f"{path}: the first record's image cannot be decoded "
                               f"(JPEG, PNG, GIF or BMP bytes expected)") from err
    return int(max(size))


def split_files(paths: list[str], fraction: float,
                pattern: str) -> tuple[list[str], list[str]]:
    """(training files, held-out files) for records without an index: the last
    ceil(fraction x files) of the sorted files, at least one and never all."""
    if len(paths) < 2:
        raise DatasetError(f"{pattern!r} matches one file whose records have no index "
                           f"feature, so no validation set can be held out of it: add "
                           f";eval=EVAL_PATTERN, or write the data in several files")
    paths = sorted(paths)
    held = min(max(1, math.ceil(fraction * len(paths))), len(paths) - 1)
    return paths[:-held], paths[-held:]


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
    if spec.tfrecord_pattern:
        return _load_tfrecords(spec, validation, pipelines, worker)
    if spec.holdout_fraction:
        ds, total = load_tfds(spec.name, spec.train_split, data_dir, download)
        ds = ds.enumerate().map(lambda index, example: (*example, index))
        ds, count = holdout(ds.shard(pipelines, worker), total, spec.holdout_fraction,
                            validation)
        return ds, count
    ds, count = load_tfds(spec.name, split, data_dir, download)
    return ds.shard(pipelines, worker), count


def count(spec: DatasetSpec, split: str, data_dir: str | None = None,
          download: bool = False) -> int:
    """The number of examples `load(spec, split)` gives. From a TFDS dataset's
    description where it has the split (a hundredth of a second, where building
    the dataset to read its count took most of a second a split); else `load`'s."""
    validation = split != spec.train_split
    if spec.synthetic_sizes == (0, 0) and not spec.tfrecord_pattern:
        whole = spec.train_split if spec.holdout_fraction else split
        try:
            builder = _tfds().builder(spec.name, data_dir=_tfds_dir(data_dir))
            total = int(builder.info.splits[whole].num_examples)
        except Exception:  # noqa: BLE001 (not prepared, no metadata: load tells)
            total = 0
        if total > 0:
            if not spec.holdout_fraction:
                return total
            held = held_out_count(total, spec.holdout_fraction)
            return held if validation else total - held
    return load(spec, split, data_dir, download)[1]


def _load_tfrecords(spec: DatasetSpec, validation: bool, pipelines: int,
                    worker: int) -> tuple[tf.data.Dataset, int]:
    if not spec.eval_pattern and not spec.holdout_files:  # by index, as from TFDS
        ds, total = tfrecords.load(spec.tfrecord_pattern, pipelines, worker)
        return holdout(ds, total, spec.holdout_fraction, validation)
    if spec.eval_pattern:
        paths = tfrecords.files(spec.eval_pattern if validation else spec.tfrecord_pattern)
    else:
        train, held = split_files(tfrecords.files(spec.tfrecord_pattern),
                                  spec.holdout_fraction, spec.tfrecord_pattern)
        paths = held if validation else train
    # Whole files: the count from their names is exact.
    ds, count = tfrecords.load_files(paths, pipelines, worker)
    return ds.map(lambda image, label, index: (image, label)), count


@dataclasses.dataclass(frozen=True)
class RecordFiles:
    """A split as files of serialized records, for the streaming pipeline: it reads
    the records itself (in an order of its own) and decodes them on the fly.
    Record j of file f (after skipping skips[f]) is example offsets[f] + j of the
    split's fixed order, the index a held-out split hashes."""
    paths: tuple[str, ...]
    skips: tuple[int, ...]        # records to pass at each file's start (split slices)
    counts: tuple[int, ...]       # records to read from each file
    offsets: tuple[int, ...]      # the index of each file's first record read
    parse: Callable               # serialized record -> (encoded image, int32 label)
    holdout_fraction: float = 0.0  # > 0: examples are kept by in_holdout(index)
    validation: bool = False       # keep the held-out part (else the rest)
    channels: int = 3

    def keeps(self, indices: np.ndarray) -> np.ndarray:
        """Which of these indices the split keeps."""
        if not self.holdout_fraction:
            return np.ones(indices.shape, bool)
        held = in_holdout(indices, self.holdout_fraction)
        return held if self.validation else ~held


def record_files(spec: DatasetSpec, split: str, data_dir: str | None = None
                 ) -> RecordFiles | None:
    """The split's record files (prepared TFDS data, or TFRecords), or None when it
    has none to stream (generated data; TFDS data mocked or not on disk)."""
    validation = split != spec.train_split
    channels = spec.image_shape[2]
    if spec.synthetic_sizes != (0, 0):
        return None
    if spec.tfrecord_pattern:
        if spec.eval_pattern:
            paths = tfrecords.files(spec.eval_pattern if validation else spec.tfrecord_pattern)
            fraction = 0.0
        elif spec.holdout_files:
            train, held = split_files(tfrecords.files(spec.tfrecord_pattern),
                                      spec.holdout_fraction, spec.tfrecord_pattern)
            paths, fraction = held if validation else train, 0.0
        else:  # ours: written in order, record j of the sorted files is index j
            paths, fraction = tfrecords.files(spec.tfrecord_pattern), spec.holdout_fraction
        counts = [tfrecords.record_count(path) for path in paths]
        return RecordFiles(tuple(paths), (0,) * len(paths), tuple(counts),
                           tuple(int(o) for o in np.cumsum([0] + counts[:-1])),
                           tfrecords.parse_encoded, fraction, validation, channels)
    return _tfds_record_files(spec, spec.train_split if spec.holdout_fraction else split,
                              data_dir, validation, channels)


def _tfds_instructions(spec: DatasetSpec, split: str, data_dir: str | None):
    """(builder, the split's file instructions), or None when TFDS has no files for
    it here (not prepared, or mocked)."""
    tfds = _tfds()
    try:
        builder = tfds.builder(spec.name, data_dir=_tfds_dir(data_dir))
        instructions = builder.info.splits[split].file_instructions
    except (KeyError, ValueError, AssertionError):  # not prepared, or mocked
        return None
    if not instructions or not all(tf.io.gfile.exists(i.filename) for i in instructions):
        return None
    return builder, instructions


def _tfds_record_files(spec: DatasetSpec, split: str, data_dir: str | None,
                       validation: bool, channels: int) -> RecordFiles | None:
    tfds = _tfds()
    found = _tfds_instructions(spec, split, data_dir)
    if found is None:
        return None
    builder, instructions = found
    image_key, label_key = builder.info.supervised_keys or ("image", "label")
    features = builder.info.features
    decoders = {image_key: tfds.decode.SkipDecoding()}

    def parse(record):  # the image stays encoded: the pipeline decodes it
        example = features.deserialize_example(record, decoders=decoders)
        return example[image_key], tf.cast(example[label_key], tf.int32)

    counts = [int(i.take) for i in instructions]
    return RecordFiles(tuple(i.filename for i in instructions),
                       tuple(int(i.skip) for i in instructions), tuple(counts),
                       tuple(int(o) for o in np.cumsum([0] + counts[:-1])), parse,
                       spec.holdout_fraction, validation, channels)


def describe_split(spec: DatasetSpec, validation: bool) -> str:
    """Where a split's examples come from, for messages: files or a TFDS split."""
    if spec.tfrecord_pattern:
        pattern = spec.eval_pattern if validation and spec.eval_pattern else (
            spec.tfrecord_pattern)
        return f"the files {pattern!r}" + (" (held-out part)" if validation and not
                                           spec.eval_pattern else "")
    if spec.synthetic_sizes != (0, 0):
        return f"the generated {spec.name} data"
    split = spec.train_split if spec.holdout_fraction else (
        spec.eval_split if validation else spec.train_split)
    return f"TFDS {spec.name!r} split {split!r}"


def check_count(spec: DatasetSpec, validation: bool, read: int, promised: int) -> None:
    """DatasetError (one line naming the data, and the file at fault if one is)
    unless `read` examples is the `promised` count (TFDS' dataset_info.json, the
    TFRecord file names): a file cut short at a record boundary reads without error,
    so only the count can tell."""
    if read != promised:
        problem = miscounted_file(spec, validation) or "a file is missing or cut short"
        raise DatasetError(
            f"{describe_split(spec, validation)} promise {promised} "
            f"{'evaluation' if validation else 'training'} examples but {read} were "
            f"read: {problem}; {restore_advice(spec)}")


def restore_advice(spec: DatasetSpec) -> str:
    """What to do about data files that are cut short or miscounted."""
    if spec.tfrecord_pattern:
        return "restore the data (or rewrite it with python -m trainer.tools.make_tfrecords)"
    return f"restore the data (or prepare it again: tfds build {spec.name.split(':')[0]})"


def _promised_files(spec: DatasetSpec, validation: bool) -> tuple[list[tuple[str, int]], str]:
    """The files a split reads, each with the records the data says it holds, and
    who says so; none for generated data, or TFDS data without files here."""
    if spec.synthetic_sizes != (0, 0):
        return [], ""
    if spec.tfrecord_pattern:
        try:
            paths = record_files(spec, spec.eval_split if validation else
                                 spec.train_split).paths
        except DatasetError:  # (no files match any more)
            return [], ""
        return [(path, tfrecords.record_count(path)) for path in paths], "its name says"
    split = spec.eval_split if validation and not spec.holdout_fraction else (
        spec.train_split)
    found = _tfds_instructions(spec, split, spec.data_dir)
    return ([(i.filename, int(i.examples_in_shard)) for i in found[1]] if found else [],
            "dataset_info.json says")


def _miscount(path: str, promised: int, says: str) -> str | None:
    """What is wrong with a file that should hold `promised` records, or None."""
    try:
        held, cut = tfrecords.count_records(path)
    except (tf.errors.OpError, OSError) as err:
        return f"{path} cannot be read ({files.reason_of(err)})"
    if cut:
        return f"{path} is cut short inside record {held} ({says} {promised} records)"
    if held < promised:
        return (f"{path} holds {held} records, {says} {promised} (records {held}-"
                f"{promised - 1} are missing)")
    return f"{path} holds {held} records, {says} {promised}" if held != promised else None


def miscounted_file(spec: DatasetSpec, validation: bool,
                    checked: set[str] | None = None) -> str | None:
    """After a count check failed: the first of the split's files that holds
    another number of records than the data says, or is cut inside one, in a few
    words ('F holds 10000 records, dataset_info.json says 10500 (records
    10000-10499 are missing)'); None if none does. Reads the records' headers only.
    checked: paths to pass over, and to add those read to."""
    promised, says = _promised_files(spec, validation)
    for path, count in promised:
        if checked is not None and path in checked:
            continue
        problem = _miscount(path, count, says)
        if problem:
            return problem
        if checked is not None:
            checked.add(path)
    return None


def find_miscounted(spec: DatasetSpec) -> str | None:
    """miscounted_file of the run's splits, as one line ('<the split>: <what is
    wrong>; <what to do>'): for an error that does not say which split it came from
    (a count asserted inside a pipeline). The evaluation split first: usually the
    smaller to read."""
    checked: set[str] = set()
    for validation in (True, False):
        problem = miscounted_file(spec, validation, checked)
        if problem:  # (a held-out part's files are the training split's)
            where = describe_split(spec, validation and not spec.holdout_fraction)
            return f"{where}: {problem}; {restore_advice(spec)}"
    return None


def explain_read_error(spec: DatasetSpec) -> str | None:
    """After a failed read or step: which file is broken or holds a class out of
    range, if it can be found (TFRecords)."""
    for pattern in (spec.tfrecord_pattern, spec.eval_pattern):
        culprit = pattern and tfrecords.find_corrupt(pattern, spec.num_classes)
        if culprit:
            return culprit
    return None


def save_description(spec: DatasetSpec, directory: str) -> str:
    """Writes a TFRecord dataset's dataset.json into `directory` (e.g. a run's model_dir,
    so predict needs no data files): the one beside the files if there is one, else one
    made from the spec (codelab files have none). Returns its path."""
    if not spec.tfrecord_pattern:
        raise ValueError(f"{spec.name} is not a TFRecord dataset: it has no dataset.json")
    path = os.path.join(directory, TFRECORD_METADATA)
    beside = os.path.join(tfrecords.directory(spec.tfrecord_pattern), TFRECORD_METADATA)
    if tf.io.gfile.exists(beside):
        files.copy_atomically(beside, path)
        return path
    meta = {"source": "", "class_names": list(spec.class_names),
            "image_size": spec.image_shape[0],
            "holdout_fraction": spec.holdout_fraction or DEFAULT_HOLDOUT}
    files.write_atomically(path, json.dumps(meta, indent=2))
    return path


def keep_description(dataset: str, model_dir: str) -> None:
    """Keeps a TFRecord dataset's description (dataset.json) in a run's model_dir,
    copied or, for the codelab's files that have none, written from the data, so
    that predict and export need no data files (spec_of_run)."""
    if dataset.startswith(TFRECORD_PREFIX):
        save_description(get_spec(dataset), model_dir)


def spec_of_run(name: str, model_dir: str) -> DatasetSpec:
    """A run's dataset description: a TFRecord run's is the dataset.json kept in its
    model_dir (keep_description), so the data files need not be here."""
    if name.startswith(TFRECORD_PREFIX):
        if tf.io.gfile.exists(os.path.join(model_dir, TFRECORD_METADATA)):
            # A pattern with no files here: the description alone.
            spec = get_spec(TFRECORD_PREFIX + os.path.join(model_dir, "no-records-*.tfrec"))
            return dataclasses.replace(spec, name=name)
    return get_spec(name)


HOLDOUT_SEED = 20260101  # fixed: every run and every seed uses the same validation set


def in_holdout(indices, fraction: float):
    """Knuth multiplicative hash of the index, in [0, 1) -> held out if < fraction.
    Works on numpy arrays and tf tensors alike (int64)."""
    hashed = (indices * 2654435761 + HOLDOUT_SEED) % 4294967296
    return hashed < int(fraction * 4294967296)


def held_out_count(total: int, fraction: float) -> int:
    """How many of indices 0..total-1 `in_holdout` holds out."""
    return int(np.sum(in_holdout(np.arange(total, dtype=np.int64), fraction)))


def holdout(ds: tf.data.Dataset, total: int, fraction: float,
            validation: bool) -> tuple[tf.data.Dataset, int]:
    """From (image, label, index) examples, indices 0..total-1: the held-out part
    (validation=True) or the rest, as (image, label)."""
    held = held_out_count(total, fraction)
    wanted = (lambda index: in_holdout(index, fraction)) if validation else (
        lambda index: tf.logical_not(in_holdout(index, fraction)))
    ds = ds.filter(lambda image, label, index: wanted(index))
    return ds.map(lambda image, label, index: (image, label)), (
        held if validation else total - held)


def load_tfds(name: str, split: str, data_dir: str | None = None,
              download: bool = False) -> tuple[tf.data.Dataset, int]:
    """tfds.load honouring data_dir, then TFDS_DATA_DIR; a clear error if absent."""
    tfds = _tfds()
    data_dir = _tfds_dir(data_dir)
    try:
        ds, info = tfds.load(name, split=split, data_dir=data_dir, download=download,
                             as_supervised=True, shuffle_files=False, with_info=True)
    except (AssertionError, tfds.core.registered.DatasetNotFoundError) as err:
        raise DatasetError(not_prepared(name, split, data_dir)) from err
    except KeyError as err:  # a version folder without its dataset_info.json
        raise DatasetError(not_prepared(name, split, data_dir, "its dataset_info.json is "
                                        f"missing or names no split {split!r}")) from err
    try:
        num_examples = info.splits[split].num_examples
    except KeyError:  # no split metadata (e.g. tfds.testing.mock_data): count
        num_examples = int(ds.cardinality())
        if num_examples < 0:
            num_examples = int(ds.reduce(0, lambda count, *_: count + 1))
    ds = ds.map(lambda image, label: (image, tf.cast(label, tf.int32)))
    return ds, int(num_examples)


def not_prepared(name: str, split: str, data_dir: str | None, why: str = "") -> str:
    """The one line for a TFDS dataset that is not in the data dir: where we looked,
    `why` if known, and how to prepare it."""
    tfds = _tfds()
    root = data_dir or os.path.expanduser("~/tensorflow_datasets")  # TFDS' default
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        where, manual = builder.data_dir, bool(getattr(builder,
                                                       "MANUAL_DOWNLOAD_INSTRUCTIONS", None))
    except Exception:  # noqa: BLE001 (any failure: the message below still holds)
        where, manual = os.path.join(root, name), False
    how = (f"put its archives in {os.path.join(root, 'downloads', 'manual')} and run "
           f"tfds build {name} --data_dir={root}" if manual else
           f"run tfds build {name} --data_dir={root} where there is network, or add "
           f"--download_data")
    why = f" ({why})" if why else ""
    return (f"dataset {name!r} split {split!r} is not prepared in {where}{why}: {how} (or pass "
            f"--data_dir=DIR / set TFDS_DATA_DIR to a prepared TFDS data dir)")


def synthetic(spec: DatasetSpec, size: int, seed: int) -> tf.data.Dataset:
    """Generated, learnable data: a smooth class pattern + noise, a pure function of
    the index. Generated once per process (10,000 examples: ~1 s the first time,
    0.09 s after): a process that runs several runs on it (a sweep, the tests)
    reuses the arrays."""
    images, labels = _synthetic_tensors(spec.num_classes, spec.image_shape, size, seed)
    return tf.data.Dataset.from_tensor_slices((images, labels))


@functools.lru_cache(maxsize=4)
def _synthetic_tensors(num_classes: int, shape: tuple[int, int, int], size: int,
                       seed: int) -> tuple[tf.Tensor, tf.Tensor]:
    """_synthetic_arrays as tensors, kept: a dataset made of a tensor shares its
    buffer (0.001 s), one made of an array copies the 30 MB (0.017 s), and every
    run loads its splits several times (counting, the pipeline, evaluation)."""
    images, labels = _synthetic_arrays(num_classes, shape, size, seed)
    return tf.constant(images), tf.constant(labels)


@functools.lru_cache(maxsize=4)
def _synthetic_arrays(num_classes: int, shape: tuple[int, int, int], size: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images [size, *shape] and int32 labels of `synthetic`, made 256 at a time
    (one op per block, not per image); read-only."""
    # Smooth (4x4 upsampled) class patterns survive the crop and flip augmentation.
    coarse = tf.random.stateless_uniform((num_classes, 4, 4, shape[2]),
                                         seed=(1234, 0), minval=0.0, maxval=255.0)
    patterns = tf.image.resize(coarse, shape[:2], method="bilinear")
    block = 256
    images, labels = [], []
    for first in range(0, size, block):
        key = tf.constant([first // block, seed], tf.int32)
        count = min(block, size - first)
        block_labels = tf.random.stateless_uniform((count,), key, maxval=num_classes,
                                                   dtype=tf.int32)
        noise = tf.random.stateless_normal((count, *shape), key + 7, stddev=40.0)
        images.append(tf.cast(tf.clip_by_value(
            tf.gather(patterns, block_labels) * 0.6 + 50.0 + noise, 0.0, 255.0),
            tf.uint8).numpy())
        labels.append(block_labels.numpy())
    arrays = np.concatenate(images), np.concatenate(labels)
    for array in arrays:
        array.setflags(write=False)
    return arrays
