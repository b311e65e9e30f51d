"""The run's data wiring: each input worker's training pipeline (resumable at a
step) and the exact evaluation pipeline, built from the config and the dataset's
spec; and read errors turned into messages that name the bad file."""
import contextlib
import os
import re

import numpy as np
import tensorflow as tf

from data import augment, pipeline, sources, stream
from trainer import strategy as strategy_lib
from trainer.config import Config


def image_shape(config: Config, spec: sources.DatasetSpec) -> tuple[int, int, int]:
    size = config.image_size or spec.image_shape[0]
    return (size, size, spec.image_shape[2])


def _prepare(config: Config, spec: sources.DatasetSpec):
    """Per-example decode-time resize, when the run's size differs from the data's."""
    shape = image_shape(config, spec)
    return (augment.make_resize(shape[0])
            if spec.variable_size or shape != spec.image_shape else None)


MEMORY_MODE, STREAM_MODE = "memory", "stream"
CACHE_BUDGET = 0.25  # of this machine's memory: the most --cache=auto decodes into it


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_mode(config: Config, spec: sources.DatasetSpec, train_examples: int,
                num_workers: int = 1) -> tuple[str, sources.RecordFiles | None, str]:
    """(MEMORY_MODE or STREAM_MODE, the training split's record files, why) for
    --cache: memory decodes the data into an in-memory cache before the first step
    (fastest per epoch on small data); none streams from the files. auto streams
    when this worker's decoded share would pass CACHE_BUDGET of the memory, or
    when the augmentation crops while decoding (ImageNet's), and caches otherwise."""
    files = sources.record_files(spec, spec.train_split, config.data_dir)
    if config.cache == "none" and files is None:
        raise sources.DatasetError(
            f"--cache=none streams from record files, and {spec.name} has none here "
            f"(generated data, or TFDS data not on disk); use --cache=memory")
    decoded = stream.decoded_bytes(train_examples // max(num_workers, 1),
                                   image_shape(config, spec))
    budget = int(CACHE_BUDGET * memory_bytes())
    sizes = f"decoded {decoded / 2**30:.2f} GiB, budget {budget / 2**30:.1f} GiB"
    if config.cache == "memory" or files is None:
        return MEMORY_MODE, files, f"--cache={config.cache}: in memory ({sizes})"
    if config.cache == "none":
        return STREAM_MODE, files, f"--cache=none: streaming ({sizes})"
    crop = (config.augment or spec.augment) in augment.DECODE_TIME_CROPS
    if crop or decoded > budget:
        why = "the crop is done while decoding" if crop else "over the budget"
        return STREAM_MODE, files, f"--cache=auto: streaming, {why} ({sizes})"
    return MEMORY_MODE, files, f"--cache=auto: in memory ({sizes})"


def _stream_decode(config: Config, spec: sources.DatasetSpec, augment_name: str):
    """decode(image bytes, seed) for the stream: the decode-time crop, or a plain
    decode and the resize the cache would have applied."""
    shape = image_shape(config, spec)
    if augment_name in augment.DECODE_TIME_CROPS:
        crop = augment.DECODE_TIME_CROPS[augment_name][0]
        return lambda image_bytes, seed: crop(image_bytes, seed, shape[0], shape[2])
    prepare = _prepare(config, spec)

    def decode(image_bytes, seed):
        image = augment.decode_image(image_bytes, shape[2])
        if prepare is not None:
            image, _ = prepare(image, 0)
        image.set_shape(shape)
        return image
    return decode


