"""The reference we must beat: the seed recipe trained with Keras `model.fit`.

    python -m trainer.tools.fit_baseline --epochs=3 [--precision=float32] [--batch_size=1024]

Same model, data (TFDS CIFAR-10, normalized, no augmentation as in the seed), global
batch and precision as a user of the founding codelab would run it. Prints the
training time per epoch, images/sec and test accuracy, to compare with
`python -m trainer.main` run beside it (timings on a shared machine drift).
"""
import json
import sys
import time

from trainer import cli  # noqa: E402

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import augment, sources  # noqa: E402
import models  # noqa: E402

FLAGS = flags.FLAGS


class _EpochTimer(keras.callbacks.Callback):
    """Training seconds per epoch; the validation pass is not counted."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.train_end = time.perf_counter(), None

    def on_test_begin(self, logs=None):
        self.train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs["epoch_seconds"] = (self.train_end or time.perf_counter()) - self.start


def _dataset(spec, split, batch_size, data_dir, train):
    ds, n = sources.load(spec, split, data_dir)
    ds = ds.cache()
    if train:
        ds = ds.shuffle(10_000)
    normalize = augment.make_normalize(spec.mean, spec.std)
    return ds.batch(batch_size).map(normalize).prefetch(tf.data.AUTOTUNE), n


def run(epochs: int, batch_size: int, precision: str, data_dir: str | None) -> dict:
    keras.mixed_precision.set_global_policy(precision)
    spec = sources.get_spec("cifar10")
    train, n_train = _dataset(spec, spec.train_split, batch_size, data_dir, train=True)
    test, _ = _dataset(spec, spec.eval_split, batch_size, data_dir, train=False)
    model = models.build("cifar_cnn", spec.num_classes, spec.image_shape)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])
    history = model.fit(train, epochs=epochs, validation_data=test,
                        callbacks=[_EpochTimer()], verbose=2)
    seconds = history.history["epoch_seconds"]
    return {"epochs": epochs, "precision": precision, "batch_size": batch_size,
            "epoch_seconds": seconds, "train_seconds": sum(seconds),
            # Epoch 1 includes tracing and the first read of the data; later ones don't.
            "images_per_second_after_first_epoch": (
                n_train * (epochs - 1) / sum(seconds[1:]) if epochs > 1 else None),
            "test_accuracy": history.history["val_sparse_categorical_accuracy"][-1]}


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """fit_baseline's flags (defining twice is a no-op). All four share their names
    with trainer.main's: run this command on its own, not in a process that defined
    those first (theirs, with other defaults, would be used)."""
    cli.define_flag(flag_values, flags.DEFINE_integer, "epochs", 3, "Epochs to train.",
                    lower_bound=1)
    cli.define_flag(flag_values, flags.DEFINE_integer, "batch_size", 1024, "Global batch "
                    "size.", lower_bound=1)
    cli.define_flag(flag_values, flags.DEFINE_enum, "precision", "float32",
                    "Keras mixed-precision policy.",
                    enum_values=["float32", "mixed_bfloat16", "mixed_float16"])
    cli.define_flag(flag_values, flags.DEFINE_string, "data_dir", None, "TFDS data dir; "
                    "default: $TFDS_DATA_DIR, else the TFDS default.")


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    try:
        result = run(FLAGS.epochs, FLAGS.batch_size, FLAGS.precision, FLAGS.data_dir)
    except sources.DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
