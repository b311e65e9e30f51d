"""The streaming input pipeline (data/stream.py), TFDS datasets by name, and
ImageNet's decode-time crops: same examples as the cache, an order that is a pure
function of (seed, worker, epoch), exact resume at a step, errors in one line."""
import hashlib
import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import stopped_then_resumed
from data import augment, pipeline, sources, stream, tfrecords

SIZE = 24


def _write_jpegs(directory, name: str, count: int, shards: int, first_index: int = 0,
                 classes: int = 3) -> str:
    """`count` JPEGs of varying sizes in `shards` files of our format; the pattern."""
    rng = np.random.default_rng(first_index)

    def records():
        for i in range(count):
            height, width = rng.integers(SIZE, 2 * SIZE, size=2)
            image = rng.integers(0, 255, (height, width, 3), np.uint8)
            label = int(i % classes)
            yield tfrecords.serialize(tf.io.encode_jpeg(image).numpy(), label, str(label),
                                      first_index + i, classes, (int(height), int(width)))
    tfrecords.write_shards(records(), count, str(directory / name), shards)
    return str(directory / f"{name}*.tfrec")


@pytest.fixture(scope="session")  # (a module fixture is rebuilt each time xdist returns)
def jpeg_dataset(tmp_path_factory):
    """120 training JPEGs in 6 files, 24 validation JPEGs apart (3 classes)."""
    root = tmp_path_factory.mktemp("jpegs")
    (root / "train").mkdir()
    (root / "validation").mkdir()
    train = _write_jpegs(root / "train", "gen", 120, 6)
    held = _write_jpegs(root / "validation", "gen", 24, 2, first_index=1000)
    (root / "train" / "dataset.json").write_text(json.dumps(
        {"class_names": ["a", "b", "c"], "image_size": SIZE}))
    return f"tfrecord:{train};eval={held}"


def _context(pipelines: int = 1, worker: int = 0, replicas: int = 1):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=worker,
                                      num_replicas_in_sync=replicas)


def _resize(image, label):
    return augment.make_resize(SIZE)(image, label)


def _stream(name: str, context=None, seed: int = 0, start_step: int = 0,
            augment_name: str = "none", batch: int = 8, window: int = 50):
    spec = sources.get_spec(name)
    files = sources.record_files(spec, spec.train_split)
    crop = augment.DECODE_TIME_CROPS.get(augment_name)
    if crop:
        decode = lambda image_bytes, key: crop[0](image_bytes, key, SIZE)  # noqa: E731
        batch_part = crop[1]
    else:
        decode = lambda image_bytes, key: _resize(  # noqa: E731
            augment.decode_image(image_bytes), 0)[0]
        batch_part = augment_name
    return stream.make_train_stream(
        files, context or _context(), batch, decode,
        augment.TRAIN_AUGMENTATIONS[batch_part], lambda images, labels: (images, labels),
        window, seed=seed, start_step=start_step)


def _cached(name: str, context=None, batch: int = 8):
    spec = sources.get_spec(name)
    context = context or _context()
    ds, count = sources.load(spec, spec.train_split, context=context)
    return pipeline.make_train(ds, context, batch, augment.identity,
                               lambda images, labels: (images, labels), 50,
                               prepare=_resize, num_examples=count, shard=False)


