"""TFRecords: write -> read round trip, any image format, errors that name things;
bucket paths (TensorFlow's in-memory ram:// standing in for gs://); the flowers
codelab's files read as they are, and ours read the codelab's way."""
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest
import tensorflow as tf

from data import augment, make_tfrecords, pipeline, sources, tfrecords

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _image(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)


def _cmyk_jpeg(path):
    from PIL import Image  # Pillow comes with tensorflow-datasets' dependencies? skip if not
    Image.fromarray(_image((20, 30, 3), 9)).convert("CMYK").save(path, "JPEG")


@pytest.fixture
def photo_folder(tmp_path):
    """Two classes: RGB JPEG, grayscale JPEG, RGB PNG, grayscale PNG (and a CMYK JPEG
    when Pillow is there)."""
    root = tmp_path / "photos"
    for name in ("cats", "dogs"):
        (root / name).mkdir(parents=True)
    write = lambda path, data: tf.io.write_file(str(path), data)  # noqa: E731
    write(root / "cats" / "a.jpg", tf.io.encode_jpeg(_image((40, 50, 3))))
    write(root / "cats" / "b.jpg", tf.io.encode_jpeg(_image((40, 50, 1), 1)))
    write(root / "dogs" / "c.png", tf.io.encode_png(_image((30, 20, 3), 2)))
    write(root / "dogs" / "d.png", tf.io.encode_png(_image((30, 20, 1), 3)))
    try:
        _cmyk_jpeg(root / "dogs" / "e.jpg")
    except ImportError:
        pass
    return root


def test_folder_round_trip_any_format_decodes_to_rgb(photo_folder, tmp_path):
    records, total, classes = make_tfrecords.records_from_folder(str(photo_folder), 16)
    paths = tfrecords.write_shards(records, total, str(tmp_path / "out" / "pets"), 2)
    assert classes == ["cats", "dogs"] and total in (4, 5)
    assert [os.path.basename(p) for p in paths][0] == f"pets00-{(total + 1) // 2}.tfrec"
    assert sum(tfrecords.record_count(p) for p in paths) == total
    ds, count = tfrecords.load(str(tmp_path / "out" / "pets*.tfrec"))
    examples = list(ds)
    assert count == len(examples) == total
    assert sorted(int(index) for _, _, index in examples) == list(range(total))
    for image, label, index in examples:
        assert image.shape == (16, 16, 3) and image.dtype == tf.uint8
        assert int(label) == (0 if int(index) < 2 else 1)
    assert tfrecords.find_corrupt(str(tmp_path / "out" / "pets*.tfrec")) is None


def test_png_copies_are_exact_and_a_shifted_jpeg_pass_adds_fresh_errors(photo_folder,
                                                                         tmp_path):
    records, total, _ = make_tfrecords.records_from_folder(str(photo_folder), 16, "png")
    tfrecords.write_shards(records, total, str(tmp_path / "png"), 1)
    stored = {int(i): image.numpy() for image, _, i in
              tfrecords.load(str(tmp_path / "png*.tfrec"))[0]}
    original = tfrecords.decode_image(tf.io.read_file(str(photo_folder / "dogs" / "c.png")))
    np.testing.assert_array_equal(stored[2], make_tfrecords.fill_square(original, 16))

    rows = np.linspace(0, 255, 32)  # a smooth image: JPEG's errors are small on it
    smooth = tf.constant(np.stack([np.add.outer(rows, rows) / 2, np.tile(rows, (32, 1)),
                                   np.tile(rows[:, None], (1, 32))], -1).astype(np.uint8))
    once = make_tfrecords.jpeg_round_trip(smooth, 75, offset=0)
    error = lambda a, b: np.abs(a.numpy().astype(float) - b.numpy()).mean()  # noqa: E731
    aligned = error(make_tfrecords.jpeg_round_trip(once, 75, offset=0), once)
    shifted = error(make_tfrecords.jpeg_round_trip(once, 75), once)
    assert once.shape == smooth.shape and 0 < error(once, smooth)
    assert aligned < shifted  # an aligned second pass nearly repeats the first


