"""TFRecords: write -> read round trip, any image format, errors that name things."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from data import make_tfrecords, sources, tfrecords

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


def _make_tfrecords(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "data.make_tfrecords", *args], cwd=ROOT,
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
