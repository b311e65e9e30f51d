"""Our training input pipeline against the reference tf.data recipe, images per
second per core, side by side in one process, alternating round by round:

    python -m trainer.tools.input_benchmark --dataset=tf_flowers --image_size=224
    python -m trainer.tools.input_benchmark --dataset=cifar10

- ours: the pipeline `trainer.main` trains on (trainer/inputs.py), streamed from
  the record files (--cache=none: every image decoded each epoch, as ImageNet's
  must be) or from the in-memory cache (--cache=memory: CIFAR-10's default);
- reference: the recipe of TensorFlow's and TFDS's guides: TFDS `as_dataset`
  (--cache=none: the encoded image kept, `SkipDecoding`, and decoded in the map;
  --cache=memory: decoded by TFDS, then `cache()`), `shuffle`, `map(augment,
  num_parallel_calls=AUTOTUNE)`, `batch`, `prefetch(AUTOTUNE)`. The same
  augmentation: ImageNet's (224, `inception_crop`): a random box of 8-100% of the
  area, aspect 3/4-4/3 (`sample_distorted_bounding_box`), resized bilinear, a random
  flip; CIFAR-10's (`pad_crop_flip`): 4 pixels of zero padding, a random 32x32 crop,
  a random flip; both normalized to float32 per channel.

Each round reads --batches batches of each after --warmup batches (the first
round's: the shuffle buffers filled, the cache decoded); the table gives the median
images/s, per core (os.sched_getaffinity: the cores this process may use), and
ours/reference. A benchmark, not a test: run it on a quiet machine.
"""
import functools
import os
import statistics
import sys
import time

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from data import files, sources  # noqa: E402
from trainer import build, inputs  # noqa: E402
from trainer.config import Config  # noqa: E402

FLAGS = flags.FLAGS
# Each dataset's ImageNet-like or CIFAR-like augmentation, ours by name.
AUGMENTATIONS = {"tf_flowers": "inception_crop", "cifar10": "pad_crop_flip"}


def define_flags() -> None:
    define = functools.partial(cli.define_flag, FLAGS)
    define(flags.DEFINE_enum, "dataset", "tf_flowers", "Dataset (its augmentation: "
           "inception_crop for tf_flowers, pad_crop_flip for cifar10).",
           enum_values=list(AUGMENTATIONS))
    define(flags.DEFINE_integer, "image_size", 0, "Square size (0: 224 for tf_flowers, "
           "32 for cifar10).")
    define(flags.DEFINE_integer, "batch_size", 128, "Batch size.")
    define(flags.DEFINE_enum, "cache", "none", "Ours: none (stream from the record "
           "files) or memory (decoded once).", enum_values=["none", "memory"])
    define(flags.DEFINE_integer, "batches", 40, "Batches timed per round.")
    define(flags.DEFINE_integer, "warmup", 10, "Batches before the first round.")
    define(flags.DEFINE_integer, "rounds", 3, "Rounds (each pipeline once a round).")
    define(flags.DEFINE_string, "data_dir", None, "TFDS data dir (default: "
           "TFDS_DATA_DIR).")
    define(flags.DEFINE_string, "output", "", "JSON file to write.")


def ours(dataset: str, size: int, batch_size: int, cache: str, data_dir: str | None):
    """An iterator over our training batches ({"image", "label", ...})."""
    config = Config(model="cifar_cnn", dataset=dataset, image_size=size,
                    batch_size=batch_size, data_dir=data_dir, cache=cache,
                    augment=AUGMENTATIONS[dataset], train_steps=10**9)
    data = build.run_data(config)
    train_examples = data.counts()[0]
    mode, record_files, _ = inputs.choose_mode(data, train_examples)
    return iter(inputs.train_input_fn(data, train_examples, mode=mode, files=record_files)(
        tf.distribute.InputContext()))