def test_files_shard_across_workers_without_overlap(photo_folder, tmp_path):
    records, total, _ = make_tfrecords.records_from_folder(str(photo_folder), 8)
    tfrecords.write_shards(records, total, str(tmp_path / "p"), total)
    seen = [sorted(int(i) for _, _, i in tfrecords.load(str(tmp_path / "p*.tfrec"), 2, w)[0])
            for w in range(2)]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(total))


def test_no_matching_files_names_the_pattern(tmp_path):
    with pytest.raises(sources.DatasetError, match="no TFRecord files match .*nothing"):
        tfrecords.load(str(tmp_path / "nothing*.tfrec"))


def test_file_name_without_count_is_named(tmp_path):
    path = tmp_path / "flowers.tfrec"
    path.write_bytes(b"")
    with pytest.raises(sources.DatasetError, match="cannot count the records of .*flowers"):
        tfrecords.load(str(path))


def test_corrupt_record_error_names_the_file(photo_folder, tmp_path):
    records, total, _ = make_tfrecords.records_from_folder(str(photo_folder), 8)
    path = tfrecords.write_shards(records, total, str(tmp_path / "c"), 1)[0]
    data = bytearray(open(path, "rb").read())
    data[40:60] = b"\xff" * 20  # inside the first record's payload
    open(path, "wb").write(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        list(tfrecords.load(path)[0])
    message = tfrecords.find_corrupt(str(tmp_path / "c*.tfrec"))
    assert path in message and "\n" not in message


def test_tfrecord_dataset_spec_comes_from_dataset_json(tmp_path):
    (tmp_path / "dataset.json").write_text(json.dumps(
        {"source": "tf_flowers", "class_names": ["a", "b", "c"], "image_size": 64}))
    spec = sources.get_spec(f"tfrecord:{tmp_path}/x*.tfrec")
    assert spec.num_classes == 3 and spec.image_shape == (64, 64, 3)
    with pytest.raises(sources.DatasetError, match="no dataset.json beside"):
        sources.get_spec(f"tfrecord:{tmp_path}/sub/x*.tfrec")


def test_tfrecord_dataset_needs_a_holdout_fraction(tmp_path):
    (tmp_path / "dataset.json").write_text(json.dumps(
        {"class_names": ["a", "b"], "holdout_fraction": 0}))
    with pytest.raises(sources.DatasetError, match="holdout_fraction must be in"):
        sources.get_spec(f"tfrecord:{tmp_path}/x*.tfrec")


def _make_tfrecords(*args: str, quiet_env: bool = True) -> subprocess.CompletedProcess:
    """The command; quiet_env=False leaves TF_CPP_MIN_LOG_LEVEL unset, so the command
    must silence TensorFlow's start-up by itself."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if not quiet_env:
        env.pop("TF_CPP_MIN_LOG_LEVEL")
    return subprocess.run([sys.executable, "-m", "trainer.tools.make_tfrecords", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_writes_shards_and_dataset_json(photo_folder, tmp_path):
    result = _make_tfrecords(f"--source={photo_folder}", f"--output={tmp_path}/out/pets",
                             "--image_size=8", "--shards=2")
    assert result.returncode == 0, result.stderr[-2000:]
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert meta["class_names"] == ["cats", "dogs"] and meta["image_size"] == 8
    assert meta["files"] == 2 and f"wrote {meta['records']} records in 2 files" in result.stdout
    spec = sources.get_spec(f"tfrecord:{tmp_path}/out/pets*.tfrec")
    assert spec.image_shape == (8, 8, 3) and spec.num_classes == 2


def test_cli_helpfull_lists_the_flags_with_their_defaults():
    result = _make_tfrecords("--helpfull")
    assert result.returncode == 1, result.stderr[-2000:]  # absl's status after help
    assert "Traceback" not in result.stderr
    for name in ("source", "output", "image_size", "shards", "data_dir"):
        assert f"--{name}:" in result.stdout
    assert "(default: '192')" in result.stdout and "(default: '16')" in result.stdout


def test_cli_missing_folder_is_a_one_line_error_with_status_2(tmp_path):
    result = _make_tfrecords(f"--source={tmp_path}/no_such_folder", f"--output={tmp_path}/x")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no_such_folder" in errors[0]
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    assert not os.listdir(tmp_path)  # nothing written


# --- --source=generated: learnable JPEGs of varied sizes, and progress lines --------

TINY = make_tfrecords.Generated(num_examples=40, classes=3, seed=0)
TINY_FLAGS = ("--source=generated", "--num_examples=40", "--classes=3", "--image_size=32",
              "--shards=2")
PROGRESS_LINE = re.compile(r"^[\d,]+/[\d,]+ records, [\d,]+ records/s, ETA (\d+:)?\d+:\d\d$")
FINAL_LINE = re.compile(r"^[\d,]+ records in \d+\.\d s, [\d,]+ records/s$")


def _file_bytes(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def _size_feature(record) -> list[int]:
    return list(tf.train.Example.FromString(record.numpy()).features.feature["size"]
                .int64_list.value)


def test_generated_source_writes_learnable_jpegs_of_varied_sizes(tmp_path):
    paths = make_tfrecords.write("generated", str(tmp_path / "a" / "gen"), 32, 2, None,
                                 generated=TINY)
    assert [os.path.basename(p) for p in paths] == ["gen00-20.tfrec", "gen01-20.tfrec"]
    meta = json.loads((tmp_path / "a" / "dataset.json").read_text())
    assert meta["records"] == 40 and meta["image_size"] == 32 and meta["files"] == 2
    assert meta["class_names"] == ["class_0", "class_1", "class_2"]
    assert meta["source"] == "" and meta["generated"]["seed"] == 0
    spec = sources.get_spec(f"tfrecord:{tmp_path}/a/gen*.tfrec")
    assert spec.num_classes == 3 and spec.image_shape == (32, 32, 3)

    ds, count = tfrecords.load(str(tmp_path / "a" / "gen*.tfrec"))
    examples = [(image.numpy(), int(label), int(index)) for image, label, index in ds]
    assert count == len(examples) == 40
    assert sorted(index for _, _, index in examples) == list(range(40))
    assert {label for _, label, _ in examples} == {0, 1, 2}  # in range, all there
    shapes = {image.shape for image, _, _ in examples}
    assert len(shapes) > 10  # sizes vary per example ...
    assert all(26 <= h <= 40 and 26 <= w <= 40 and c == 3 for h, w, c in shapes)  # 0.8-1.25x
    records = list(tf.data.TFRecordDataset(paths))
    assert all(r.numpy().count(b"\xff\xd8\xff") for r in records)  # JPEG
    by_index = {index: image.shape[:2] for image, _, index in examples}
    assert all(_size_feature(r) == list(by_index[int(tfrecords.parse(r)[2])])
               for r in records)  # `size` is the image's own [height, width]

    # Learnable: the nearest class pattern (at 32x32) names the label of every image.
    patterns = make_tfrecords.class_patterns(3).numpy() * 0.6 + 50.0
    for image, label, _ in examples:
        small = tf.image.resize(image.astype(np.float32), (32, 32)).numpy()
        assert np.argmin(((patterns - small) ** 2).mean(axis=(1, 2, 3))) == label

    # Deterministic: the same call writes the same bytes; another seed other images.
    make_tfrecords.write("generated", str(tmp_path / "b" / "gen"), 32, 2, None,
                         generated=TINY)
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")
    other = make_tfrecords.write("generated", str(tmp_path / "c" / "gen"), 32, 2, None,
                                 generated=make_tfrecords.Generated(40, 3, seed=1))
    assert open(other[0], "rb").read() != open(paths[0], "rb").read()


def test_generated_images_at_224_are_photo_sized_jpegs():
    ds = make_tfrecords.generated_dataset(224, make_tfrecords.Generated(16, 100))
    sizes = [len(encoded) for encoded, _, _, _ in ds.as_numpy_iterator()]
    assert 10_000 < np.mean(sizes) < 30_000, sizes


def test_generated_source_refuses_split_and_round_trip(tmp_path):
    for kwargs in ({"split": "test"}, {"round_trip": 75}):
        with pytest.raises(sources.DatasetError, match="generated_seed"):
            make_tfrecords.write("generated", str(tmp_path / "x"), 8, 1, None, **kwargs)
    assert not os.listdir(tmp_path)


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_off_a_terminal_and_a_bar_on_one():
    now = [0.0]
    stream = io.StringIO()
    progress = make_tfrecords.Progress(stream, every_seconds=10, every_records=0,
                                       live=False, clock=lambda: now[0])
    progress.start(200_000)
    for _ in range(12):
        now[0] += 1.0
        progress.update(1_000)  # 1,000 records/s: a line at 10 s, none before
    progress.update(188_000 - 1)
    now[0] += 100.0
    progress.update(1)
    lines = progress.finish(), stream.getvalue().splitlines()
    assert lines[1][0] == "10,000/200,000 records, 1,000 records/s, ETA 3:10"
    assert len(lines[1]) == 2 and lines[1][1] == lines[0] == (
        "200,000 records in 112.0 s, 1,786 records/s")
    # By records: a line every 5 records, none at the end (the final line says it).
    stream = io.StringIO()
    progress = make_tfrecords.Progress(stream, every_seconds=1e9, every_records=5,
                                       live=False)
    progress.start(12)
    list(progress.track(iter([b"x"] * 12)))
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["5/12", "10/12", "12"]
    assert all(PROGRESS_LINE.match(line) for line in lines[:2])
    assert FINAL_LINE.match(lines[2])
    assert make_tfrecords._clock(3725) == "1:02:05"
    # On a terminal: tqdm's bar with the rate and the ETA.
    terminal = _FakeTerminal()
    progress = make_tfrecords.Progress(terminal, live=True)
    progress.start(3)
    list(progress.track(iter([b"x"] * 3)))
    progress.finish()
    assert "3.00/3.00" in terminal.getvalue() and "records/s" in terminal.getvalue()


def test_cli_generated_is_quiet_with_plain_progress_lines_and_the_same_bytes(tmp_path):
    result = _make_tfrecords(*TINY_FLAGS, f"--output={tmp_path}/cli/gen",
                             "--progress_records=16", quiet_env=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote 40 records in 2 files" in result.stdout
    lines = result.stderr.splitlines()
    # Nothing but our lines: no oneDNN / cpu_feature_guard / CUDA / absl start-up lines.
    assert [line.split(" ")[0] for line in lines] == ["16/40", "32/40", "40"], lines
    assert all(PROGRESS_LINE.match(line) for line in lines[:-1]) and FINAL_LINE.match(
        lines[-1])
    # The command's files are the library's, byte for byte, from another process.
    make_tfrecords.write("generated", str(tmp_path / "lib" / "gen"), 32, 2, None,
                         generated=TINY)
    assert _file_bytes(tmp_path / "cli") == _file_bytes(tmp_path / "lib")


# --- Paths through tf.io.gfile: ram:// stands in for a gs:// bucket ----------------

@pytest.fixture
def ram_dir():
    """A fresh folder on TensorFlow's in-memory filesystem, emptied afterwards (its
    rmtree fails on folders that still hold files)."""
    root = f"ram://{uuid.uuid4().hex}"
    yield root
    for folder, _, names in tf.io.gfile.walk(root):
        for name in names:
            tf.io.gfile.remove(f"{folder.rstrip('/')}/{name}")


@pytest.mark.parametrize("path,parent", [("ram://x", "ram://"), ("gs://b/f/x*.tfrec", "gs://b/f"),
                                         ("x*.tfrec", ""), ("/a/b/x", "/a/b")])
def test_directory_keeps_a_url_root(path, parent):
    assert tfrecords.directory(path) == parent


@pytest.fixture
def at_ram_root(ram_dir):
    """A file prefix at the root of ram:// (where os.path.dirname gives "ram:", a
    local folder), and dataset.json there removed afterwards."""
    yield f"{ram_dir}-x"
    for path in tf.io.gfile.glob(f"{ram_dir}-x*") + ["ram://dataset.json"]:
        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)


@pytest.mark.parametrize("where", ["folder", "root"])
def test_write_and_read_back_on_a_bucket_like_filesystem_touch_no_local_disk(
        tmp_path, monkeypatch, ram_dir, at_ram_root, where):
    monkeypatch.chdir(tmp_path)  # a "ram:" folder made by mistake would land here
    for label, name in enumerate(("cats", "dogs")):
        for i in range(4):
            tf.io.write_file(f"{ram_dir}/photos/{name}/{i}.png",
                             tf.io.encode_png(_image((20, 30, 3), 10 * label + i)))
    prefix = f"{ram_dir}/flowers/x" if where == "folder" else at_ram_root
    paths = make_tfrecords.write(f"{ram_dir}/photos", prefix, 8, 2, None)
    assert paths == [f"{prefix}00-4.tfrec", f"{prefix}01-4.tfrec"]
    assert tf.io.gfile.exists(os.path.join(tfrecords.directory(prefix), "dataset.json"))
    spec = sources.get_spec(f"tfrecord:{prefix}*.tfrec")
    assert spec.class_names == ("cats", "dogs") and spec.image_shape == (8, 8, 3)
    assert not spec.holdout_files  # ours carry an index: the per-record hash hold-out
    seen = {}
    for split in ("train", "validation"):
        ds, count = sources.load(spec, split)
        examples = [(image.numpy(), int(label)) for image, label in ds]
        assert count == len(examples) and all(i.shape == (8, 8, 3) for i, _ in examples)
        seen[split] = {image.tobytes() for image, _ in examples}
    assert not seen["train"] & seen["validation"]
    assert len(seen["train"] | seen["validation"]) == 8
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "ram:"))


# --- The flowers codelab's files, as the codelab writes and reads them ---------------

CODELAB_CLASSES = ("daisy", "dandelion", "roses")


def _codelab_example(image_bytes, class_num, classes, size, one_hot=True, label=True):
    """The codelab's to_tfrecord: image, class, label, size, one_hot_class (no index)."""
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image_bytes])),
        "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[class_num])),
        "size": tf.train.Feature(int64_list=tf.train.Int64List(value=list(size))),
    }
    if label:
        feature["label"] = tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[classes[class_num].encode()]))
    if one_hot:
        feature["one_hot_class"] = tf.train.Feature(float_list=tf.train.FloatList(
            value=np.eye(len(classes))[class_num].tolist()))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _codelab_files(prefix, counts, classes=CODELAB_CLASSES, first_class=0, **features):
    """Files prefix{NN}-{count}.tfrec; record k (over all files) is a 12x12 JPEG filled
    with 10k, of class (first_class + k) % len(classes). Returns each file's record ids."""
    ids, k = [], 0
    for shard, count in enumerate(counts):
        with tf.io.TFRecordWriter(f"{prefix}{shard:02d}-{count}.tfrec") as writer:
            for _ in range(count):
                image = tf.fill((12, 12, 3), tf.constant(10 * k, tf.uint8))
                writer.write(_codelab_example(
                    tf.io.encode_jpeg(image, quality=95).numpy(),
                    (first_class + k) % len(classes), classes, (12, 12), **features))
                k += 1
        ids.append(list(range(k - count, k)))
    return ids


