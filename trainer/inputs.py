"""The run's data: its settings (`DataSettings`), the one object a run reads its
data through (`RunData`: the dataset's spec, where it lives, the image shape, the
batch sizes), each input worker's training pipeline (resumable at a step), the
exact evaluation pipeline, and read errors turned into messages that name the
bad file."""
import contextlib
import dataclasses
import os
import re
import zlib
from typing import Any, Callable

from absl import logging
import numpy as np
import tensorflow as tf

from data import augment, pipeline, sources, stream
from trainer import settings
from trainer import strategy as strategy_lib

_ = settings.section("data")  # (--help's heading, unless a field names another)
MAX_IMAGE_SIZE = 4096  # a side; larger is a typo (one such image is 200 MB of floats)


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What a run reads and how it augments it (flags of the same names)."""
    dataset: str = _("cifar10", "Dataset: {datasets}, any TFDS image-classification "
                     "dataset as NAME[:VERSION] (e.g. cifar100, imagenet2012, food101: "
                     "classes, sizes and splits from its info), or "
                     "'tfrecord:PATTERN[;eval=EVAL_PATTERN][;classes=N]' (TFRecords in "
                     "the flowers codelab's format, local or gs://; without eval= a "
                     "fixed part is held out).", resume=settings.NEVER)
    train_split: str = _("", "TFDS split to train on (default: train; slices work, e.g. "
                         "'train[:90%]').")
    eval_split: str = _("", "TFDS split to evaluate on (default: validation, else test, "
                        "else a fixed 15% held out of the training split).")
    image_size: int = _(0, "Train and evaluate at this square size (0: the dataset's "
                        "own).", low=0)
    augment: str = _("", f"Training augmentation: "
                     f"{'|'.join(augment.TRAIN_AUGMENTATIONS)} (default: the dataset's "
                     "own: pad_crop_flip for CIFAR, flip_saturation for flowers).",
                     choices=tuple(augment.TRAIN_AUGMENTATIONS))
    alternating_flip: bool = _(False, "Flip each training image on alternate epochs "
                               "(its first-epoch flip at random), instead of at random "
                               "every epoch (airbench). Needs an augmentation that does "
                               "not flip by itself, e.g. --augment=translate.")
    shuffle_buffer: int = _(10_000, "Training shuffle: blocks of this many examples, "
                            "visited in a random order, each permuted; the order depends "
                            "only on --seed and the epoch (0: no shuffle).", low=0)
    cache: str = _("auto", "auto|memory|none: memory decodes the training data into an "
                   "in-memory cache before the first step; none streams it from its "
                   "files, decoding on the fly (any size, bounded memory, exact "
                   "resume); auto streams when the decoded data would pass a quarter of "
                   "this machine's memory or the augmentation crops while decoding "
                   "(ImageNet's), else caches.", choices=("auto", "memory", "none"),
                   resume=True)
    data_dir: str | None = _(None, "TFDS data dir; default: $TFDS_DATA_DIR, else the "
                             "TFDS default.", resume=True)
    download_data: bool = _(False, "Let TFDS download and prepare a missing dataset "
                            "(needs network).", resume=True)
    mixup_alpha: float = _(0.0, "Mixup: blend pairs of training images and their "
                           "targets with a Beta(alpha, alpha) weight (0: off).",
                           topic="the training step", low=0)
    cutmix_alpha: float = _(0.0, "CutMix: paste a box of another training image, "
                            "targets mixed by area, Beta(alpha, alpha) (0: off). With "
                            "mixup too, each batch uses one of the two at random.",
                            topic="the training step", low=0)


@dataclasses.dataclass(frozen=True)
class RunData:
    """The data a run reads, made once (trainer/build.py `run_data`): the dataset's
    spec (splits, classes, normalization), the data settings, and the global batch
    sizes and seed its pipelines use."""
    spec: sources.DatasetSpec
    settings: DataSettings
    batch_size: int
    eval_batch_size: int  # (0: batch_size)
    seed: int = 0

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The run's image shape: --image_size, else the dataset's own."""
        size = self.settings.image_size or self.spec.image_shape[0]
        return (size, size, self.spec.image_shape[2])

    @property
    def augment_name(self) -> str:
        return self.settings.augment or self.spec.augment

    def load(self, split: str, context: tf.distribute.InputContext | None = None
             ) -> tuple[tf.data.Dataset, int]:
        """(examples of `split`, their count); with `context`, this worker's shard."""
        return sources.load(self.spec, split, self.settings.data_dir,
                            self.settings.download_data, context=context)

    def counts(self) -> tuple[int, int]:
        """(training examples, evaluation examples)."""
        return tuple(sources.count(self.spec, split, self.settings.data_dir,
                                   self.settings.download_data)
                     for split in (self.spec.train_split, self.spec.eval_split))


