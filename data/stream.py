"""The streaming training pipeline: data of any size, nothing held in memory.

Where data/pipeline.make_train decodes the whole dataset into an in-memory cache
before the first step, this one reads the records from their files every epoch and
decodes each example when it is needed:

    per epoch: files in a shuffled order -> read in parallel (interleaved) ->
    windows of `shuffle_buffer` records, each permuted -> [skip, when resuming] ->
    decode (+ the decode-time crop) -> batch -> augment, normalize, mix -> prefetch

Memory is bounded by the buffers (one window of encoded records, the prefetched
batches), whatever the size of the data. The order is a pure function of (seed,
input pipeline, epoch): the file order and each window's permutation come from
stateless random ops keyed by them, the interleave is deterministic, and every
example's decode-time crop is keyed by (epoch, its index). A run resumed at step N
therefore sees bitwise the batches an uninterrupted run sees, and getting back to
step N costs at most one epoch's file reads, without decoding: whole windows before
the resume point are read and dropped as encoded bytes, never decoded.

With several input pipelines (workers), each reads its own files when there are at
least as many files as pipelines, else every n-th example by index.
"""
import math
from typing import Callable

import numpy as np
import tensorflow as tf

from data import pipeline
from data.sources import RecordFiles, in_holdout

AUTOTUNE = tf.data.AUTOTUNE
CYCLE_LENGTH = 16  # files read at once
# tf.data's autotuner may grow its buffers up to half of the machine's memory when
# the step is slow (a benchmark of a slow model grew to 6.6 GB); the stream keeps
# them to this.
RAM_BUDGET = 1 << 30


def worker_share(files: RecordFiles, pipelines: int, worker: int
                 ) -> tuple[RecordFiles, int, bool]:
    """(this worker's files, the number of examples it reads per epoch, whether it
    takes every n-th index instead of whole files). Counted from the file list and
    the held-out hash, without reading anything."""
    by_index = pipelines > 1 and len(files.paths) < pipelines
    chosen = range(len(files.paths))
    if pipelines > 1 and not by_index:
        chosen = range(worker, len(files.paths), pipelines)
    pick = lambda values: tuple(values[i] for i in chosen)  # noqa: E731
    mine = RecordFiles(pick(files.paths), pick(files.skips), pick(files.counts),
                       pick(files.offsets), files.parse, files.holdout_fraction,
                       files.validation, files.channels)
    examples = 0
    for offset, count in zip(mine.offsets, mine.counts):
        indices = np.arange(offset, offset + count, dtype=np.int64)
        kept = mine.keeps(indices)
        if by_index:
            kept &= indices % pipelines == worker
        examples += int(kept.sum())
    return mine, examples, by_index


