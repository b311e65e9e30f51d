"""Sources, augmentation and the input pipelines."""
import numpy as np
import pytest
import tensorflow as tf

from data import augment, pipeline, sources


def _indexed(n: int, size: int = 8) -> tf.data.Dataset:
    """Image i is filled with the value i % 256; label i. Lets tests track examples."""
    return tf.data.Dataset.range(n).map(lambda i: (
        tf.fill((size, size, 3), tf.cast(i % 256, tf.uint8)), tf.cast(i, tf.int32)))


def _context(pipelines=1, pipeline_id=0, replicas=1):
    return tf.distribute.InputContext(pipelines, pipeline_id, replicas)


SEED = tf.constant([1, 2], tf.int64)


def _identity_normalize(images, labels):
    return tf.cast(images, tf.float32), labels


def test_pad_crop_flip_keeps_shape_dtype_and_content_eager_and_in_map():
    images = tf.random.uniform((6, 8, 8, 3), 0, 255, tf.int32)
    images = tf.cast(images, tf.uint8)
    out, labels = augment.pad_crop_flip(images, tf.range(6), SEED)
    assert out.shape == images.shape and out.dtype == tf.uint8
    assert labels.numpy().tolist() == list(range(6))
    # Every output pixel is either padding (0) or a pixel of the same input image.
    for src, dst in zip(images.numpy(), out.numpy()):
        assert set(np.unique(dst)) <= set(np.unique(src)) | {0}
    mapped = tf.data.Dataset.from_tensors((images, tf.range(6))).map(
        lambda x, y: augment.pad_crop_flip(x, y, SEED))
    assert next(iter(mapped))[0].shape == images.shape


def test_pad_crop_flip_varies_per_image():
    image = tf.reshape(tf.range(8 * 8 * 3, dtype=tf.int32) % 250, (1, 8, 8, 3))
    images = tf.cast(tf.tile(image, [64, 1, 1, 1]), tf.uint8)
    out, _ = augment.pad_crop_flip(images, tf.zeros(64, tf.int32), SEED)
    distinct = {o.tobytes() for o in out.numpy()}
    assert len(distinct) > 10  # 81 offsets x 2 flips


def test_random_resized_crop_zooms_in_and_varies_per_image():
    # A horizontal ramp: a crop of >= 50% area spans a narrower range of columns.
    ramp = tf.tile(tf.range(64, dtype=tf.float32)[None, None, :, None] * 4, [32, 64, 1, 3])
    images = tf.cast(ramp, tf.uint8)
    out, _ = augment.random_resized_crop(images, tf.zeros(32, tf.int32), SEED)
    assert out.shape == images.shape and out.dtype == tf.uint8
    spans = [int(o[32, -1, 0]) - int(o[32, 0, 0]) for o in out.numpy()]
    assert max(spans) <= 252 and min(spans) >= 252 * 0.5 * 0.75 - 8
    assert len(set(spans)) > 5
    flipped, _ = augment.crop_flip_saturation(images, tf.zeros(32, tf.int32), SEED)
    assert flipped.shape == images.shape


def test_normalize_standardizes_per_channel():
    normalize = augment.make_normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    images, _ = normalize(tf.fill((2, 2, 2, 3), tf.constant(255, tf.uint8)), None)
    np.testing.assert_allclose(images.numpy(), 2.0, rtol=1e-6)


def test_train_pipeline_shapes_dtypes_and_drop_remainder():
    ds = pipeline.make_train(_indexed(20), _context(replicas=2), 8,
                             augment.pad_crop_flip, _identity_normalize, shuffle_buffer=20)
    images, labels = next(iter(ds))
    assert images.shape == (4, 8, 8, 3) and images.dtype == tf.float32
    assert labels.shape == (4,) and labels.dtype == tf.int32


def test_augmentation_is_a_pure_function_of_the_seed():
    images = tf.cast(tf.random.uniform((16, 8, 8, 3), 0, 255, tf.int32), tf.uint8)
    for name, fn in augment.TRAIN_AUGMENTATIONS.items():
        first, _ = fn(images, tf.zeros(16, tf.int32), SEED)
        again, _ = fn(images, tf.zeros(16, tf.int32), SEED)
        other, _ = fn(images, tf.zeros(16, tf.int32), SEED + 1)
        np.testing.assert_array_equal(first.numpy(), again.numpy())
        if name != "none":
            assert not np.array_equal(first.numpy(), other.numpy()), name


def _stream(start_step, n=40, global_batch=8, replicas=1, seed=3, steps=12):
    """The labels and images of `steps` training steps from `start_step` on."""
    ds = pipeline.make_train(_indexed(n).filter(lambda x, y: True), _context(replicas=replicas),
                             global_batch, augment.pad_crop_flip, _identity_normalize,
                             shuffle_buffer=16, seed=seed, start_step=start_step)
    batches = list(ds.take(steps * replicas))
    return (np.stack([b[1].numpy() for b in batches]),
            np.stack([b[0].numpy() for b in batches]))


@pytest.mark.parametrize("replicas", [1, 2])
def test_train_stream_resumes_exactly_at_any_step(replicas):
    labels, images = _stream(0, replicas=replicas)
    for start in (1, 5, 7):  # 5 steps per epoch: mid-epoch and epoch boundaries
        resumed_labels, resumed_images = _stream(start, replicas=replicas)
        np.testing.assert_array_equal(resumed_labels,
                                      _stream(0, replicas=replicas, steps=12 + start)[0][
                                          start * replicas:])
        np.testing.assert_array_equal(
            resumed_images[: (12 - start) * replicas], images[start * replicas:])
    # Each epoch is a permutation (minus the dropped remainder), and epochs differ.
    epochs = labels[: 10 * replicas].reshape(2, -1)
    assert all(len(set(e.tolist())) == len(e) for e in epochs)
    assert epochs[0].tolist() != epochs[1].tolist()
    assert not np.array_equal(_stream(0, seed=4, replicas=replicas)[0], labels)