def _prepare(data: RunData):
    """Per-example decode-time resize, when the run's size differs from the data's."""
    return (augment.make_resize(data.image_shape[0])
            if data.spec.variable_size or data.image_shape != data.spec.image_shape
            else None)


MEMORY_MODE, STREAM_MODE = "memory", "stream"
CACHE_BUDGET = 0.25  # of this machine's memory: the most --cache=auto decodes into it


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_mode(data: RunData, train_examples: int,
                num_workers: int = 1) -> tuple[str, sources.RecordFiles | None, str]:
    """(MEMORY_MODE or STREAM_MODE, the training split's record files, why) for
    --cache: memory decodes the data into an in-memory cache before the first step
    (fastest per epoch on small data); none streams from the files. auto streams
    when this worker's decoded share would pass CACHE_BUDGET of the memory, or
    when the augmentation crops while decoding (ImageNet's), and caches otherwise."""
    spec, cache = data.spec, data.settings.cache
    files = sources.record_files(spec, spec.train_split, data.settings.data_dir)
    if cache == "none" and files is None:
        raise sources.DatasetError(
            f"--cache=none streams from record files, and {spec.name} has none here "
            f"(generated data, or TFDS data not on disk); use --cache=memory")
    decoded = stream.decoded_bytes(train_examples // max(num_workers, 1),
                                   data.image_shape)
    budget = int(CACHE_BUDGET * memory_bytes())
    sizes = f"decoded {decoded / 2**30:.2f} GiB, budget {budget / 2**30:.1f} GiB"
    if cache == "memory" or files is None:
        return MEMORY_MODE, files, f"--cache={cache}: in memory ({sizes})"
    if cache == "none":
        return STREAM_MODE, files, f"--cache=none: streaming ({sizes})"
    crop = data.augment_name in augment.DECODE_TIME_CROPS
    if crop or decoded > budget:
        why = "the crop is done while decoding" if crop else "over the budget"
        return STREAM_MODE, files, f"--cache=auto: streaming, {why} ({sizes})"
    return MEMORY_MODE, files, f"--cache=auto: in memory ({sizes})"


def _stream_decode(data: RunData, augment_name: str):
    """decode(image bytes, seed) for the stream: the decode-time crop, or a plain
    decode and the resize the cache would have applied."""
    shape = data.image_shape
    if augment_name in augment.DECODE_TIME_CROPS:
        crop = augment.DECODE_TIME_CROPS[augment_name][0]
        return lambda image_bytes, seed: crop(image_bytes, seed, shape[0], shape[2])
    prepare = _prepare(data)

    def decode(image_bytes, seed):
        image = augment.decode_image(image_bytes, shape[2])
        if prepare is not None:
            image, _ = prepare(image, 0)
        image.set_shape(shape)
        return image
    return decode