def _ids(ds):
    """(record id, label) of each example of _codelab_files' records."""
    return [(int(round(float(tf.reduce_mean(tf.cast(image, tf.float32))) / 10)), int(label))
            for image, label in ds]


def test_codelab_files_train_and_validate_on_disjoint_whole_files(ram_dir):
    ids = _codelab_files(f"{ram_dir}/flowers", [3, 3, 3, 2])
    spec = sources.get_spec(f"tfrecord:{ram_dir}/flowers*.tfrec")
    assert spec.num_classes == 3 and spec.class_names == CODELAB_CLASSES
    assert spec.image_shape == (12, 12, 3) and spec.holdout_files
    train, n_train = sources.load(spec, spec.train_split)
    held, n_held = sources.load(spec, spec.eval_split)
    train, held = _ids(train), _ids(held)
    assert (n_train, n_held) == (len(train), len(held)) == (9, 2)  # ceil(15% of 4) files
    assert sorted(k for k, _ in held) == ids[3]  # the last file, whole
    assert sorted(k for k, _ in train) == ids[0] + ids[1] + ids[2]
    assert all(label == k % 3 for k, label in train + held)
    # Two input workers split the training files between them.
    shards = [_ids(sources.load(spec, "train", context=tf.distribute.InputContext(2, w, 2))[0])
              for w in range(2)]
    assert sorted(k for k, _ in shards[0]) == ids[0] + ids[2]
    assert sorted(k for k, _ in shards[1]) == ids[1]
    # ... and they train: batches come out of the training pipeline.
    batch = next(iter(pipeline.make_train(
        sources.load(spec, "train")[0], tf.distribute.InputContext(1, 0, 1), 4,
        augment.identity, lambda x, y: (tf.cast(x, tf.float32), y), shuffle_buffer=9)))
    assert batch["image"].shape == (4, 12, 12, 3) and set(batch["label"].numpy()) <= {0, 1, 2}


