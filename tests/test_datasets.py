"""Any TFDS image-classification dataset by name (its classes, sizes and splits from
its own info), here on tfds.testing.mock_data; ResNet-50 and ImageNet's recipe."""
import json
import os

import pytest
import tensorflow_datasets as tfds

from data import sources
from trainer import recipes


@pytest.mark.parametrize("dataset, model, classes", [
    ("imagenet2012", "resnet50", 1000),  # variable-size photos: Inception crop, 224/256
    ("cifar100", "cifar_cnn", 100),      # fixed 32x32: pad-crop-flip
])
@pytest.mark.long(18)  # seconds, with -n 2
def test_a_tfds_dataset_by_name_trains_and_evaluates(run, tmp_path, dataset, model,
                                                     classes):
    model_dir = str(tmp_path / "run")
    with tfds.testing.mock_data(num_examples=24):
        spec = sources.get_spec(dataset)
        status, log = run(f"--dataset={dataset}", f"--model={model}", "--model_size=tiny",
                          "--image_size=32", "--batch_size=8", "--train_steps=3",
                          f"--model_dir={model_dir}", "--data_dir=" + str(tmp_path))
    assert status == 0, log
    assert spec.num_classes == classes and spec.eval_split == "validation"
    assert spec.augment == ("inception_crop" if dataset == "imagenet2012" else "pad_crop_flip")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["steps"] == 3 and metrics["test_examples"] == 24
    assert "Input: --cache=auto: in memory" in log  # mocked data has no files to stream


def test_an_unprepared_dataset_is_one_line_naming_the_directory(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    status, log = run("--dataset=cifar100", f"--data_dir={empty}",
                      f"--model_dir={tmp_path / 'run'}", "--train_steps=1")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, log
    assert f"not prepared in {empty}" in errors[0] and "tfds build cifar100" in errors[0]
    assert "Variant folder" not in log, log  # TFDS' own warning before ours: dropped
    assert not (tmp_path / "run").exists()


def test_unknown_names_and_splits_are_one_line():
    with pytest.raises(sources.DatasetError, match="not a TFDS dataset name"):
        sources.get_spec("no_such_dataset_anywhere")
    with pytest.raises(sources.DatasetError, match="has no split 'valid'.*test, train"):
        sources.get_spec("cifar10:3.0.2", eval_split="valid")
    assert sources.get_spec("cifar10", eval_split="train[:10%]").eval_split == "train[:10%]"


def test_the_resnet50_recipe_scales_its_learning_rate_with_the_batch():
    values = {"model": "resnet50", "batch_size": 1024, "learning_rate": 1e-3}
    assert recipes.resolve(values, set())[0]["learning_rate"] == pytest.approx(1.6)
    resolved, origin = recipes.resolve({**values, "batch_size": 512}, {"batch_size"})
    assert resolved["learning_rate"] == pytest.approx(0.2) and resolved["batch_size"] == 512
    assert recipes.resolve({**values, "learning_rate": 0.5},
                           {"learning_rate"})[0]["learning_rate"] == 0.5


def test_resnet50_starts_each_block_as_the_identity_and_strides_in_the_3x3():
    import models
    model = models.entry("resnet50").builder(num_classes=10, input_shape=(64, 64, 3), tiny=True)
    last = [layer for layer in model.layers if layer.name.endswith("_3_bn")]
    assert len(last) == 4 and all(not layer.gamma.numpy().any() for layer in last)
    others = [layer for layer in model.layers
              if layer.name.endswith("_bn") and layer not in last]
    assert others and all((layer.gamma.numpy() == 1).all() for layer in others)
    strided = [layer.name for layer in model.layers
               if getattr(layer, "strides", (1, 1)) == (2, 2) and "conv" in layer.name]
    assert "stage3_block1_2_conv" in strided and "stage3_block1_1_conv" not in strided  # v1.5
    full = models.entry("resnet50").builder(num_classes=1000)
    trainable = sum(int(w.numpy().size) for w in full.trainable_weights)
    assert trainable == 25_557_032  # torchvision's ResNet-50, parameter for parameter


def _small_cifar10(root, train: int, test: int, test_claims: int) -> str:
    """The first `train` and `test` records of the prepared CIFAR-10 as a TFDS data
    dir of their own, whose dataset_info.json claims `test_claims` test records."""
    real = os.path.join(os.environ.get("TFDS_DATA_DIR") or "", "cifar10")
    if not os.path.isdir(real):
        pytest.skip("real CIFAR-10 not in TFDS_DATA_DIR")
    import tensorflow as tf
    version = sorted(os.listdir(real))[-1]
    folder = root / "cifar10" / version
    folder.mkdir(parents=True)
    for name in ("features.json", "label.labels.txt", "dataset_info.json"):
        tf.io.gfile.copy(os.path.join(real, version, name), str(folder / name))
    info = json.loads((folder / "dataset_info.json").read_text())
    for split in info["splits"]:
        count = train if split["name"] == "train" else test
        name = f"cifar10-{split['name']}.tfrecord-00000-of-00001"
        with tf.io.TFRecordWriter(str(folder / name)) as writer:
            for record in tf.data.TFRecordDataset(os.path.join(real, version, name)
                                                  ).take(count):
                writer.write(record.numpy())
        split["shardLengths"] = [str(count if split["name"] == "train" else test_claims)]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return str(folder / "cifar10-test.tfrecord-00000-of-00001")


def test_a_split_that_holds_fewer_records_than_its_info_says_is_named_with_its_file(
        run, tmp_path):
    """Issue 43: TFDS info that lies only about the test split's count was reported
    as the training split's, without the file or the cause."""
    test_file = _small_cifar10(tmp_path / "tfds", train=64, test=32, test_claims=40)
    status, log = run("--dataset=cifar10", "--model=cifar_cnn", "--model_size=tiny",
                      f"--data_dir={tmp_path / 'tfds'}", "--batch_size=16",
                      "--train_steps=2", "--eval_every=2", f"--model_dir={tmp_path}/run")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, log[-2000:]
    assert errors[0].startswith("error: TFDS 'cifar10' split 'test': "), errors[0]
    assert (f"{test_file} holds 32 records, dataset_info.json says 40 (records 32-39 "
            f"are missing)") in errors[0]