@dataclasses.dataclass(frozen=True)
class Stream:
    """One named input stream of a task (`Task.streams`): the step gets a batch of
    every stream at every step, {name: {"image", "label", "index", ...}}.

    batch_factor: its GLOBAL batch is this times --batch_size (FixMatch's
    unlabelled stream: 7), so the replicas always divide it.
    examples: which examples of its split: "all"; "first:N", the first N in the
    split's order; "balanced:N", the first N / classes of each class (a labelled
    subset as semi-supervised papers take it). A subset is decoded into memory
    (small by nature); "all" follows --cache (streams from the files with
    --cache=none).
    split: another split ("": the training split) of the run's dataset, or of
    `dataset`: another dataset (as --dataset names one), resized to the run's
    image size and normalized as the run's images (the model takes both); its
    labels are its own.
    make_batch(images, labels, key, standard, normalize) -> dict: its batch, as
    `Task.training_batch` (weak and strong views); None: the run's standard batch.
    Each stream is a pure function of (--seed, its name, the step): it resumes
    exactly, on any number of replicas and workers. Its "index" keys are unique
    within the stream (per-example draws: give each stream's draws their own name)."""
    batch_factor: int = 1
    examples: str = "all"
    split: str = ""
    make_batch: Callable | None = None
    dataset: str = ""

    def __post_init__(self):
        kind, _, count = self.examples.partition(":")
        if not (self.examples == "all" or (kind in ("first", "balanced") and
                                           count.isdigit() and int(count) > 0)):
            raise settings.ConfigError(
                f"Stream examples={self.examples!r}: give 'all', 'first:N' or "
                f"'balanced:N' with N > 0")
        if not isinstance(self.batch_factor, int) or self.batch_factor < 1:
            raise settings.ConfigError(f"Stream batch_factor={self.batch_factor!r}: a "
                                       f"whole number >= 1")

    def size(self, num_classes: int) -> int | None:
        """How many examples the stream holds (None: all of its split)."""
        if self.examples == "all":
            return None
        kind, _, count = self.examples.partition(":")
        return int(count) if kind == "first" else int(count) // num_classes * num_classes


def _selected(ds: tf.data.Dataset, stream: Stream, num_classes: int) -> tf.data.Dataset:
    """The stream's examples of a whole split (in its order, the same on every
    worker: the shards are taken after)."""
    kind, _, count = stream.examples.partition(":")
    if kind == "first":
        return ds.take(int(count))
    per_class = int(count) // num_classes

    def keep(taken, example):  # the first `per_class` of each class
        label = tf.cast(example[1], tf.int64)
        full = tf.reduce_all(taken >= per_class)  # (before this one: stop reading)
        fresh = taken[label] < per_class
        taken = tf.tensor_scatter_nd_add(taken, [[label]], [tf.cast(fresh, tf.int64)])
        return taken, (full, fresh, example)

    def reading(full, fresh, example):
        return tf.logical_not(full)

    def is_fresh(full, fresh, example):
        return fresh

    def example_of(full, fresh, example):
        return example

    return (ds.scan(tf.zeros([num_classes], tf.int64), keep).take_while(reading)
            .filter(is_fresh).map(example_of))


def _stream_seed(seed: int, name: str) -> int:
    """A stream's own seed: streams of one run shuffle and augment apart."""
    return seed + zlib.crc32(name.encode()) % 1_000_003


