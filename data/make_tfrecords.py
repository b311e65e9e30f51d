"""Write a TFDS dataset, a folder of class sub-folders or generated JPEGs as sharded
TFRecords.

    python -m trainer.tools.make_tfrecords --source=tf_flowers --output=DIR/flowers --image_size=192
    python -m trainer.tools.make_tfrecords --source=PHOTOS_DIR --output=DIR/photos --shards=16

Images fill image_size x image_size as the codelab's do (resized so the shorter side
is image_size, aspect ratio kept, then centre-cropped) and are stored as JPEG (quality
95; `--encoding=png` stores them losslessly) in the flowers codelab's format (see
data/tfrecords.py); files are named
PREFIX{shard:02d}-{count}.tfrec, with a dataset.json beside them. Train on them with
`python -m trainer.main --dataset=tfrecord:DIR/flowers*.tfrec`. Paths may be gs://
(everything goes through tf.io.gfile).

Generated data for scale tests (`--source=generated`): learnable JPEGs (quality 90,
10-30 KB at 224) of `--classes` smooth class patterns plus noise, each side drawn in
[0.8, 1.25] x image_size (image_size in dataset.json is the nominal size), every image
a pure function of its index and `--generated_seed`: the same command writes the same
bytes. A validation set is another seed (the class patterns do not depend on it):

    python -m trainer.tools.make_tfrecords --source=generated --num_examples=200000 \
        --image_size=224 --classes=100 --shards=256 --output=DIR/train/gen
    python -m trainer.tools.make_tfrecords --source=generated --num_examples=10000 \
        --image_size=224 --classes=100 --generated_seed=1 --output=DIR/validation/gen
    python -m trainer.main --dataset='tfrecord:DIR/train/gen*.tfrec;eval=DIR/validation/gen*.tfrec'

What a lossy copy costs, measured: `--jpeg_round_trip=75` passes every image once
more through JPEG at quality 75 before storing it (our CIFAR-10 copy went through
JPEG ~75 once; see docs/results.md):

    python -m trainer.tools.make_tfrecords --source=cifar10 --image_size=32 --encoding=png \
        --jpeg_round_trip=75 --output=DIR/train/cifar10 --shards=8
    python -m trainer.tools.make_tfrecords ... --split=test --output=DIR/test/cifar10

Progress goes to stderr: a live bar on a terminal, else a plain line every
--progress_seconds (or --progress_records), then the total, the time and the rate.
TensorFlow's native start-up lines are hidden as in trainer.main (--verbosity=1 shows
them).

Exit status: 0 written; 2 a source that cannot be read or bad flags (a one-line error
on stderr); 5 a file that could not be written.
"""
import dataclasses
import math
import os
import sys
import time
from typing import IO, Callable, Iterator

from data import quiet

if __name__ == "__main__":  # a command, not an import: quiet before TensorFlow starts
    quiet.set_native_log_level(sys.argv)

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402
import tqdm  # noqa: E402

from data import files, sources, tfrecords  # noqa: E402

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def _listdir(path: str) -> list[str]:
    # GCS lists sub-folders with a trailing "/".
    return sorted(name.rstrip("/") for name in tf.io.gfile.listdir(path))