def train_input_fn(config: Config, spec: sources.DatasetSpec, train_examples: int,
                   start_step: int = 0, end_step: int | None = None,
                   counts: list | None = None, mode: str = MEMORY_MODE,
                   files: sources.RecordFiles | None = None, task=None):
    """The training input for `distribute_datasets_from_function`: each input
    worker's pipeline (in memory, or streamed from `files`: choose_mode), resuming at
    `start_step` (the data position is the step) and ending at `end_step` (None:
    endless), yielding what the task's `training_batch` makes (default: the
    augmented, normalized, mixed batch). counts: gets the examples each of this
    process's pipelines read (for `check_train_count`)."""
    augment_name = config.augment or spec.augment
    normalize = augment.make_normalize(spec.mean, spec.std)
    mix = augment.make_mix(spec.num_classes, config.mixup_alpha, config.cutmix_alpha)

    def batch_maker(augment_fn):
        """The task's own training batch, if it has one (else None: the standard)."""
        if task is None or not task.makes_own_batches():
            return None
        standard = pipeline.standard_batch(augment_fn, normalize, mix)
        return lambda images, labels, key: task.training_batch(images, labels, key,
                                                               standard, normalize)

    def stream_fn(context):
        batch_part = augment.DECODE_TIME_CROPS.get(augment_name, (None, augment_name))[1]
        augment_fn = augment.TRAIN_AUGMENTATIONS[batch_part]
        return stream.make_train_stream(
            files, context, config.batch_size, _stream_decode(config, spec, augment_name),
            augment_fn, normalize, config.shuffle_buffer,
            seed=config.seed, start_step=start_step, end_step=end_step, mix=mix,
            alternating_flip=config.alternating_flip, counts=counts,
            make_batch=batch_maker(augment_fn))

    def train_fn(context):
        ds, _ = sources.load(spec, spec.train_split, config.data_dir, config.download_data,
                             context=context)  # this worker's shard
        return pipeline.make_train(ds, context, config.batch_size,
                                   augment.TRAIN_AUGMENTATIONS[augment_name], normalize,
                                   config.shuffle_buffer, seed=config.seed,
                                   prepare=_prepare(config, spec),
                                   num_examples=train_examples, shard=False,
                                   start_step=start_step, end_step=end_step, mix=mix,
                                   alternating_flip=config.alternating_flip,
                                   counts=counts, make_batch=batch_maker(
                                       augment.TRAIN_AUGMENTATIONS[augment_name]))
    return stream_fn if mode == STREAM_MODE else train_fn


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


def init_images(config: Config, spec: sources.DatasetSpec, count: int = 5000
                ) -> np.ndarray:
    """The first `count` training images as the model sees them (resized,
    normalized, not augmented): float32 [count, H, W, C], the same on every worker.
    For layers initialised from data (models.init_from_data)."""
    ds, _ = sources.load(spec, spec.train_split, config.data_dir, config.download_data)
    prepare = _prepare(config, spec)
    if prepare is not None:
        ds = ds.map(prepare)
    images, labels = next(iter(ds.take(count).batch(count)))
    images, _ = augment.make_normalize(spec.mean, spec.std)(images, labels)
    return images.numpy()


def _eval_prepare(config: Config, spec: sources.DatasetSpec):
    """ImageNet-style data is evaluated on the central 224/256 crop; the rest is
    resized as for training."""
    if central_crop(config, spec):
        return augment.make_central_crop(image_shape(config, spec)[0])
    return _prepare(config, spec)


def central_crop(config: Config, spec: sources.DatasetSpec) -> bool:
    """Whether evaluation (and serving) takes the central 224/256 crop."""
    return (config.augment or spec.augment) in augment.DECODE_TIME_CROPS


def eval_image(config: Config, spec: sources.DatasetSpec, image) -> np.ndarray:
    """Any [H, W, C] image -> uint8 at the run's size, as evaluation prepares it
    (resized, or the central crop for ImageNet-style data)."""
    size = image_shape(config, spec)[0]
    if central_crop(config, spec):
        image, _ = augment.make_central_crop(size)(tf.convert_to_tensor(image), 0)
        return tf.cast(image, tf.uint8).numpy()
    return resize_uint8(image, size)


def eval_input_fn(config: Config, spec: sources.DatasetSpec, cache: bool = True,
                  split: str | None = None):
    """The evaluation input: every example of `split` (default: the evaluation
    split) once, padded to full batches (mask 0); cache=False reads (and decodes)
    it again at every evaluation."""
    def eval_fn(context):
        ds, n = sources.load(spec, split or spec.eval_split, config.data_dir,
                             config.download_data)
        return pipeline.make_eval(ds, n, context, config.eval_batch_size or config.batch_size,
                                  augment.make_normalize(spec.mean, spec.std),
                                  cache=cache, prepare=_eval_prepare(config, spec))
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