@pytest.mark.parametrize("features,suffix,classes", [
    ({"one_hot": False}, "", CODELAB_CLASSES),                     # from the labels
    ({"one_hot": False, "label": False}, "", ("0", "1", "2")),     # from the class ids
    ({"label": False}, "", ("0", "1", "2")),                       # from the one-hot length
    ({}, ";classes=4", CODELAB_CLASSES + ("3",)),                  # given in the name
])
def test_codelab_class_count_and_names_from_what_the_records_have(ram_dir, features, suffix,
                                                                 classes):
    _codelab_files(f"{ram_dir}/f", [4, 2], first_class=2, **features)  # ids 2, 0, 1, 2, ...
    spec = sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec{suffix}")
    assert spec.class_names == classes and spec.num_classes == len(classes)


def test_dataset_json_beside_codelab_files_wins_for_names_and_holdout(ram_dir):
    ids = _codelab_files(f"{ram_dir}/f", [2, 2, 2, 2])
    with tf.io.gfile.GFile(f"{ram_dir}/dataset.json", "w") as f:
        json.dump({"class_names": ["x", "y", "z"], "image_size": 10,
                   "holdout_fraction": 0.5}, f)
    spec = sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec")
    assert spec.class_names == ("x", "y", "z") and spec.image_shape == (10, 10, 3)
    assert spec.holdout_files  # no index in the records: whole files, half of them
    held, count = sources.load(spec, "validation")
    assert count == 4 and sorted(k for k, _ in _ids(held)) == ids[2] + ids[3]