def _folder_examples(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    classes = [d for d in _listdir(root) if tf.io.gfile.isdir(os.path.join(root, d))]
    if not classes:
        raise sources.DatasetError(f"{root} has no class sub-folders of images")
    examples = [(os.path.join(root, name, f), label) for label, name in enumerate(classes)
                for f in _listdir(os.path.join(root, name))
                if f.lower().endswith(IMAGE_EXTENSIONS)]
    return examples, classes


def fill_square(image: tf.Tensor, size: int) -> tf.Tensor:
    """uint8 [H, W, 3] -> uint8 [size, size, 3] as the codelab makes its TFRecords: the
    shorter side resized to `size` keeping the aspect ratio, then the middle square
    cut out (no distortion, no black bars)."""
    height, width = int(image.shape[0]), int(image.shape[1])
    scale = size / min(height, width)
    new_height, new_width = max(size, round(height * scale)), max(size, round(width * scale))
    image = tf.image.resize(image, (new_height, new_width), antialias=True)
    top, left = (new_height - size) // 2, (new_width - size) // 2
    image = image[top:top + size, left:left + size]
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


ENCODINGS = ("jpeg", "png")


def jpeg_round_trip(image: tf.Tensor, quality: int, offset: int = 4) -> tf.Tensor:
    """uint8 [H, W, 3] after one more JPEG pass at `quality`, its 8x8 blocks `offset`
    pixels off the image's own grid (reflect-padded, encoded, decoded, cropped back):
    a fresh set of compression errors, where an aligned second pass at the same
    quality would nearly repeat the first."""
    height, width = int(image.shape[0]), int(image.shape[1])
    padded = tf.pad(image, [[offset, offset], [offset, offset], [0, 0]], mode="REFLECT")
    decoded = tf.io.decode_jpeg(tf.io.encode_jpeg(padded, quality=quality), channels=3)
    return decoded[offset:offset + height, offset:offset + width]


def _encode(image: tf.Tensor, size: int, encoding: str, round_trip: int) -> bytes:
    image = fill_square(image, size)
    if round_trip:
        image = jpeg_round_trip(image, round_trip)
    if encoding == "png":
        return tf.io.encode_png(image).numpy()
    return tf.io.encode_jpeg(image, quality=95).numpy()


def _serializer(size: int, classes: list[str], encoding: str, round_trip: int
                ) -> Callable[[tf.Tensor, int, int], bytes]:
    def serialize(image: tf.Tensor, label: int, index: int) -> bytes:
        return tfrecords.serialize(_encode(image, size, encoding, round_trip), label,
                                   classes[label], index, num_classes=len(classes),
                                   size=(size, size))
    return serialize


def records_from_folder(root: str, size: int, encoding: str = "jpeg", round_trip: int = 0
                        ) -> tuple[Iterator[bytes], int, list[str]]:
    examples, classes = _folder_examples(root)
    serialize = _serializer(size, classes, encoding, round_trip)

    def generate():
        for index, (path, label) in enumerate(examples):
            try:
                image = tfrecords.decode_image(tf.io.read_file(path))
            except tf.errors.InvalidArgumentError as err:
                raise sources.DatasetError(f"cannot decode image {path}") from err
            yield serialize(image, label, index)
    return generate(), len(examples), classes


def records_from_tfds(name: str, size: int, data_dir: str | None, split: str = "",
                      encoding: str = "jpeg", round_trip: int = 0
                      ) -> tuple[Iterator[bytes], int, list[str]]:
    """The dataset's `split` (default: its training split)."""
    spec = sources.get_spec(name)
    ds, total = sources.load_tfds(name, split or spec.train_split, data_dir)
    classes = list(spec.class_names)
    serialize = _serializer(size, classes, encoding, round_trip)

    def generate():
        for index, (image, label) in enumerate(ds):
            yield serialize(image, int(label), index)
    return generate(), total, classes


# --- Generated JPEGs for scale tests (--source=generated) ------------------------

GENERATED = "generated"
GENERATED_QUALITY = 90             # JPEG quality: records of a realistic size
GENERATED_SIDES = (0.8, 1.25)      # each side in this range x image_size
_PATTERN_SIZE = 32                 # the class pattern + coarse noise, as sources.synthetic
_PATTERN_KEY = (1234, 0)           # class patterns: the same for every --generated_seed
_EXAMPLE_KEY = 20_260_101          # mixed with the seed, then the index: per-image draws
_COARSE_NOISE = 40.0               # stddev at 32x32 (as sources.synthetic), smoothed by upsampling
_FINE_NOISE = 6.0                  # stddev per pixel at full size: ~17 KB at 224, q90


@dataclasses.dataclass(frozen=True)
class Generated:
    """What --source=generated writes: `num_examples` images of `classes` classes;
    another `seed` gives other images of the same classes (a validation set)."""
    num_examples: int = 10_000
    classes: int = 10
    seed: int = 0


def class_patterns(classes: int) -> tf.Tensor:
    """float [classes, 32, 32, 3] in [0, 255]: one smooth (4x4 upsampled) random pattern
    per class, as sources.synthetic makes them; smooth, so a crop still shows it."""
    coarse = tf.random.stateless_uniform((classes, 4, 4, 3), seed=_PATTERN_KEY, minval=0.0,
                                         maxval=255.0, alg="philox")
    return tf.image.resize(coarse, (_PATTERN_SIZE, _PATTERN_SIZE), method="bilinear")


def generated_image(index: tf.Tensor, patterns: tf.Tensor, image_size: int, seed: int
                    ) -> tuple[tf.Tensor, tf.Tensor]:
    """(uint8 [H, W, 3], int32 label) of example `index` (int64): a pure function of
    index and seed. The class pattern plus coarse noise at 32x32 (sources.synthetic's
    image), upsampled to H x W (each side image_size x [0.8, 1.25], log-uniform), plus
    fine per-pixel noise so JPEG has detail to store."""
    key = tf.random.experimental.stateless_fold_in(
        tf.constant([_EXAMPLE_KEY, seed], tf.int64), index, alg="philox")
    keys = tf.random.experimental.stateless_split(key, 4, alg="philox")
    label = tf.random.stateless_uniform([], keys[0], maxval=tf.shape(patterns)[0],
                                        dtype=tf.int32, alg="philox")
    low, high = (math.log(side) for side in GENERATED_SIDES)
    scale = tf.exp(tf.random.stateless_uniform([2], keys[1], low, high, alg="philox"))
    sides = tf.maximum(tf.cast(tf.round(image_size * scale), tf.int32), 1)
    small = tf.gather(patterns, label) * 0.6 + 50.0 + tf.random.stateless_normal(
        (_PATTERN_SIZE, _PATTERN_SIZE, 3), keys[2], stddev=_COARSE_NOISE, alg="philox")
    image = tf.image.resize(small[tf.newaxis], sides, method="bilinear")[0]
    image += _fine_noise(sides, keys[3])
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8), label


