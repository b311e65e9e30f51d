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
    batch = next(iter(ds))
    assert sorted(batch) == ["image", "index", "label"]  # no "target" without a mix
    assert batch["image"].shape == (4, 8, 8, 3) and batch["image"].dtype == tf.float32
    assert batch["label"].shape == (4,) and batch["label"].dtype == tf.int32


def test_augmentation_is_a_pure_function_of_the_seed():
    images = tf.cast(tf.random.uniform((16, 8, 8, 3), 0, 255, tf.int32), tf.uint8)
    for name, fn in augment.TRAIN_AUGMENTATIONS.items():
        first, _ = fn(images, tf.zeros(16, tf.int32), SEED)
        again, _ = fn(images, tf.zeros(16, tf.int32), SEED)
        other, _ = fn(images, tf.zeros(16, tf.int32), SEED + 1)
        np.testing.assert_array_equal(first.numpy(), again.numpy())
        if name != "none":
            assert not np.array_equal(first.numpy(), other.numpy()), name


NUM_CLASSES = 40  # _indexed(40)'s labels are 0..39
BOTH_MIXES = augment.make_mix(NUM_CLASSES, mixup_alpha=0.4, cutmix_alpha=1.0)


def _float_batch(batch=8, height=6, width=10, seed=0):
    """Normalized-looking float images and distinct labels 0..batch-1."""
    images = tf.random.stateless_normal((batch, height, width, 3), (seed, 1))
    return images, tf.range(batch, dtype=tf.int32)


MIXES = {
    "mixup": lambda x, y, seed: augment.mixup(x, y, seed, 8, alpha=0.4),
    "cutmix": lambda x, y, seed: augment.cutmix(x, y, seed, 8, alpha=1.0),
    "both": lambda x, y, seed: augment.mix(x, y, seed, 8, mixup_alpha=0.4,
                                           cutmix_alpha=1.0),
}


@pytest.mark.parametrize("name", sorted(MIXES))
def test_mixes_give_targets_summing_to_one_as_a_pure_function_of_the_seed(name):
    images, labels = _float_batch()
    mix = MIXES[name]
    mixed, targets = mix(images, labels, SEED)
    assert mixed.shape == images.shape and mixed.dtype == tf.float32
    assert targets.shape == (8, 8) and targets.dtype == tf.float32
    assert np.all(targets.numpy() >= 0)
    np.testing.assert_allclose(targets.numpy().sum(-1), 1.0, rtol=1e-6)
    again_images, again_targets = mix(images, labels, SEED)
    np.testing.assert_array_equal(again_images.numpy(), mixed.numpy())
    np.testing.assert_array_equal(again_targets.numpy(), targets.numpy())
    for other in range(1, 4):
        other_images, other_targets = mix(images, labels, SEED + other)
        assert not np.array_equal(other_images.numpy(), mixed.numpy())
        assert not np.array_equal(other_targets.numpy(), targets.numpy())
    # Also inside tf.data (graph mode), as the pipeline runs it: the same numbers.
    mapped = tf.data.Dataset.from_tensors((images, labels)).map(
        lambda x, y: mix(x, y, SEED))
    np.testing.assert_array_equal(next(iter(mapped))[1].numpy(), targets.numpy())


def test_cutmix_target_weights_are_the_fractions_of_pasted_pixels():
    batch, height, width = 8, 12, 16
    # Image i is the constant i: each pixel says which image it came from.
    images = tf.broadcast_to(tf.range(batch, dtype=tf.float32)[:, None, None, None],
                             (batch, height, width, 3))
    labels = tf.range(batch, dtype=tf.int32)
    partial = boxes_inside = 0
    for offset in range(20):
        mixed, targets = augment.cutmix(images, labels, SEED + offset, batch, alpha=1.0)
        mixed, targets = mixed.numpy(), targets.numpy()
        pasted = mixed[..., 0] == (batch - 1 - np.arange(batch))[:, None, None]
        kept = mixed[..., 0] == np.arange(batch)[:, None, None]
        assert np.all(pasted | kept)  # every pixel is its own or its partner's
        assert np.all(pasted == pasted[0])  # one box for the whole batch
        rows, cols = np.nonzero(pasted[0])
        if rows.size:  # ... and it is a rectangle
            box_h, box_w = np.ptp(rows) + 1, np.ptp(cols) + 1
            assert rows.size == box_h * box_w
            inside = rows.min() > 0 and cols.min() > 0 and rows.max() < height - 1 and (
                cols.max() < width - 1)
            if inside:  # unclipped: the image scaled by sqrt(1 - lam), both sides alike
                assert abs(box_h / height - box_w / width) <= 1 / height + 1 / width
                boxes_inside += 1
        fraction = pasted[0].mean()
        for i in range(batch):
            np.testing.assert_allclose(targets[i, batch - 1 - i], fraction, atol=1e-6)
            np.testing.assert_allclose(targets[i, i], 1 - fraction, atol=1e-6)
        partial += 0 < fraction < 1
    assert partial >= 15 and boxes_inside >= 3  # real boxes, not all or nothing