def train_input_fn(data: RunData, train_examples: int,
                   start_step: int = 0, end_step: int | None = None,
                   counts: list | None = None, mode: str = MEMORY_MODE,
                   files: sources.RecordFiles | None = None,
                   task_input: Callable | dict | None = None):
    """The training input for `distribute_datasets_from_function`: each input
    worker's pipeline (in memory, or streamed from `files`: choose_mode), resuming at
    `start_step` (the data position is the step) and ending at `end_step` (None:
    endless). task_input (trainer/build.py's Run.task_input): a task's own
    `training_batch` (yielded instead of the augmented, normalized, mixed batch),
    or its named streams ({name: Stream}: a dict of their batches). counts: gets
    the examples each of this process's pipelines of the whole training split read
    (for `check_train_count`)."""
    if isinstance(task_input, dict):
        counted = next((name for name, stream in task_input.items()  # (one is counted)
                        if stream.examples == "all" and not stream.split
                        and not stream.dataset), None)
        makers = {name: _stream_input_fn(data, name, stream, train_examples, start_step,
                                         end_step, counts if name == counted else None,
                                         mode, files)
                  for name, stream in task_input.items()}
        return lambda context: tf.data.Dataset.zip(
            {name: make(context) for name, make in makers.items()})
    own_batch = task_input
    spec, settings_ = data.spec, data.settings
    augment_name = data.augment_name
    normalize = augment.make_normalize(spec.mean, spec.std)
    mix = augment.make_mix(spec.num_classes, settings_.mixup_alpha, settings_.cutmix_alpha)

    def batch_maker(augment_fn):
        return _task_batch(own_batch, augment_fn, normalize, mix)

    def stream_fn(context):
        batch_part = augment.DECODE_TIME_CROPS.get(augment_name, (None, augment_name))[1]
        augment_fn = augment.TRAIN_AUGMENTATIONS[batch_part]
        return stream.make_train_stream(
            files, context, data.batch_size, _stream_decode(data, augment_name),
            augment_fn, normalize, settings_.shuffle_buffer,
            seed=data.seed, start_step=start_step, end_step=end_step, mix=mix,
            alternating_flip=settings_.alternating_flip, counts=counts,
            make_batch=batch_maker(augment_fn))

    def train_fn(context):
        ds, _ = data.load(spec.train_split, context)  # this worker's shard
        return pipeline.make_train(ds, context, data.batch_size,
                                   augment.TRAIN_AUGMENTATIONS[augment_name], normalize,
                                   settings_.shuffle_buffer, seed=data.seed,
                                   prepare=_prepare(data),
                                   num_examples=train_examples, shard=False,
                                   start_step=start_step, end_step=end_step, mix=mix,
                                   alternating_flip=settings_.alternating_flip,
                                   counts=counts, make_batch=batch_maker(
                                       augment.TRAIN_AUGMENTATIONS[augment_name]))
    return stream_fn if mode == STREAM_MODE else train_fn


def _task_batch(own_batch: Callable | None, augment_fn: Callable, normalize: Callable,
                mix: Callable | None) -> Callable | None:
    """make_batch(images, labels, key) of a task's own batch (`training_batch`, a
    stream's `make_batch`), given the standard batch and the normalization; None
    without one (the pipeline's standard batch)."""
    if own_batch is None:
        return None
    standard = pipeline.standard_batch(augment_fn, normalize, mix)
    return lambda images, labels, key: own_batch(images, labels, key, standard, normalize)