def make_train_stream(files: RecordFiles, context: tf.distribute.InputContext,
                      global_batch_size: int, decode: Callable, augment: Callable,
                      normalize: Callable, shuffle_buffer: int, seed: int = 0,
                      start_step: int = 0, end_step: int | None = None,
                      mix: Callable | None = None, alternating_flip: bool = False,
                      counts: list | None = None,
                      make_batch: Callable | None = None) -> tf.data.Dataset:
    """The training stream of one input worker; yields what pipeline.make_train
    yields, from the same (seed, position) keys.

    decode(image_bytes, seed) -> uint8 [H, W, C] of the run's size (the decode-time
    crop, if any, keyed by `seed`, a [2] int64 tensor made of the epoch and the
    example's index). counts: gets the examples this pipeline reads per epoch.
    make_batch: as pipeline.make_train's. Each example's "index" is its record's
    index in the split's files.
    """
    batch = pipeline.per_replica_batch_size(global_batch_size, context)
    mine, examples, by_index = worker_share(files, context.num_input_pipelines,
                                            context.input_pipeline_id)
    if counts is not None:
        counts.append(examples)
    batches_per_epoch = examples // batch
    if batches_per_epoch == 0:
        raise ValueError(f"this input pipeline has fewer examples than one batch of "
                         f"{batch}; lower the batch size")
    window = max(shuffle_buffer, 1)
    pipeline_seed = seed * 7919 + context.input_pipeline_id  # workers differ
    per_step = context.num_replicas_in_sync // context.num_input_pipelines
    start_epoch, start_batch = divmod(start_step * per_step, batches_per_epoch)
    table = {name: tf.constant(values, dtype) for name, values, dtype in (
        ("paths", mine.paths, tf.string), ("skips", mine.skips, tf.int64),
        ("counts", mine.counts, tf.int64), ("offsets", mine.offsets, tf.int64))}
    num_files = len(mine.paths)
    pipelines, worker = context.num_input_pipelines, context.input_pipeline_id
    fraction, validation = files.holdout_fraction, files.validation

    def read(path, skip, count, offset):
        records = tf.data.TFRecordDataset(path).skip(skip).take(count)
        return records.enumerate().map(lambda j, record: (record, offset + j))

    def kept(record, index):
        keep = tf.constant(True)
        if fraction:
            held = in_holdout(index, fraction)
            keep = held if validation else tf.logical_not(held)
        if by_index:
            keep = tf.logical_and(keep, index % pipelines == worker)
        return keep

    def one_epoch(epoch):
        key = tf.stack([tf.constant(pipeline_seed, tf.int64), epoch])
        order = (tf.argsort(tf.random.stateless_uniform([num_files], key))
                 if shuffle_buffer > 1 else tf.range(num_files))
        chosen = {name: tf.gather(values, order) for name, values in table.items()}
        records = tf.data.Dataset.from_tensor_slices(
            (chosen["paths"], chosen["skips"], chosen["counts"], chosen["offsets"])
        ).interleave(read, cycle_length=min(num_files, CYCLE_LENGTH), block_length=1,
                     num_parallel_calls=AUTOTUNE, deterministic=True)
        if fraction or by_index:
            records = records.filter(kept)
        # A file shorter than its count would shorten the epoch and move every later
        # batch: fail instead, naming the numbers (inputs.data_errors_explained).
        records = records.apply(tf.data.experimental.assert_cardinality(examples))
        # Resuming: whole windows before the resume point are dropped still encoded.
        first = tf.where(epoch == start_epoch, tf.constant(start_batch * batch, tf.int64),
                         tf.constant(0, tf.int64))
        windows = records.batch(window).skip(first // window)
        windows = tf.data.Dataset.zip(
            (tf.data.Dataset.range(first // window, 2**62), windows))

        def permute(number, window_records):
            records, indices = window_records
            if shuffle_buffer <= 1:
                return records, indices
            order = tf.argsort(tf.random.stateless_uniform(
                tf.shape(indices), key + tf.stack([0, number + 1])))
            return tf.gather(records, order), tf.gather(indices, order)

        examples_ds = windows.map(permute).unbatch().skip(first % window)

        def decoded(record, index):
            image_bytes, label = files.parse(record)
            crop_key = tf.stack([tf.constant(pipeline_seed, tf.int64),
                                 epoch * 4_294_967_296 + index])
            return decode(image_bytes, crop_key), label, index

        batches = examples_ds.map(decoded, num_parallel_calls=AUTOTUNE,
                                  deterministic=True).batch(batch, drop_remainder=True)
        first_batch = first // batch
        batches = batches.take(batches_per_epoch - first_batch)
        return tf.data.Dataset.zip((tf.data.Dataset.range(first_batch, 2**62), batches)
                                   ).map(lambda b, example: (tf.stack([epoch, b]),
                                                             *example))

    ds = tf.data.Dataset.range(start_epoch, 2**62).flat_map(one_epoch)
    if end_step is not None:  # finite, as make_train (threads end with the last batch)
        ds = ds.take((end_step - start_step) * per_step)
    ds = pipeline.augment_and_prefetch(ds, pipeline_seed, augment, normalize, mix,
                                       alternating_flip, make_batch)
    options = tf.data.Options()
    options.autotune.ram_budget = RAM_BUDGET
    return ds.with_options(options)


def decoded_bytes(examples: int, image_shape: tuple[int, int, int]) -> int:
    """What the in-memory cache would hold: uint8 images at the run's size."""
    return examples * math.prod(image_shape)
