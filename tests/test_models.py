"""The model table and the seed's convnet."""
import keras
import numpy as np
import pytest

import models


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'resnet9'; valid: cifar_cnn"):
        models.build("resnet9", 10, (32, 32, 3))


def test_cifar_cnn_matches_the_seed_parameter_count():
    # The seed's Keras model (same layers, softmax head) has 1,676,982 parameters.
    assert models.build("cifar_cnn", 10, (32, 32, 3)).count_params() == 1_676_982


@pytest.mark.parametrize("name", models.names())
def test_tiny_variant_outputs_float32_logits(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = models.build(name, 7, (32, 32, 3), tiny=True)
    assert model.count_params() < 100_000
    outputs = model(np.random.default_rng(0).normal(size=(3, 32, 32, 3)), training=False)
    assert outputs.shape == (3, 7) and outputs.dtype == "float32"
    # Logits, not probabilities: rows do not sum to 1 and values may be negative.
    assert not np.allclose(np.sum(outputs, axis=-1), 1.0)