def _stream_input_fn(data: RunData, name: str, stream: Stream, train_examples: int,
                     start_step: int, end_step: int | None, counts: list | None,
                     mode: str, files: sources.RecordFiles | None):
    """One stream's input function (train_input_fn's, with the stream's batch,
    seed, examples and batch)."""
    data = dataclasses.replace(data, batch_size=data.batch_size * stream.batch_factor,
                               seed=_stream_seed(data.seed, name))
    if stream.dataset:  # at the run's size, normalized as the run's images
        other = sources.get_spec(stream.dataset, data.settings.data_dir)
        if other.image_shape[2] != data.image_shape[2]:
            raise sources.DatasetError(
                f"stream {name!r}: {stream.dataset} has {other.image_shape[2]} channels, "
                f"the run's images {data.image_shape[2]}")
        data = dataclasses.replace(
            data, spec=dataclasses.replace(other, mean=data.spec.mean, std=data.spec.std),
            settings=dataclasses.replace(data.settings, image_size=data.image_shape[0],
                                         augment=data.augment_name))
        files = None  # (its own files: held in memory)
    spec = data.spec
    split = stream.split or spec.train_split
    if stream.examples == "all" and split == spec.train_split and not stream.dataset:
        return train_input_fn(data, train_examples, start_step, end_step, counts, mode,
                              files, stream.make_batch)
    size = stream.size(spec.num_classes)
    settings_ = data.settings
    normalize = augment.make_normalize(spec.mean, spec.std)
    mix = augment.make_mix(spec.num_classes, settings_.mixup_alpha, settings_.cutmix_alpha)
    augment_fn = augment.TRAIN_AUGMENTATIONS[data.augment_name]
    make_batch = _task_batch(stream.make_batch, augment_fn, normalize, mix)

    def subset_fn(context):
        per_replica = pipeline.per_replica_batch_size(data.batch_size, context)
        if size is not None and size // context.num_input_pipelines < per_replica:
            raise settings.ConfigError(
                f"stream {name!r}: examples={stream.examples!r} gives "
                f"{size // context.num_input_pipelines} examples to each input worker, "
                f"fewer than its batch of {per_replica}; ask for more examples or give "
                f"a smaller --batch_size")
        ds, total = data.load(split)  # all of it on every worker: the shard comes after
        if size is not None:
            ds = _selected(ds, stream, spec.num_classes)
        expected = total if size is None else size
        read: list[int] = []
        made = pipeline.make_train(ds, context, data.batch_size, augment_fn, normalize,
                                   settings_.shuffle_buffer, seed=data.seed,
                                   prepare=_prepare(data), num_examples=expected,
                                   start_step=start_step, end_step=end_step, mix=mix,
                                   alternating_flip=settings_.alternating_flip,
                                   counts=read, make_batch=make_batch)
        shard = len(range(context.input_pipeline_id, expected, context.num_input_pipelines))
        if read[0] != shard:
            raise sources.DatasetError(
                f"stream {name!r}: {split} holds {read[0]} of the {shard} examples "
                f"{stream.examples!r} asks for (in this worker's shard); ask for fewer")
        return made
    return subset_fn


@dataclasses.dataclass(frozen=True)
class Pipelines:
    """A run's distributed input: `train` (each worker's stream, resumed at the
    step) and `eval` (every example once), and whether the data is in memory."""
    train: Any
    eval: Any
    in_memory: bool


def distribute(strategy: tf.distribute.Strategy, data: RunData, train_examples: int,
               start_step: int, end_step: int, task_input: Callable | dict | None = None
               ) -> Pipelines:
    """The run's input pipelines on `strategy`: in memory (decoded once, before the
    first step) or streamed from the files (choose_mode), the training stream from
    `start_step` to `end_step` yielding the task's batches; a training split that
    reads fewer examples than promised is one DatasetError line."""
    mode, record_files, why = choose_mode(data, train_examples,
                                          strategy_lib.num_workers(strategy))
    logging.info("Input: %s", why)
    with data_errors_explained(data.spec):  # the training cache is filled here
        counts: list[int] = []  # what each pipeline read: all that was promised?
        train = strategy.distribute_datasets_from_function(
            train_input_fn(data, train_examples, start_step, end_step, counts, mode,
                           record_files, task_input))
        if counts or not isinstance(task_input, dict):  # (streams of subsets: their own)
            check_train_count(strategy, data.spec, counts, train_examples)
        evaluation = strategy.distribute_datasets_from_function(
            eval_input_fn(data, cache=mode == MEMORY_MODE))
    return Pipelines(train, evaluation, mode == MEMORY_MODE)


def check_train_count(strategy: tf.distribute.Strategy, spec: sources.DatasetSpec,
                      counts: list[int], promised: int) -> None:
    """DatasetError (one line) unless the training pipelines of all workers read
    `promised` examples together: never a silent smaller epoch."""
    read = sum(counts)
    if strategy_lib.is_multi_worker(strategy):  # each worker read its shard: add up
        local = len(strategy.extended.worker_devices)  # (replicas of this worker)
        read = int(round(float(strategy.reduce(
            tf.distribute.ReduceOp.SUM,
            strategy.run(lambda: tf.constant(read / local, tf.float64)), axis=None))))
    sources.check_count(spec, False, read, promised)


