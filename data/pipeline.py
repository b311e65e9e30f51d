"""Batched input pipelines, one per input worker (`tf.distribute.InputContext`).

Used through `strategy.distribute_datasets_from_function`: each call builds the
pipeline of one input worker, which yields batches of the *per-replica* size, as
dicts: training {"image", "label", "index"} (+ "target" when mixing; or what the
caller's `make_batch` makes, e.g. two views, + "index"), evaluation {"image",
"label", "index", "mask"}. "index" is each example's key, unique in the run (its
index in the dataset where one worker reads it all, as trainer.check_step's
pipeline does), for per-example random draws in the step.
"""
import math
from typing import Callable

import tensorflow as tf

from data import augment as augment_lib

AUTOTUNE = tf.data.AUTOTUNE


def per_replica_batch_size(global_batch_size: int, context: tf.distribute.InputContext
                           ) -> int:
    # The trainer checks once, before building pipelines, that the replicas divide it.
    return global_batch_size // context.num_replicas_in_sync


def _shard(ds: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    # Shard before shuffling, so the shards are disjoint and each worker sees its own.
    if context.num_input_pipelines > 1:
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
    return ds


def make_train(ds: tf.data.Dataset, context: tf.distribute.InputContext,
               global_batch_size: int, augment: Callable, normalize: Callable,
               shuffle_buffer: int, seed: int = 0,
               cache: bool = True, prepare: Callable | None = None,
               num_examples: int | None = None, shard: bool = True,
               start_step: int = 0, mix: Callable | None = None,
               end_step: int | None = None,
               alternating_flip: bool = False,
               counts: list | None = None,
               make_batch: Callable | None = None) -> tf.data.Dataset:
    """shard -> prepare -> cache blocks -> [per epoch: block_shuffle -> batch] -> skip to
    `start_step` -> augment -> normalize -> mix -> prefetch.

    Yields {"image": float32 [B, H, W, C], "label": int32 [B], "index": int32 [B]}
    per replica, plus "target": float32 [B, num_classes] (soft targets) when `mix`
    is given. make_batch(images, labels, key) -> dict replaces augment, normalize
    and mix (a task's own batch, e.g. two views; `key` as augment's).

    The stream is a pure function of (seed, input pipeline, epoch, batch): each
    epoch's order is shuffled with a seed made from the epoch number, and each
    batch's augmentation and mix are seeded by (epoch, batch). A run resumed at
    `start_step` therefore sees exactly the batches an uninterrupted run would have
    seen, and the skip only replays (shuffles and batches, no augmentation) part of
    one epoch.

    `prepare` runs per example before the cache (decode-time work such as resizing);
    `augment(images, labels, seed)` and `normalize` take whole batches;
    `mix(images, labels, seed) -> (images, targets)` takes normalized batches
    (data.augment.make_mix). end_step: the stream ends there (None: endless).
    alternating_flip: airbench's alternating flip (data.augment.alternating_flip),
    before `augment`, keyed by each example's index in this worker's shard.
    shard=False: `ds` is already this worker's shard (data.sources.load(context=...)).
    counts: if given, the number of examples this pipeline read is appended to it
    (the caller compares it with what the data promises).
    """
    batch = per_replica_batch_size(global_batch_size, context)
    if shard:
        ds = _shard(ds, context)
    if prepare is not None:
        ds = ds.map(prepare, num_parallel_calls=AUTOTUNE)
    if num_examples:  # a buffer beyond the shard only delays the first batch
        shuffle_buffer = min(shuffle_buffer,
                             math.ceil(num_examples / context.num_input_pipelines))
    # Blocks of examples are the unit of caching, shuffling and batching: per-example
    # elements cost tf.data ~20 us each, which a fast model on 2 cores notices.
    block = shuffle_buffer if shuffle_buffer > 1 else batch

    def with_indices(number, examples):
        # Each example's index in the shard travels with it (the alternating flip's
        # key), numbered a block at a time: a per-example map would cost ~40 us each.
        count = tf.shape(tf.nest.flatten(examples)[0])[0]
        return (*examples, number * block + tf.range(count, dtype=tf.int64))

    blocks = ds.batch(block).enumerate().map(with_indices)
    if cache:  # decoded uint8 images: decoding happens once, not every epoch
        blocks = blocks.cache()
    examples = int(ds.cardinality())
    if examples < 0 or cache:
        # Counts, and fills the cache: the shuffle reads blocks out of order, and a
        # cache that is never read to its end would go back to the source every epoch.
        examples = fill_cache(blocks)
    if counts is not None:
        counts.append(examples)
    pipeline_seed = seed * 7919 + context.input_pipeline_id  # workers differ
    # The data position: this pipeline's replicas consume `per_step` batches a step.
    per_step = context.num_replicas_in_sync // context.num_input_pipelines
    ds = _epochs(blocks, examples, batch, shuffle_buffer, pipeline_seed,
                 start_step * per_step)
    if end_step is not None:
        # Finite: the pipeline's threads finish with the last batch. An endless
        # stream's iterator can hang TensorFlow's teardown at exit (seen with
        # MultiWorkerMirroredStrategy: ~Iterator waiting on a tf.data thread).
        ds = ds.take((end_step - start_step) * per_step)

    # (keys: i * pipelines + p for example i of pipeline p's shard, unique in the run)
    return augment_and_prefetch(ds, pipeline_seed, augment, normalize, mix,
                                alternating_flip, make_batch,
                                index_stride=context.num_input_pipelines,
                                index_offset=context.input_pipeline_id)


def standard_batch(augment: Callable, normalize: Callable,
                   mix: Callable | None) -> Callable:
    """make_batch(images, labels, key) of the usual training batch: augment,
    normalize, mix -> {"image", "label"[, "target"]}."""
    def make_batch(images, labels, key):
        if mix is None:  # the whole key, as before mixing existed: same batches bitwise
            images, labels = normalize(*augment(images, labels, key))
            return {"image": images, "label": tf.cast(labels, tf.int32)}
        augment_key, mix_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        images, labels = normalize(*augment(images, labels, augment_key))
        images, targets = mix(images, labels, mix_key)
        return {"image": images, "label": tf.cast(labels, tf.int32), "target": targets}
    return make_batch


def augment_and_prefetch(ds: tf.data.Dataset, pipeline_seed: int, augment: Callable,
                         normalize: Callable, mix: Callable | None,
                         alternating_flip: bool, make_batch: Callable | None = None,
                         index_stride: int = 1, index_offset: int = 0) -> tf.data.Dataset:
    """(position, images, labels, indices) batches -> the step's dicts, augmented by
    a seed made of (pipeline seed, epoch, batch): a pure function of the position.
    make_batch(images, labels, key): the dict (default: standard_batch); each
    example's "index" is indices * index_stride + index_offset."""
    make_batch = make_batch or standard_batch(augment, normalize, mix)

    def augment_normalize_mix(position, images, labels, indices):
        key = tf.cast(tf.stack([pipeline_seed, position[0] * 1_000_003 + position[1]]),
                      tf.int64)
        if alternating_flip:
            images = augment_lib.alternating_flip(images, indices, position[0],
                                                  pipeline_seed)
        batch = make_batch(images, labels, key)
        # (int32: TPUs take it; a key, so wrapping beyond 2^31 examples is harmless)
        return {**batch, "index": tf.cast(indices * index_stride + index_offset, tf.int32)}

    ds = ds.map(augment_normalize_mix, num_parallel_calls=AUTOTUNE)
    return ds.prefetch(AUTOTUNE)


def _epochs(blocks: tf.data.Dataset, examples: int, batch: int, shuffle_buffer: int,
            seed: int, start_batch: int) -> tf.data.Dataset:
    """Endless (position, images, labels) batches from batch number `start_batch` on;
    position = [epoch, batch in epoch]. Epoch e's order depends only on (seed, e)."""
    batches_per_epoch = examples // batch
    if batches_per_epoch == 0:
        raise ValueError(f"this input pipeline has fewer examples than one batch of "
                         f"{batch}; lower the batch size")
    num_blocks = math.ceil(examples / (shuffle_buffer if shuffle_buffer > 1 else batch))

    def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        shuffled = block_shuffle(blocks, num_blocks, shuffle_buffer > 1, tf.stack(
            [tf.constant(seed, tf.int64), epoch]))
        batches = shuffled.rebatch(batch, drop_remainder=True).take(batches_per_epoch)
        return batches.enumerate().map(
            lambda index, example: (tf.stack([epoch, index]), *example))

    start_epoch, skip = divmod(start_batch, batches_per_epoch)
    return tf.data.Dataset.range(start_epoch, 2**62).flat_map(one_epoch).skip(skip)


def block_shuffle(blocks: tf.data.Dataset, num_blocks: int, shuffle: bool,
                  seed: tf.Tensor) -> tf.data.Dataset:
    """A two-level shuffle of a dataset of blocks (batched examples) whose order is a
    pure function of `seed` (a [2] int64 tensor), which `Dataset.shuffle` cannot
    promise for a tensor seed: the blocks are visited in a random order, and each
    block is randomly permuted. One block holding all the data is a full shuffle.
    shuffle=False: the blocks as they are.
    """
    if not shuffle:
        return blocks
    block_order = tf.argsort(tf.random.stateless_uniform([num_blocks], seed))

    def permute(index, position):
        # skip() over a filled in-memory cache only steps over tensor handles: cheap.
        examples = blocks.skip(tf.cast(position, tf.int64)).take(1).get_single_element()
        count = tf.shape(tf.nest.flatten(examples)[0])[0]
        order = tf.argsort(tf.random.stateless_uniform([count], seed + [0, index + 1]))
        return tf.data.Dataset.from_tensors(
            tf.nest.map_structure(lambda t: tf.gather(t, order), examples))

    return tf.data.Dataset.from_tensor_slices(block_order).enumerate().flat_map(permute)


def fill_cache(blocks: tf.data.Dataset) -> int:
    """One pass over a dataset of blocks, returning the number of examples. On a
    cached dataset this does the work the first epoch would do, once; later passes
    read memory."""
    count = 0
    for block in blocks:  # a Python loop, so that a SIGTERM is handled between blocks
        count += int(tf.shape(tf.nest.flatten(block)[0])[0])
    return count


def eval_steps(num_examples: int, global_batch_size: int) -> int:
    """Batches needed to see every example once (the last one padded)."""
    return math.ceil(num_examples / global_batch_size)


def make_eval(ds: tf.data.Dataset, num_examples: int,
              context: tf.distribute.InputContext, global_batch_size: int,
              normalize: Callable, cache: bool = True,
              prepare: Callable | None = None) -> tf.data.Dataset:
    """Exact evaluation: yields {"image", "label", "index", "mask"} batches; padded
    examples have mask 0 (float32), real ones 1, and indices from num_examples on.

    Every input worker yields the same number of full batches (static shapes, as TPUs
    need), and each real example appears exactly once across all workers.
    """
    batch = per_replica_batch_size(global_batch_size, context)
    per_pipeline = eval_steps(num_examples, global_batch_size) * (
        global_batch_size // context.num_input_pipelines)
    ds = _shard(ds.enumerate(), context)  # (each example's index in the split)
    if prepare is not None:
        ds = ds.map(lambda index, example: (index, prepare(*example)),
                    num_parallel_calls=AUTOTUNE)

    def normalized_example(index, example):
        image, label = normalize(*example)
        return {"image": image, "label": tf.cast(label, tf.int32),
                "index": tf.cast(index, tf.int32), "mask": tf.constant(1.0)}

    ds = ds.map(normalized_example, num_parallel_calls=AUTOTUNE)
    if cache:
        ds = ds.cache()
    image = ds.element_spec["image"]
    padding = tf.data.Dataset.range(num_examples, 2**62).map(lambda index: {
        "image": tf.zeros(image.shape, image.dtype), "label": tf.constant(0, tf.int32),
        "index": tf.cast(index, tf.int32), "mask": tf.constant(0.0)})
    ds = ds.concatenate(padding).take(per_pipeline)
    return ds.batch(batch, drop_remainder=True).prefetch(AUTOTUNE)