def test_mixup_images_are_convex_combinations_of_the_reversed_pair():
    images, labels = _float_batch()
    lams = set()
    for offset in range(5):
        mixed, targets = augment.mixup(images, labels, SEED + offset, 8, alpha=0.4)
        lam = targets.numpy()[np.arange(8), labels.numpy()]
        np.testing.assert_allclose(lam, lam[0], rtol=1e-6)  # one lam per batch
        assert 0 < lam[0] < 1
        np.testing.assert_allclose(targets.numpy()[np.arange(8), 7 - labels.numpy()],
                                   1 - lam[0], rtol=1e-5)
        expected = lam[0] * images.numpy() + (1 - lam[0]) * images.numpy()[::-1]
        np.testing.assert_allclose(mixed.numpy(), expected, rtol=1e-5, atol=1e-5)
        lams.add(round(float(lam[0]), 5))
    assert len(lams) == 5


def test_mix_picks_mixup_or_cutmix_per_batch_and_without_alphas_only_one_hot():
    images, labels = _float_batch()
    picked = set()
    for offset in range(16):
        mixed, _ = augment.mix(images, labels, SEED + offset, 8, mixup_alpha=0.4,
                               cutmix_alpha=1.0)
        own = np.isclose(mixed.numpy(), images.numpy())
        partner = np.isclose(mixed.numpy(), images.numpy()[::-1])
        picked.add("cutmix" if np.all(own | partner) else "mixup")
    assert picked == {"mixup", "cutmix"}
    same, one_hot = augment.mix(images, labels, SEED, 8)
    np.testing.assert_array_equal(same.numpy(), images.numpy())
    np.testing.assert_array_equal(one_hot.numpy(), np.eye(8, dtype=np.float32))
    only_cutmix, _ = augment.mix(images, labels, SEED, 8, cutmix_alpha=1.0)
    np.testing.assert_array_equal(
        only_cutmix.numpy(), augment.cutmix(images, labels, SEED, 8, 1.0)[0].numpy())
    assert augment.make_mix(8) is None  # no mix: the pipeline keeps its old stream
    with pytest.raises(ValueError, match="must be >= 0"):
        augment.make_mix(8, mixup_alpha=-0.1)


def _stream(start_step, n=40, global_batch=8, replicas=1, seed=3, steps=12, mix=None):
    """{"image", "label"(, "target")} of `steps` training steps from `start_step` on,
    each stacked over the batches."""
    ds = pipeline.make_train(_indexed(n).filter(lambda x, y: True), _context(replicas=replicas),
                             global_batch, augment.pad_crop_flip, _identity_normalize,
                             shuffle_buffer=16, seed=seed, start_step=start_step, mix=mix)
    batches = list(ds.take(steps * replicas))
    return {key: np.stack([b[key].numpy() for b in batches]) for key in batches[0]}