def resize_uint8(image, size: int) -> np.ndarray:
    """Any [H, W, 3] image -> uint8 [size, size, 3], resized as evaluation does."""
    image = tf.convert_to_tensor(image)
    if tuple(image.shape[:2]) != (size, size):
        image, _ = augment.make_resize(size)(image, 0)
    return tf.cast(image, tf.uint8).numpy()


def init_images(data: RunData, count: int = 5000) -> np.ndarray:
    """The first `count` training images as the model sees them (resized,
    normalized, not augmented): float32 [count, H, W, C], the same on every worker.
    For layers initialised from data (models.init_from_data)."""
    ds, _ = data.load(data.spec.train_split)
    prepare = _prepare(data)
    if prepare is not None:
        ds = ds.map(prepare)
    images, labels = next(iter(ds.take(count).batch(count)))
    images, _ = augment.make_normalize(data.spec.mean, data.spec.std)(images, labels)
    return images.numpy()


def _eval_prepare(data: RunData):
    """ImageNet-style data is evaluated on the central 224/256 crop; the rest is
    resized as for training."""
    if central_crop(data):
        return augment.make_central_crop(data.image_shape[0])
    return _prepare(data)


def central_crop(data: RunData) -> bool:
    """Whether evaluation (and serving) takes the central 224/256 crop."""
    return data.augment_name in augment.DECODE_TIME_CROPS


def eval_image(data: RunData, image) -> np.ndarray:
    """Any [H, W, C] image -> uint8 at the run's size, as evaluation prepares it
    (resized, or the central crop for ImageNet-style data)."""
    size = data.image_shape[0]
    if central_crop(data):
        image, _ = augment.make_central_crop(size)(tf.convert_to_tensor(image), 0)
        return tf.cast(image, tf.uint8).numpy()
    return resize_uint8(image, size)


def eval_input_fn(data: RunData, cache: bool = True, split: str | None = None):
    """The evaluation input: every example of `split` (default: the evaluation
    split) once, padded to full batches (mask 0); cache=False reads (and decodes)
    it again at every evaluation."""
    def eval_fn(context):
        ds, n = data.load(split or data.spec.eval_split)
        return pipeline.make_eval(ds, n, context, data.eval_batch_size or data.batch_size,
                                  augment.make_normalize(data.spec.mean, data.spec.std),
                                  cache=cache, prepare=_eval_prepare(data))
    return eval_fn


# What tf.data's assert_cardinality says (stream.py's, and TFDS' own on each split).
_CARDINALITY = re.compile(r"expected to contain \d+ elements but contained (only|at "
                          r"least) \d+ elements")


@contextlib.contextmanager
def data_errors_explained(spec: sources.DatasetSpec):
    """A corrupt input file surfaces deep in the graph without its name: find it."""
    try:
        yield
    except tf.errors.FailedPreconditionError as err:  # a count asserted in a pipeline
        counted = _CARDINALITY.search(str(err))
        if counted is None:
            raise
        # The error says neither the split (training or evaluation: both assert
        # their count) nor the file: the files' record headers say both.
        raise sources.DatasetError(sources.find_miscounted(spec) or _miscounted_split(
            spec, counted.group(0))) from err
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
        culprit = sources.explain_read_error(spec)
        if culprit is None and isinstance(err, tf.errors.DataLossError):
            culprit = sources.find_miscounted(spec)  # (TFDS' files: one cut short)
        if culprit:
            raise sources.DatasetError(culprit) from err
        raise


def _miscounted_split(spec: sources.DatasetSpec, counted: str) -> str:
    """The line when no file could be found at fault (e.g. a file gone since)."""
    where = dict.fromkeys(sources.describe_split(spec, validation)
                          for validation in (False, True))
    return (f"{' or '.join(where)}: {counted} (a file is missing or cut short); "
            f"{sources.restore_advice(spec)}")