def test_eval_pattern_names_the_validation_files(ram_dir):
    train_ids = _codelab_files(f"{ram_dir}/train", [3])  # one file is fine with eval=
    _codelab_files(f"{ram_dir}/val", [2])
    name = f"tfrecord:{ram_dir}/train*.tfrec;eval={ram_dir}/val*.tfrec"
    spec = sources.get_spec(name)
    assert spec.eval_pattern == f"{ram_dir}/val*.tfrec" and spec.holdout_fraction == 0
    assert not spec.holdout_files and spec.tfrecord_pattern == f"{ram_dir}/train*.tfrec"
    train, n_train = sources.load(spec, "train")
    held, n_held = sources.load(spec, "validation")
    assert sorted(k for k, _ in _ids(train)) == train_ids[0] and n_train == 3
    assert n_held == len(_ids(held)) == 2


@pytest.mark.parametrize("suffix", [";evl=x", ";eval=", ";eval", ";eval=a;eval=b",
                                    ";classes=two", ";classes=0", ";"])
def test_malformed_tfrecord_name_is_a_one_line_error(ram_dir, suffix):
    _codelab_files(f"{ram_dir}/f", [2, 2])
    with pytest.raises(sources.DatasetError) as err:
        sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec{suffix}")
    assert "\n" not in str(err.value) and sources.TFRECORD_SYNTAX in str(err.value)