def test_global_batch_must_divide_by_replicas():
    with pytest.raises(ValueError, match="does not divide by the 3 replicas"):
        pipeline.make_train(_indexed(20), _context(replicas=3), 8, augment.identity,
                            _identity_normalize, shuffle_buffer=0)


def test_augmentation_only_on_training():
    eval_ds = pipeline.make_eval(_indexed(10), 10, _context(), 4, _identity_normalize)
    for images, labels, mask in eval_ds:
        for image, label, m in zip(images.numpy(), labels.numpy(), mask.numpy()):
            if m:  # real examples come back exactly as they went in
                assert np.all(image == label % 256)
    train_ds = pipeline.make_train(_indexed(64), _context(), 64, augment.pad_crop_flip,
                                   _identity_normalize, shuffle_buffer=0)
    images, labels = next(iter(train_ds))
    padded = [np.any(img == 0) for img, lab in zip(images.numpy(), labels.numpy())
              if lab % 256]
    assert any(padded)  # crops reach into the zero padding


def test_train_shards_are_disjoint_and_cover_the_data():
    seen = []
    for pipeline_id in range(2):
        ds = pipeline.make_train(_indexed(40), _context(2, pipeline_id, 2), 4,
                                 augment.identity, _identity_normalize, shuffle_buffer=40)
        labels = np.concatenate([lab.numpy() for _, lab in ds.take(10)])
        seen.append(set(labels.tolist()))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(40))


@pytest.mark.parametrize("n,batch,pipelines", [(37, 8, 1), (37, 8, 2), (10, 4, 2),
                                               (5, 16, 1), (64, 16, 2)])
def test_eval_counts_every_example_exactly_once(n, batch, pipelines):
    counted = []
    steps = set()
    for pipeline_id in range(pipelines):
        ds = pipeline.make_eval(_indexed(n), n, _context(pipelines, pipeline_id, pipelines),
                                batch, _identity_normalize)
        batches = list(ds)
        steps.add(len(batches))
        for _, labels, mask in batches:
            counted += labels.numpy()[mask.numpy() == 1].tolist()
            assert labels.shape[0] == batch // pipelines  # static, full batches
    assert sorted(counted) == list(range(n))
    assert steps == {pipeline.eval_steps(n, batch)}  # every worker runs as many steps


def test_synthetic_data_is_deterministic_and_labelled():
    spec = sources.get_spec("synthetic")
    ds, n = sources.load(spec, spec.train_split)
    assert n == spec.synthetic_sizes[0]
    first = [(i.numpy(), lab.numpy()) for i, lab in ds.take(3)]
    again = [(i.numpy(), lab.numpy()) for i, lab in ds.take(3)]
    for (a, la), (b, lb) in zip(first, again):
        np.testing.assert_array_equal(a, b)
        assert la == lb and 0 <= la < spec.num_classes
    assert first[0][0].shape == spec.image_shape and first[0][0].dtype == np.uint8


def test_unknown_dataset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: cifar10, synthetic, tf_flowers"):
        sources.get_spec("imagenet")


def test_missing_tfds_data_is_a_one_line_error(tmp_path):
    with pytest.raises(sources.DatasetError) as err:
        sources.load_tfds("cifar10", "train", data_dir=str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "cifar10" in message and "--data_dir" in message
    assert str(tmp_path) in message


def test_holdout_split_is_disjoint_stable_and_complete():
    ds = _indexed(200).map(lambda image, label: (image, label, tf.cast(label, tf.int64)))
    held, n_held = sources.holdout(ds, 200, 0.15, validation=True)
    rest, n_rest = sources.holdout(ds, 200, 0.15, validation=False)
    held_labels = [int(label) for _, label in held]
    rest_labels = [int(label) for _, label in rest]
    assert n_held == len(held_labels) and n_rest == len(rest_labels)
    assert not set(held_labels) & set(rest_labels)
    assert sorted(held_labels + rest_labels) == list(range(200))
    assert 20 <= n_held <= 40  # about 15%
    again = [int(label) for _, label in sources.holdout(ds, 200, 0.15, True)[0]]
    assert again == held_labels


def test_tf_flowers_validation_split_sizes():
    spec = sources.get_spec("tf_flowers")
    assert sources.in_holdout(np.arange(3670, dtype=np.int64), 0.15).sum() == 551
    assert spec.num_classes == 5 and spec.eval_split == "validation"


def test_flip_saturation_keeps_grey_pixels_and_shape():
    grey = tf.fill((4, 6, 6, 3), tf.constant(100, tf.uint8))
    out, _ = augment.flip_saturation(grey, tf.zeros(4, tf.int32), SEED)
    np.testing.assert_array_equal(out.numpy(), grey.numpy())  # no colour to scale
    colour = tf.cast(tf.random.uniform((64, 6, 6, 3), 0, 255, tf.int32), tf.uint8)
    out, _ = augment.flip_saturation(colour, tf.zeros(64, tf.int32), SEED)
    assert out.dtype == tf.uint8 and out.shape == colour.shape
    assert not np.array_equal(out.numpy(), colour.numpy())


def test_resize_makes_any_image_square_uint8():
    image, label = augment.make_resize(24)(tf.zeros((50, 70, 3), tf.uint8), 3)
    assert image.shape == (24, 24, 3) and image.dtype == tf.uint8 and label == 3