def _epoch_images(ds, batches: int) -> list[list[str]]:
    """Per epoch, the sorted hashes of the images in it."""
    epochs: list[list[str]] = []
    for i, batch in enumerate(ds.take(batches)):
        hashes = [hashlib.sha1(image.tobytes()).hexdigest() for image in
                  batch["image"].numpy()]
        if i % (batches // 2) == 0:
            epochs.append([])
        epochs[-1].extend(hashes)
    return [sorted(epoch) for epoch in epochs]


@pytest.mark.parametrize("pipelines", [1, 2])
def test_stream_and_cache_yield_the_same_examples_each_epoch(jpeg_dataset, pipelines):
    per_epoch = 120 // pipelines // 6  # batches of 6 per pipeline and epoch: no remainder
    for worker in range(pipelines):
        context = _context(pipelines, worker, pipelines)
        batch = 6 * pipelines  # global: 6 per replica, one replica per pipeline
        streamed = _epoch_images(_stream(jpeg_dataset, context, batch=batch), 2 * per_epoch)
        cached = _epoch_images(_cached(jpeg_dataset, context, batch=batch), 2 * per_epoch)
        assert len(streamed[0]) == per_epoch * 6
        assert streamed[0] == cached[0] and streamed[1] == cached[1]
        assert streamed[0] == streamed[1]  # every epoch sees every example once


def _batches(ds, count: int) -> list[np.ndarray]:
    return [batch["image"].numpy() for batch in ds.take(count)]


def test_stream_order_is_a_pure_function_of_seed_worker_and_epoch(jpeg_dataset):
    first = _batches(_stream(jpeg_dataset, seed=3), 30)
    again = _batches(_stream(jpeg_dataset, seed=3), 30)
    other_seed = _batches(_stream(jpeg_dataset, seed=4), 15)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(np.stack(first[:15]), np.stack(first[15:]))  # epochs differ
    assert not np.array_equal(np.stack(first[:15]), np.stack(other_seed))
    workers = [_batches(_stream(jpeg_dataset, _context(2, w, 2), seed=3), 7) for w in (0, 1)]
    assert not np.array_equal(np.stack(workers[0]), np.stack(workers[1]))


@pytest.mark.parametrize("start_step", [3, 7, 21])  # in a window, after one, next epoch
def test_a_stream_resumed_at_a_step_sees_bitwise_the_same_batches(jpeg_dataset,
                                                                   start_step):
    # The decode-time Inception crop is keyed by (epoch, index): resumable too.
    whole = _batches(_stream(jpeg_dataset, seed=1, augment_name="inception_crop"),
                     start_step + 5)
    resumed = _batches(_stream(jpeg_dataset, seed=1, augment_name="inception_crop",
                               start_step=start_step), 5)
    for a, b in zip(whole[start_step:], resumed):
        np.testing.assert_array_equal(a, b)


def test_worker_share_counts_without_reading(jpeg_dataset):
    spec = sources.get_spec(jpeg_dataset)
    files = sources.record_files(spec, spec.train_split)
    assert stream.worker_share(files, 1, 0)[1] == 120
    assert [stream.worker_share(files, 2, w)[1] for w in (0, 1)] == [60, 60]
    # Fewer files than workers: every n-th index.
    shares = [stream.worker_share(files, 7, w) for w in range(7)]
    assert sum(share[1] for share in shares) == 120 and all(share[2] for share in shares)


def test_a_file_shorter_than_its_name_says_stops_the_stream(tmp_path):
    (tmp_path / "validation").mkdir()
    held = _write_jpegs(tmp_path / "validation", "gen", 8, 1)
    pattern = _write_jpegs(tmp_path, "gen", 30, 3)
    short = tfrecords.files(pattern)[1]
    tf.io.gfile.rename(short, short.replace("-10.tfrec", "-12.tfrec"))
    with pytest.raises(tf.errors.FailedPreconditionError, match="expected to contain 32"):
        _batches(_stream(f"tfrecord:{pattern};eval={held}", batch=4, window=8), 8)


def test_a_streamed_shard_cut_short_is_one_line_naming_the_file_and_record(tmp_path):
    """Issue 43: the training loop's explanation named only the glob."""
    from trainer import inputs
    (tmp_path / "validation").mkdir()
    held = _write_jpegs(tmp_path / "validation", "gen", 8, 1)
    pattern = _write_jpegs(tmp_path, "gen", 30, 3)
    short = tfrecords.files(pattern)[1]
    records = list(tf.data.TFRecordDataset(short).take(7))
    with tf.io.TFRecordWriter(short) as writer:  # cut at a record boundary
        for record in records:
            writer.write(record.numpy())
    name = f"tfrecord:{pattern};eval={held}"
    with pytest.raises(sources.DatasetError) as error:
        with inputs.data_errors_explained(sources.get_spec(name)):  # as the loop reads
            _batches(_stream(name, batch=4, window=8), 8)
    assert str(error.value).startswith(f"the files {pattern!r}: {short} holds 7 "
                                       f"records, its name says 10 (records 7-9 are "
                                       f"missing)"), error.value
    assert "\n" not in str(error.value)


def test_inception_boxes_stay_inside_and_cover_the_configured_ranges():
    shape = tf.constant([300, 200])
    areas, aspects, fallbacks = [], [], 0
    for seed in range(300):
        top, left, height, width = augment.inception_box(
            shape, tf.constant([seed, 7], tf.int64)).numpy()
        assert 0 <= top and 0 <= left and top + height <= 300 and left + width <= 200
        if (top, left, height, width) == tuple(augment.central_box(shape).numpy()):
            fallbacks += 1
            continue
        areas.append(height * width / (300 * 200))
        aspects.append(width / height)
    assert fallbacks < 30
    assert 0.08 - 0.01 <= min(areas) < 0.2 and max(areas) > 0.8
    assert 3 / 4 - 0.02 <= min(aspects) < 0.85 and 1.2 < max(aspects) <= 4 / 3 + 0.02


def test_the_central_crop_is_deterministic_and_is_the_centre():
    coarse = tf.random.stateless_uniform([1, 8, 10, 3], (1, 2), 0, 255)  # smooth: JPEG
    image = tf.cast(tf.image.resize(coarse, [256, 320])[0], tf.uint8)  # keeps it closely
    encoded = tf.io.encode_png(image)
    first = augment.decode_central_crop(encoded, 224).numpy()
    assert np.array_equal(first, augment.decode_central_crop(encoded, 224).numpy())
    # 224/256 of the shorter side, centred: rows 16..240, columns 48..272.
    np.testing.assert_array_equal(first, image.numpy()[16:240, 48:272])
    jpeg = tf.io.encode_jpeg(image, quality=100)
    from_jpeg = augment.decode_central_crop(jpeg, 224).numpy().astype(int)
    assert np.abs(from_jpeg - image.numpy()[16:240, 48:272]).mean() < 3  # JPEG's loss


@pytest.mark.long(8)  # seconds, with -n 2
def test_the_train_loop_times_the_wait_for_a_slow_input_and_the_log_says_input_bound():
    """In a fresh process: op determinism, which an earlier test in this one may
    have enabled (it is process-wide), forbids the timestamps."""
    import subprocess
    import sys
    code = ("import sys; sys.path.insert(0, 'tests'); import test_stream; "
            "test_stream.check_the_loop_times_a_slow_input(); print('checked')")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root)
    assert out.stdout.strip().endswith("checked"), out.stderr[-3000:]