def reference(dataset: str, size: int, batch_size: int, cache: str,
              data_dir: str | None):
    """An iterator over the reference recipe's batches: decoding in the map
    (cache "none"), or decoded by TFDS and `cache()`d (cache "memory")."""
    spec = sources.get_spec(dataset, data_dir)
    mean = tf.constant(spec.mean, tf.float32)
    std = tf.constant(spec.std, tf.float32)

    def box(shape):
        begin, crop, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.zeros([1, 0, 4]), min_object_covered=0.08,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        return begin, crop

    def imagenet(image, encoded: bool):
        if encoded:  # only the box's pixels decoded
            begin, crop = box(tf.image.extract_jpeg_shape(image))
            image = tf.image.decode_and_crop_jpeg(
                image, tf.stack([begin[0], begin[1], crop[0], crop[1]]), channels=3)
        else:
            begin, crop = box(tf.shape(image))
            image = tf.slice(image, begin, crop)
        return tf.image.resize(image, (size, size))

    def cifar(image, encoded: bool):
        if encoded:
            image = tf.io.decode_image(image, channels=3, expand_animations=False)
        image = tf.image.pad_to_bounding_box(image, 4, 4, size + 8, size + 8)
        return tf.cast(tf.image.random_crop(image, (size, size, 3)), tf.float32)

    crop = imagenet if dataset == "tf_flowers" else cifar
    encoded = cache == "none"

    def preprocess(example):
        image = tf.image.random_flip_left_right(crop(example["image"], encoded))
        return (image - mean) / std, example["label"]

    builder = tfds.builder(dataset, data_dir=data_dir)
    ds = builder.as_dataset(split="train", shuffle_files=True, decoders=(
        {"image": tfds.decode.SkipDecoding()} if encoded else None))
    if not encoded:
        ds = ds.cache()
    ds = ds.repeat().shuffle(10_000)
    ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    return iter(ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def _read(iterator, batches: int) -> float:
    """Seconds to read `batches` batches."""
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        (batch["image"] if isinstance(batch, dict) else batch[0]).numpy()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    size = FLAGS.image_size or (224 if FLAGS.dataset == "tf_flowers" else 32)
    pipelines = {
        "ours": ours(FLAGS.dataset, size, FLAGS.batch_size, FLAGS.cache, FLAGS.data_dir),
        "reference": reference(FLAGS.dataset, size, FLAGS.batch_size, FLAGS.cache,
                               FLAGS.data_dir)}
    for iterator in pipelines.values():
        _read(iterator, FLAGS.warmup)
    seconds: dict[str, list[float]] = {name: [] for name in pipelines}
    for round_index in range(FLAGS.rounds):
        names = list(pipelines)[::(-1) ** round_index]  # each first in turn
        for name in names:
            seconds[name].append(_read(pipelines[name], FLAGS.batches))
    cores = len(os.sched_getaffinity(0))
    rates = {name: FLAGS.batches * FLAGS.batch_size / statistics.median(s)
             for name, s in seconds.items()}
    print(f"{FLAGS.dataset} at {size}x{size} ({AUGMENTATIONS[FLAGS.dataset]}), batch "
          f"{FLAGS.batch_size}, ours with --cache={FLAGS.cache}, {cores} cores, "
          f"{FLAGS.rounds} rounds of {FLAGS.batches} batches")
    print("\n| pipeline | images/s | per core | rounds (images/s) |\n| --- | ---: | ---: | --- |")
    for name, rate in rates.items():
        rounds = ", ".join(f"{FLAGS.batches * FLAGS.batch_size / s:,.0f}"
                           for s in seconds[name])
        print(f"| {name} | {rate:,.0f} | {rate / cores:,.0f} | {rounds} |")
    print(f"\nours / reference: {rates['ours'] / rates['reference']:.2f}")
    if FLAGS.output:
        files.write_json(FLAGS.output, {
            "dataset": FLAGS.dataset, "image_size": size, "batch_size": FLAGS.batch_size,
            "cache": FLAGS.cache, "cores": cores, "seconds": seconds,
            "images_per_second": rates})
    if EXIT_AT_ONCE:  # (not the input iterators' destructors: they can wait minutes)
        sys.stdout.flush()
        os._exit(0)


EXIT_AT_ONCE = False  # set when this module is the program (not when a test calls main)

if __name__ == "__main__":
    EXIT_AT_ONCE = True
    define_flags()
    cli.run(main)