def test_eval_pattern_must_match_other_files(ram_dir):
    _codelab_files(f"{ram_dir}/f", [2, 2])
    with pytest.raises(sources.DatasetError, match="no TFRecord files match .*nothing"):
        sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec;eval={ram_dir}/nothing*.tfrec")
    with pytest.raises(sources.DatasetError, match="f01-2.tfrec matches both"):
        sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec;eval={ram_dir}/f01*.tfrec")


def test_one_codelab_file_without_index_or_eval_pattern_is_refused(ram_dir):
    _codelab_files(f"{ram_dir}/f", [5])
    with pytest.raises(sources.DatasetError, match="matches one file .* no index") as err:
        sources.get_spec(f"tfrecord:{ram_dir}/f*.tfrec")
    assert "\n" not in str(err.value) and ";eval=EVAL_PATTERN" in str(err.value)


def test_unreadable_codelab_file_is_named(tmp_path):
    _codelab_files(str(tmp_path / "f"), [2, 2])
    path = str(tmp_path / "f00-2.tfrec")
    data = bytearray(open(path, "rb").read())
    data[40:60] = b"\xff" * 20
    open(path, "wb").write(bytes(data))
    with pytest.raises(sources.DatasetError, match=f"corrupt or truncated TFRecord file {path}"):
        sources.get_spec(f"tfrecord:{tmp_path}/f*.tfrec")


