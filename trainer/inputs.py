"""The run's data wiring: each input worker's training pipeline (resumable at a
step) and the exact evaluation pipeline, built from the config and the dataset's
spec; and read errors turned into messages that name the bad file."""
import contextlib

import numpy as np
import tensorflow as tf

from data import augment, pipeline, sources
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


def train_input_fn(config: Config, spec: sources.DatasetSpec, train_examples: int,
                   start_step: int = 0, end_step: int | None = None,
                   counts: list | None = None):
    """The training input for `distribute_datasets_from_function`: each input
    worker's pipeline, resuming at `start_step` (the data position is the step) and
    ending at `end_step` (None: endless). counts: gets the examples each of this
    process's pipelines read (for `check_train_count`)."""
    train_augment = augment.TRAIN_AUGMENTATIONS[config.augment or spec.augment]

    def train_fn(context):
        ds, _ = sources.load(spec, spec.train_split, config.data_dir, config.download_data,
                             context=context)  # this worker's shard
        return pipeline.make_train(ds, context, config.batch_size, train_augment,
                                   augment.make_normalize(spec.mean, spec.std),
                                   config.shuffle_buffer, seed=config.seed,
                                   prepare=_prepare(config, spec),
                                   num_examples=train_examples, shard=False,
                                   start_step=start_step, end_step=end_step,
                                   mix=augment.make_mix(spec.num_classes, config.mixup_alpha,
                                                        config.cutmix_alpha),
                                   alternating_flip=config.alternating_flip,
                                   counts=counts)
    return train_fn


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


def eval_input_fn(config: Config, spec: sources.DatasetSpec):
    """The evaluation input: every example once, padded to full batches (mask 0)."""
    def eval_fn(context):
        ds, n = sources.load(spec, spec.eval_split, config.data_dir, config.download_data)
        return pipeline.make_eval(ds, n, context, config.batch_size,
                                  augment.make_normalize(spec.mean, spec.std),
                                  prepare=_prepare(config, spec))
    return eval_fn


@contextlib.contextmanager
def data_errors_explained(spec: sources.DatasetSpec):
    """A corrupt input file surfaces deep in the graph without its name: find it."""
    try:
        yield
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
        culprit = sources.explain_read_error(spec)
        if culprit:
            raise sources.DatasetError(culprit) from err
        raise