def check_the_loop_times_a_slow_input():
    import time
    from trainer import distributed
    from trainer.output import progress as progress_lib
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    weights = tf.random.stateless_normal([250, 250], (1, 2))

    def step(batch):  # a few milliseconds of work, far more than taking a ready batch
        product = weights * tf.reduce_mean(batch)  # (the work needs the batch, as a model's)
        for _ in range(4):
            product = tf.linalg.matmul(product, weights) / 16.0
        return {"loss": (tf.reduce_sum(batch) + tf.reduce_mean(product), 4.0)}
    slow = tf.data.Dataset.range(100).map(lambda i: tf.py_function(
        lambda: time.sleep(0.05) or np.float32(1.0), [], tf.float32)).batch(4)
    fast = tf.data.Dataset.from_tensors(tf.ones([4])).repeat()
    fractions, lines = [], []
    for dataset in (slow, fast):
        loop = distributed.make_train_loop(strategy, step)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        loop(iterator, tf.constant(2), tf.constant(0.0))  # traced, not timed
        progress = progress_lib.Progress(20, 20, 4, 0)
        started = time.perf_counter()
        sums, _ = loop(iterator, tf.constant(10), tf.constant(0.0))
        sums = tf.nest.map_structure(lambda t: t.numpy(), sums)
        progress.add(sums, 10, time.perf_counter() - started)
        assert sums[distributed.INPUT_WAIT][1] == 10  # timed, per step
        fractions.append(progress.input_wait_fraction())
        with _captured_log() as messages:
            record = progress.log(10, 0.1)
        lines.extend(message for message in messages if "step 10/20" in message)
        assert record["input_wait_fraction"] == pytest.approx(fractions[-1])
    # (ratios, not times: the slow input sleeps 0.2 s a batch; the step's 0.13 GFLOP take
    # ~2 ms on AVX-512, ~5 ms on AVX2, and stay far below 0.2 s on a machine loaded 5x)
    assert fractions[0] > 0.6 and fractions[1] < fractions[0] / 3, fractions
    assert "input-bound: waited" in lines[0] and "input" in lines[1], lines
    untimed = distributed.make_train_loop(strategy, step, time_input=False)
    sums, _ = untimed(iter(strategy.experimental_distribute_dataset(fast)), tf.constant(2),
                      tf.constant(0.0))
    assert float(sums[distributed.INPUT_WAIT][1]) == 0  # not timed: the log says nothing


@pytest.mark.long(21)  # seconds, with -n 2
def test_a_streamed_run_stopped_and_resumed_ends_with_the_straight_runs_weights(
        tiny_config, generated_records, monkeypatch):
    """One replica, through trainer.loop: 24 steps of 128 over 2,048 streamed
    examples (1.5 epochs), stopped after step 12 (checkpoint at 12), resumed from
    it: the resumed stream skips whole windows and ends with bitwise the straight
    run's weights. (Two replicas and two workers: kill -9 in test_faults.py and
    test_multi_worker.py.)"""
    from trainer import loop
    config = tiny_config.replace(dataset=generated_records, cache="none", batch_size=128,
                                 train_steps=24, checkpoint_every=12, eval_every=24,
                                 log_every=12, steps_per_loop=4, shuffle_buffer=300,
                                 deterministic=True)
    straight = loop.train_and_evaluate(config)
    assert straight["test_examples"] == 256
    config = config.replace(model_dir=config.model_dir + "_stopped")
    resumed = stopped_then_resumed(config, monkeypatch, at_step=16)
    assert resumed["resumed_from_step"] == 12
    assert resumed["weights_sha256"] == straight["weights_sha256"]


class _captured_log:
    """The absl log's messages while inside (outside pytest's caplog)."""

    def __enter__(self) -> list:
        import logging
        self.messages: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.logger = logging.getLogger("absl")
        self.logger.addHandler(self.handler)
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        return self.messages

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