@pytest.mark.parametrize("mix", [None, BOTH_MIXES], ids=["no_mix", "mix"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_train_stream_resumes_exactly_at_any_step(replicas, mix):
    stream = _stream(0, replicas=replicas, mix=mix)
    assert ("target" in stream) == (mix is not None)
    for start in (1, 5, 7):  # 5 steps per epoch: mid-epoch and epoch boundaries
        resumed = _stream(start, replicas=replicas, mix=mix)
        longer = _stream(0, replicas=replicas, steps=12 + start, mix=mix)
        np.testing.assert_array_equal(resumed["label"], longer["label"][start * replicas:])
        for key in resumed:  # images (augmented, mixed) and targets: bitwise the same
            np.testing.assert_array_equal(resumed[key][: (12 - start) * replicas],
                                          stream[key][start * replicas:])
    # Each epoch is a permutation (minus the dropped remainder), and epochs differ.
    labels = stream["label"]
    epochs = labels[: 10 * replicas].reshape(2, -1)
    assert all(len(set(e.tolist())) == len(e) for e in epochs)
    assert epochs[0].tolist() != epochs[1].tolist()
    assert not np.array_equal(_stream(0, seed=4, replicas=replicas)["label"], labels)


def test_train_stream_with_a_mix_has_soft_targets_that_vary_per_batch():
    stream = _stream(0, mix=BOTH_MIXES)
    targets, labels = stream["target"], stream["label"]
    assert targets.shape == labels.shape + (NUM_CLASSES,) and targets.dtype == np.float32
    np.testing.assert_allclose(targets.sum(-1), 1.0, rtol=1e-6)
    # The label keeps the largest share only if lam >= 1/2; each batch draws its own lam.
    own_share = np.take_along_axis(targets, labels[..., None], -1)[..., 0]
    assert len({round(float(share), 4) for share in own_share[:, 0]}) > 6
    assert np.all((own_share > 0) & (own_share < 1))  # every batch actually mixed


def test_augmentation_only_on_training():
    eval_ds = pipeline.make_eval(_indexed(10), 10, _context(), 4, _identity_normalize)
    for batch in eval_ds:
        for image, label, m in zip(*(batch[key].numpy() for key in ("image", "label", "mask"))):
            if m:  # real examples come back exactly as they went in
                assert np.all(image == label % 256)
    train_ds = pipeline.make_train(_indexed(64), _context(), 64, augment.pad_crop_flip,
                                   _identity_normalize, shuffle_buffer=0)
    batch = next(iter(train_ds))
    images, labels = batch["image"], batch["label"]
    padded = [np.any(img == 0) for img, lab in zip(images.numpy(), labels.numpy())
              if lab % 256]
    assert any(padded)  # crops reach into the zero padding


def test_train_shards_are_disjoint_and_cover_the_data():
    seen = []
    for pipeline_id in range(2):
        ds = pipeline.make_train(_indexed(40), _context(2, pipeline_id, 2), 4,
                                 augment.identity, _identity_normalize, shuffle_buffer=40)
        labels = np.concatenate([batch["label"].numpy() for batch in ds.take(10)])
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
        for element in batches:
            assert sorted(element) == ["image", "index", "label", "mask"]
            labels, mask = element["label"].numpy(), element["mask"].numpy()
            assert element["mask"].dtype == tf.float32 and element["label"].dtype == tf.int32
            counted += labels[mask == 1].tolist()
            assert set(mask.tolist()) <= {0.0, 1.0}
            assert not element["image"].numpy()[mask == 0].any()  # padding is blank
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
    with pytest.raises(sources.DatasetError,
                       match="not one of cifar10, synthetic, tf_flowers.*not a TFDS"):
        sources.get_spec("imagenet")  # (TFDS' is imagenet2012)


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


def test_a_split_is_counted_from_the_description_as_loading_counts_it(tmp_path):
    """sources.count (start-up: no dataset built) gives load's count, for a whole
    split, a held-out one and its rest, a sub-split and generated data; data that
    is not there is load's one-line error."""
    import os
    if not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR") or "", "cifar10")):
        pytest.skip("the prepared TFDS data dir is not in TFDS_DATA_DIR")
    cases = [(sources.get_spec("cifar10"), "train"), (sources.get_spec("cifar10"), "test"),
             (sources.get_spec("cifar10", eval_split="train[:10%]"), "train[:10%]"),
             (sources.get_spec("tf_flowers"), "train"),
             (sources.get_spec("tf_flowers"), "validation"),
             (sources.get_spec("synthetic"), "train")]
    for spec, split in cases:
        assert sources.count(spec, split) == sources.load(spec, split)[1], (spec.name, split)
    assert sources.count(sources.get_spec("tf_flowers"), "validation") == 551
    with pytest.raises(sources.DatasetError) as err:
        sources.count(sources.get_spec("cifar10"), "train", data_dir=str(tmp_path))
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


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