def _fine_noise(sides: tf.Tensor, key: tf.Tensor) -> tf.Tensor:
    """float [H, W, 3], uniform with stddev _FINE_NOISE. Four random bytes from each
    random int32: a quarter of the draws, 4x faster than stateless_normal (which made
    noise most of an image's cost)."""
    size = sides[0] * sides[1] * 3
    ints = tf.random.stateless_uniform([(size + 3) // 4], key, dtype=tf.int32, minval=None,
                                       maxval=None, alg="philox")
    noise = tf.reshape(tf.bitcast(ints, tf.uint8), [-1])[:size]
    half_width = _FINE_NOISE * math.sqrt(3.0)  # uniform on [-a, a]: stddev a / sqrt(3)
    return tf.reshape(tf.cast(noise, tf.float32) * (2 * half_width / 255.0) - half_width,
                      tf.concat([sides, [3]], 0))


def generated_dataset(image_size: int, generated: Generated, encoding: str = "jpeg"
                      ) -> tf.data.Dataset:
    """(encoded image, label, [height, width], index) for index 0..num_examples-1, in
    order. Images are made and encoded in parallel (tf.data map: TensorFlow's kernels
    run outside the GIL, on every core)."""
    patterns = class_patterns(generated.classes)

    def make(index):
        image, label = generated_image(index, patterns, image_size, generated.seed)
        encoded = (tf.io.encode_png(image) if encoding == "png" else
                   tf.io.encode_jpeg(image, quality=GENERATED_QUALITY))
        return encoded, label, tf.shape(image)[:2], index

    return tf.data.Dataset.range(generated.num_examples).map(
        make, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def records_from_generated(size: int, generated: Generated, encoding: str = "jpeg"
                           ) -> tuple[Iterator[bytes], int, list[str]]:
    classes = [f"class_{i}" for i in range(generated.classes)]
    # Batched: one Python round trip per 64 images, not per image.
    batches = generated_dataset(size, generated, encoding).batch(64).prefetch(2)

    def generate():
        for images, labels, sides, indices in batches.as_numpy_iterator():
            for image, label, side, index in zip(images, labels, sides, indices):
                yield tfrecords.serialize(image, int(label), classes[label], int(index),
                                          num_classes=len(classes),
                                          size=(int(side[0]), int(side[1])))
    return generate(), generated.num_examples, classes


# --- Progress on stderr ------------------------------------------------------------

def _clock(seconds: float) -> str:
    """2:09, or 1:02:09 from an hour on."""
    seconds = int(max(0, round(seconds)))
    hours, minutes = seconds // 3600, seconds // 60 % 60
    return (f"{hours}:{minutes:02d}:{seconds % 60:02d}" if hours
            else f"{minutes}:{seconds % 60:02d}")


class Progress:
    """Records written, on `stream`: a live tqdm bar (records/s, ETA) where a person
    watches (data.quiet.is_live_terminal), else a plain line every `every_seconds` or
    `every_records` (0: by time only), e.g. "12,000/200,000 records, 1,450 records/s,
    ETA 2:09"; `finish` adds the total, the seconds and the rate either way."""

    def __init__(self, stream: IO | None = None, every_seconds: float = 10.0,
                 every_records: int = 0, live: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.live = quiet.is_live_terminal(self.stream) if live is None else live
        self.every_seconds, self.every_records = every_seconds, every_records
        self.clock = clock
        self.total = self.count = 0
        self._bar = None

    def start(self, total: int) -> None:
        self.total, self.count = total, 0
        self._started = self._last_time = self.clock()
        self._last_count = 0
        if self.live:
            self._bar = tqdm.tqdm(total=total, file=self.stream, unit=" records",
                                  unit_scale=True, dynamic_ncols=True, mininterval=0.5,
                                  smoothing=0.1, desc="writing")

    def track(self, records: Iterator[bytes]) -> Iterator[bytes]:
        """`records`, counted as the writer takes them."""
        for record in records:
            self.update()
            yield record

    def rate(self) -> float:
        elapsed = self.clock() - self._started
        return self.count / elapsed if elapsed > 0 else 0.0

    def update(self, count: int = 1) -> None:
        self.count += count
        if self._bar is not None:
            self._bar.update(count)
            return
        now = self.clock()
        if self.count < self.total and (
                now - self._last_time >= self.every_seconds or
                0 < self.every_records <= self.count - self._last_count):
            self._last_time, self._last_count = now, self.count
            rate = self.rate()
            eta = _clock((self.total - self.count) / rate) if rate else "?"
            self._print(f"{self.count:,}/{self.total:,} records, {rate:,.0f} records/s, "
                        f"ETA {eta}")

    def finish(self) -> str:
        """Closes the bar and prints (and returns) the final line."""
        seconds = self.clock() - self._started
        self.close()
        line = (f"{self.count:,} records in {seconds:.1f} s, "
                f"{self.count / max(seconds, 1e-9):,.0f} records/s")
        self._print(line)
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


# --- The command -------------------------------------------------------------------

FLAGS = flags.FLAGS
_GENERATED_FLAGS = ("num_examples", "classes", "generated_seed")


def define_flags() -> None:
    """Defined only when run as a command: importing this module (tests, conftest)
    must not claim flag names such as --data_dir that trainer.main also defines."""
    flags.DEFINE_string("source", None,
                        "A TFDS name (tf_flowers), a folder of class folders, or "
                        f"'{GENERATED}' (learnable JPEGs for scale tests).")
    flags.DEFINE_string("output", None, "File prefix, e.g. out/flowers.")
    flags.DEFINE_integer("image_size", 192, "Images are resized to this square size "
                         "(generated ones: the nominal size, sides 0.8-1.25x it).",
                         lower_bound=1)
    flags.DEFINE_integer("shards", 16, "Number of files to write.", lower_bound=1)
    flags.DEFINE_string("data_dir", None, "TFDS data dir.")
    flags.DEFINE_string("split", "", "A TFDS source's split (default: its training "
                        "split), e.g. test.")
    flags.DEFINE_enum("encoding", "jpeg", ENCODINGS, "How images are stored: jpeg "
                      "(quality 95; generated: 90) or png (lossless).")
    flags.DEFINE_integer("jpeg_round_trip", 0, "If > 0: pass each image once more "
                         "through JPEG at this quality (blocks 4 px off the image grid) "
                         "before storing it, to measure what compression costs.",
                         lower_bound=0, upper_bound=100)
    flags.DEFINE_integer("num_examples", Generated.num_examples,
                         f"--source={GENERATED}: how many images.", lower_bound=1)
    flags.DEFINE_integer("classes", Generated.classes,
                         f"--source={GENERATED}: how many classes.", lower_bound=1)
    flags.DEFINE_integer("generated_seed", Generated.seed,
                         f"--source={GENERATED}: which images (another seed for a "
                         f"validation set: the same classes, other images).", lower_bound=0)
    flags.DEFINE_float("progress_seconds", 10.0, "Off a terminal: a progress line at "
                       "least this often.", lower_bound=0.0)
    flags.DEFINE_integer("progress_records", 0, "Off a terminal: also a progress line "
                         "every this many records (0: by time only).", lower_bound=0)
    flags.mark_flags_as_required(["source", "output"])


def write(source: str, output: str, image_size: int, shards: int,
          data_dir: str | None, split: str = "", encoding: str = "jpeg",
          round_trip: int = 0, generated: Generated | None = None,
          progress: Progress | None = None) -> list[str]:
    """Writes the shards and their dataset.json; returns the shards' paths.
    `generated` sets what source='generated' writes (default: Generated())."""
    if encoding not in ENCODINGS:
        raise sources.DatasetError(f"encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    tfds_name, extra = "", {}
    if source == GENERATED:
        generated = generated or Generated()
        if split or round_trip:
            raise sources.DatasetError(
                f"--source={GENERATED} takes neither --split (write a validation set "
                f"with another --generated_seed) nor --jpeg_round_trip")
        records, total, classes = records_from_generated(image_size, generated, encoding)
        extra = {"generated": {"seed": generated.seed, "sides": list(GENERATED_SIDES),
                               "jpeg_quality": GENERATED_QUALITY}}
    elif tf.io.gfile.isdir(source):
        if split:
            raise sources.DatasetError(f"--split={split!r} is for a TFDS source; a "
                                       f"folder of class folders has one set of images")
        records, total, classes = records_from_folder(source, image_size, encoding,
                                                      round_trip)
    elif source in sources.names():
        split = split or sources.get_spec(source).train_split
        records, total, classes = records_from_tfds(source, image_size, data_dir, split,
                                                    encoding, round_trip)
        tfds_name = source
    else:
        raise sources.DatasetError(
            f"--source={source!r} is neither a folder of class folders nor a dataset "
            f"({', '.join(sources.names())}) nor {GENERATED!r}")
    if not total:
        raise sources.DatasetError(f"{source} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    holdout = (sources.get_spec(tfds_name).holdout_fraction if tfds_name
               else sources.DEFAULT_HOLDOUT)
    # "source" stays a TFDS name or "": sources reads it as one (its spec's defaults).
    meta = {"source": tfds_name, "class_names": classes, "image_size": image_size,
            "records": total, "holdout_fraction": holdout, "split": split,
            "encoding": encoding, "jpeg_round_trip": round_trip, **extra}
    # The description says "complete": false until the last shard is written, so a
    # conversion cut short (a full disk, a kill) is refused by training, by name.
    description = os.path.join(tfrecords.directory(output), sources.TFRECORD_METADATA)
    files.make_parent(output, "--output")  # (as mkdir -p; else one line, exit 5)
    files.write_json(description, {**meta, "complete": False,
                                   "output": output})
    if progress is not None:
        progress.start(total)
        records = progress.track(records)
    try:
        paths = tfrecords.write_shards(records, total, output, shards)
    finally:
        if progress is not None:
            progress.close()  # (a bar left open would garble an error line)
    # An earlier conversion of this prefix (another --shards) would be read too.
    earlier = [path for path in tfrecords.shards_of(output) if path not in paths]
    for path in earlier:
        tf.io.gfile.remove(path)
    if earlier:
        print(f"removed {len(earlier)} shard(s) of an earlier conversion to {output}: "
              f"{', '.join(os.path.basename(p) for p in earlier)}", file=sys.stderr)
    files.write_json(description, {**meta, "complete": True, "files": len(paths),
                                   "shards": [os.path.basename(p) for p in paths]})
    if progress is not None:
        progress.finish()
    return paths


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value",
              file=sys.stderr)
        sys.exit(2)
    given = [name for name in _GENERATED_FLAGS if FLAGS[name].present]
    if given and FLAGS.source != GENERATED:
        print(f"error: --{given[0]} is for --source={GENERATED}", file=sys.stderr)
        sys.exit(2)
    generated = Generated(FLAGS.num_examples, FLAGS.classes, FLAGS.generated_seed)
    progress = Progress(sys.stderr, FLAGS.progress_seconds, FLAGS.progress_records)
    try:
        paths = write(FLAGS.source, FLAGS.output, FLAGS.image_size, FLAGS.shards,
                      FLAGS.data_dir, FLAGS.split, FLAGS.encoding, FLAGS.jpeg_round_trip,
                      generated, progress)
    except sources.DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except files.WriteError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)
    records = sum(tfrecords.record_count(path) for path in paths)
    print(f"wrote {records} records in {len(paths)} files: {paths[0]} ... {paths[-1]}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
