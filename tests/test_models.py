"""The model table and every model's tiny variant; SqueezeNet's fire module; weights."""
import os
import sys

import keras
import numpy as np
import pytest

import models
from models import squeezenet, xception


def _shape(name: str) -> tuple[int, int, int]:
    size = models.entry(name).min_image_size
    return (size, size, 3)


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'resnet9'; valid: airbench, "
                                         "airbench_small, cifar_cnn"):
        models.build("resnet9", 10, (32, 32, 3))


def test_cifar_cnn_matches_the_seed_parameter_count():
    # The seed's Keras model (same layers, softmax head) has 1,676,982 parameters.
    assert models.build("cifar_cnn", 10, (32, 32, 3)).count_params() == 1_676_982


def test_a_new_model_file_registers_itself(tmp_path, monkeypatch):
    """A model is one new file in models/: imported with the package, it is in the
    registry (no table to edit) and builds by name."""
    import importlib
    import shutil
    package = tmp_path / "models"
    shutil.copytree(os.path.dirname(models.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (package / "my_mlp.py").write_text(
        "import keras\nimport models\n\n\n"
        "@models.register('my_mlp')\n"
        "def build(num_classes, input_shape, tiny=False, width=32):\n"
        "    inputs = keras.Input(input_shape)\n"
        "    x = keras.layers.Dense(width, activation='relu')(keras.layers.Flatten()(inputs))\n"
        "    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))\n")
    for name in [n for n in sys.modules if n == "models" or n.startswith("models.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    # (trainer/__init__.py imports the project's own `models` wherever a copy sits:
    # here the copy is the point, so that finder stands aside for the test)
    monkeypatch.setattr(sys, "meta_path", [finder for finder in sys.meta_path if
                                           type(finder).__name__ != "_OwnPackagesFirst"])
    # The fresh import registers its layers with Keras again: Keras' table is put
    # back afterwards, or later from_config calls would build the fresh classes.
    custom_objects = keras.saving.get_custom_objects()
    saved = dict(custom_objects)
    try:
        fresh = importlib.import_module("models")
        assert "my_mlp" in fresh.names() and fresh.entry("my_mlp").outputs == fresh.LOGITS
        model = fresh.build("my_mlp", 4, (8, 8, 3), options="width=16")
        assert model.output_shape == (None, 4)
    finally:
        custom_objects.clear()
        custom_objects.update(saved)


@pytest.mark.parametrize("name", models.names())
def test_tiny_variant_outputs_what_the_model_declares(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    kind = models.entry(name).outputs
    model = models.build(name, 7, _shape(name), tiny=True)
    assert model.count_params() < 100_000
    if kind == models.GENERATOR:  # an image of the data's shape, from a latent vector
        latent = np.random.default_rng(0).normal(size=(3, *model.inputs[0].shape[1:]))
        outputs = model(latent, training=False)
        assert outputs.shape == (3, *_shape(name)) and outputs.dtype == "float32"
        assert -1 <= float(np.min(outputs)) and float(np.max(outputs)) <= 1  # tanh
        return
    images = np.random.default_rng(0).normal(size=(3, *_shape(name)))
    outputs = model(images, training=False)
    if kind == models.IMAGE:  # a reconstruction of the input, float32
        assert outputs.shape == images.shape and outputs.dtype == "float32"
        return
    if kind == models.HEADS:  # the main head is "logits"; others are auxiliary
        assert isinstance(outputs, dict) and "logits" in outputs
        assert all(o.shape == (3, 7) and o.dtype == "float32" for o in outputs.values())
        outputs = outputs["logits"]
    assert outputs.shape == (3, 7) and outputs.dtype == "float32"
    # Logits, not probabilities: rows do not sum to 1.
    assert not np.allclose(np.sum(outputs, axis=-1), 1.0)


def test_fire_module_channel_arithmetic():
    inputs = keras.Input((16, 16, 12))
    outputs = squeezenet.fire(inputs, squeeze=4, expand=10)
    assert outputs.shape == (None, 16, 16, 10)  # 5 from 1x1 + 5 from 3x3
    squeeze = [layer for layer in keras.Model(inputs, outputs).layers
               if isinstance(layer, keras.layers.Conv2D)][0]
    assert squeeze.filters == 4 and squeeze.kernel_size == (1, 1)
    with pytest.raises(ValueError, match="must be even"):
        squeezenet.fire(inputs, 4, 9)


def test_squeezenet_default_is_the_codelab_network():
    model = models.build("squeezenet", 5, (192, 192, 3))
    pools = [layer for layer in model.layers if isinstance(layer, keras.layers.MaxPooling2D)]
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(pools) == len(squeezenet.CODELAB_FIRES) - 1
    assert len(norms) == len(convs) == 1 + 3 * len(squeezenet.CODELAB_FIRES)
    assert all(n.momentum == 0.9 for n in norms)


def test_xception_rejects_images_below_71_pixels():
    with pytest.raises(ValueError, match="at least 71x71"):
        models.build("xception", 5, (64, 64, 3))


def test_weights_path_reproduces_a_saved_xception(tmp_path):
    model = models.build("xception", 5, (71, 71, 3))
    path = str(tmp_path / "xception.weights.h5")
    model.save_weights(path)
    images = np.random.default_rng(1).normal(size=(2, 71, 71, 3)).astype("float32")
    again = models.build("xception", 5, (71, 71, 3), weights=path)
    np.testing.assert_allclose(again(images, training=False), model(images, training=False),
                               rtol=1e-5, atol=1e-5)


def test_weights_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no such file"):
        models.build("cifar_cnn", 10, (32, 32, 3), weights=str(tmp_path / "x.weights.h5"))
    path = str(tmp_path / "small.weights.h5")
    models.build("cifar_cnn", 10, (32, 32, 3), tiny=True).save_weights(path)
    with pytest.raises(ValueError, match="does not fit cifar_cnn"):
        models.build("cifar_cnn", 10, (32, 32, 3), weights=path)

    def offline(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(keras.applications, "Xception", offline)
    with pytest.raises(ValueError, match=xception.IMAGENET_FILE):
        models.build("xception", 5, (96, 96, 3), weights="imagenet")


def test_resnet_fast_is_a_resnet9_with_fast_batch_norm():
    model = models.build("resnet_fast", 10, (32, 32, 3))
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert [c.filters for c in convs] == [32, 64, 64, 64, 128, 256, 256, 256]
    norms = [layer for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 8 and all(n.momentum == 0.6 for n in norms)


def test_airbench_small_flops_are_its_convolutions_and_head():
    """trainer/flops.py counts every convolution (the fused batch-norm and GELU in
    between once hid their shapes from TF's profiler: 2 MFLOP, not ~40)."""
    from trainer import flops
    model = models.build("airbench_small", 10, (32, 32, 3))
    analytic = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):  # the whitening layer too
            _, height, width, _ = layer.output.shape
            analytic += 2 * height * width * np.prod(layer.kernel.shape)  # k*k*Cin*Cout
        elif isinstance(layer, keras.layers.Dense):
            analytic += 2 * np.prod(layer.kernel.shape)
    assert 35e6 < analytic < 45e6  # (the first 3x3 convolution alone: 13.3 M)
    before = [v.numpy().copy() for v in model.variables]
    assert flops.forward_flops_of(model) == pytest.approx(analytic, rel=0.05)
    # (the run's own model, traced, never run: weights and statistics untouched)
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.variables))


@pytest.mark.parametrize("name", models.names())
def test_every_model_has_a_sane_flop_count(name):
    """Each kernel weight is used at least once and at most once per position of
    the image (tiny variants, as a run counts them)."""
    from trainer import flops
    num_classes = None if models.entry(name).outputs in (models.IMAGE,
                                                         models.GENERATOR) else 7
    model = models.build(name, num_classes, _shape(name), tiny=True)
    kernel_weights = sum(int(np.prod(v.shape)) for v in model.weights
                         if v.path.endswith("kernel"))
    height, width, _ = _shape(name)
    assert 2 * kernel_weights <= flops.forward_flops_of(model) <= (
        2 * kernel_weights * height * width)


def test_the_log_says_a_backbone_starts_from_random_weights_unless_given_some():
    """xception's recipe fine-tunes in the codelab; here it trains from scratch
    unless --weights names ImageNet's or a file, and the set-up log says so."""
    from trainer.output import progress
    assert models.takes_backbone_weights("xception")
    assert not models.takes_backbone_weights("cifar_cnn")
    said = progress.initial_weights("xception", "none")
    assert said.startswith("random") and "from scratch" in said and "imagenet" in said
    assert progress.initial_weights("cifar_cnn", "none") == "random (--weights=none)"
    assert progress.initial_weights("xception", "imagenet").startswith("imagenet")