def test_a_codelab_run_keeps_a_description_that_predict_can_read(ram_dir):
    _codelab_files(f"{ram_dir}/data/f", [2, 2])
    spec = sources.get_spec(f"tfrecord:{ram_dir}/data/f*.tfrec")
    sources.save_description(spec, f"{ram_dir}/run")  # no dataset.json to copy
    kept = sources.get_spec(f"tfrecord:{ram_dir}/run/*")
    assert kept.class_names == CODELAB_CLASSES and kept.image_shape == (12, 12, 3)


def _codelab_read_tfrecord(example, num_classes, size):
    """The codelab's read_tfrecord, as written there."""
    features = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "class": tf.io.FixedLenFeature([], tf.int64),
        "label": tf.io.FixedLenFeature([], tf.string),
        "size": tf.io.FixedLenFeature([2], tf.int64),
        "one_hot_class": tf.io.VarLenFeature(tf.float32),
    }
    example = tf.io.parse_single_example(example, features)
    image = tf.io.decode_jpeg(example["image"], channels=3)
    image = tf.reshape(image, [size, size, 3])
    one_hot_class = tf.sparse.to_dense(example["one_hot_class"])
    one_hot_class = tf.reshape(one_hot_class, [num_classes])
    return image, example["class"], example["label"], example["size"], one_hot_class


def test_our_files_read_the_codelab_way(photo_folder, tmp_path):
    records, total, classes = make_tfrecords.records_from_folder(str(photo_folder), 16)
    tfrecords.write_shards(records, total, str(tmp_path / "x"), 2)
    ds = tf.data.TFRecordDataset(tf.io.gfile.glob(str(tmp_path / "x*.tfrec"))).map(
        lambda record: _codelab_read_tfrecord(record, 2, 16))
    read = list(ds)
    assert len(read) == total
    for image, class_num, label, size, one_hot in read:
        assert image.shape == (16, 16, 3) and size.numpy().tolist() == [16, 16]
        assert label.numpy().decode() == classes[int(class_num)]
        assert one_hot.numpy().tolist() == np.eye(2)[int(class_num)].tolist()


def _bands(height, width):
    """Three vertical bands: 0 | 200 | 100 (a wide image's middle is 200)."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:, width // 4: 3 * width // 4] = 200
    image[:, 3 * width // 4:] = 100
    return image


def test_writer_fills_the_square_and_keeps_the_middle():
    wide = make_tfrecords.fill_square(tf.constant(_bands(20, 60)), 10)
    assert wide.shape == (10, 10, 3) and wide.dtype == tf.uint8
    assert np.all(np.abs(wide.numpy().astype(int) - 200) <= 1)
    tall = make_tfrecords.fill_square(tf.constant(_bands(20, 60).transpose(1, 0, 2)), 10)
    assert tall.shape == (10, 10, 3) and np.all(np.abs(tall.numpy().astype(int) - 200) <= 1)
    small = make_tfrecords.fill_square(tf.constant(_bands(4, 8)), 12)  # upscaled
    assert small.shape == (12, 12, 3)


def test_written_image_is_the_centre_crop(tmp_path):
    (tmp_path / "photos" / "wide").mkdir(parents=True)
    tf.io.write_file(str(tmp_path / "photos" / "wide" / "a.png"),
                     tf.io.encode_png(_bands(30, 90)))
    records, _, _ = make_tfrecords.records_from_folder(str(tmp_path / "photos"), 10)
    image, label, _ = tfrecords.parse(next(records))
    assert image.shape == (10, 10, 3) and int(label) == 0
    assert np.all(np.abs(image.numpy().astype(int) - 200) <= 6)  # JPEG, no side bands
