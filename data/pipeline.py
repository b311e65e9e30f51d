"""Batched input pipelines, one per input worker (`tf.distribute.InputContext`).

Used through `strategy.distribute_datasets_from_function`: each call builds the
pipeline of one input worker, which yields batches of the *per-replica* size.
"""
import math
from typing import Callable

import tensorflow as tf

AUTOTUNE = tf.data.AUTOTUNE


def per_replica_batch_size(global_batch_size: int, context: tf.distribute.InputContext
                           ) -> int:
    replicas = context.num_replicas_in_sync
    if global_batch_size % replicas:
        raise ValueError(
            f"global batch size {global_batch_size} does not divide by the "
            f"{replicas} replicas; use a multiple of {replicas}")
    return global_batch_size // replicas


def _shard(ds: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    # Shard before shuffling, so the shards are disjoint and each worker sees its own.
    if context.num_input_pipelines > 1:
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
    return ds


def make_train(ds: tf.data.Dataset, context: tf.distribute.InputContext,
               global_batch_size: int, augment: Callable, normalize: Callable,
               shuffle_buffer: int, seed: int | None = None,
               cache: bool = True, prepare: Callable | None = None,
               num_examples: int | None = None, shard: bool = True) -> tf.data.Dataset:
    """shard -> prepare -> cache -> shuffle -> repeat -> batch -> augment+normalize
    -> prefetch.

    `prepare` runs per example before the cache (decode-time work such as resizing);
    `augment` and `normalize` take whole batches (see data/augment.py).
    shard=False: `ds` is already this worker's shard (data.sources.load(context=...)).
    """
    batch = per_replica_batch_size(global_batch_size, context)
    if shard:
        ds = _shard(ds, context)
    if prepare is not None:
        ds = ds.map(prepare, num_parallel_calls=AUTOTUNE)
    if cache:
        ds = ds.cache()  # decoded uint8 images: decoding happens once, not every epoch
    if num_examples:  # a buffer beyond the shard only delays the first batch
        shuffle_buffer = min(shuffle_buffer,
                             math.ceil(num_examples / context.num_input_pipelines))
    if shuffle_buffer > 1:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.repeat().batch(batch, drop_remainder=True)
    ds = ds.map(lambda images, labels: normalize(*augment(images, labels)),
                num_parallel_calls=AUTOTUNE)
    return ds.prefetch(AUTOTUNE)


def eval_steps(num_examples: int, global_batch_size: int) -> int:
    """Batches needed to see every example once (the last one padded)."""
    return math.ceil(num_examples / global_batch_size)


def make_eval(ds: tf.data.Dataset, num_examples: int,
              context: tf.distribute.InputContext, global_batch_size: int,
              normalize: Callable, cache: bool = True,
              prepare: Callable | None = None) -> tf.data.Dataset:
    """Exact evaluation: yields (image, label, mask); padded examples have mask 0.

    Every input worker yields the same number of full batches (static shapes, as TPUs
    need), and each real example appears exactly once across all workers.
    """
    batch = per_replica_batch_size(global_batch_size, context)
    per_pipeline = eval_steps(num_examples, global_batch_size) * (
        global_batch_size // context.num_input_pipelines)
    ds = _shard(ds, context)
    if prepare is not None:
        ds = ds.map(prepare, num_parallel_calls=AUTOTUNE)
    ds = ds.map(lambda image, label: (*normalize(image, label), tf.constant(1.0)),
                num_parallel_calls=AUTOTUNE)
    if cache:
        ds = ds.cache()
    element = ds.element_spec
    padding = tf.data.Dataset.from_tensors(
        (tf.zeros(element[0].shape, element[0].dtype), tf.constant(0, element[1].dtype),
         tf.constant(0.0))).repeat()
    ds = ds.concatenate(padding).take(per_pipeline)
    return ds.batch(batch, drop_remainder=True).prefetch(AUTOTUNE)
