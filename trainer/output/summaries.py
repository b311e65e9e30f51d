"""TensorBoard event files in --model_dir/train and --model_dir/eval:
`tensorboard --logdir=MODEL_DIR` shows them.

train: every metric the training step returns (loss, accuracy, grad_norm, ...),
learning_rate and images_per_second, every --log_every steps. eval: every metric of
the evaluation (loss, accuracy, accuracy_raw with --ema_decay, ...) and the task's
pictures at each evaluation (classification: `predictions`, a grid of test images
with predicted and true labels, and `confusion_matrix`). Tags are the history keys
without their `train_` or `test_` prefix.
"""
import contextlib
import os
from typing import Iterator

import tensorflow as tf

from data import files
from trainer.output import figures

_NOT_SCALARS = ("step", "epoch", "train_seconds", "wall_seconds", "test_examples")


def _tags(record: dict, prefix: str) -> dict[str, str]:
    """{record key: TensorBoard tag} for every scalar of a history record."""
    return {key: key[len(prefix):] if key.startswith(prefix) else key
            for key, value in record.items()
            if key not in _NOT_SCALARS and isinstance(value, (int, float))}


@contextlib.contextmanager
def write_errors_explained(model_dir: str) -> Iterator[None]:
    """A full disk or a lost permission while writing summaries: files.WriteError,
    one line (exit 5)."""
    try:
        yield
    except tf.errors.OpError as err:
        reason = files.reason_of(err)
        raise files.WriteError(
            f"could not write the TensorBoard summaries in {model_dir} ({reason}); "
            f"{files.what_to_do(reason).replace('directory', '--model_dir')}") from err


def _png_image(fig) -> tf.Tensor:
    """A figure as a [1, H, W, 4] uint8 image batch for tf.summary.image, with a
    white strip below it 6% of its width high: TensorBoard's Images tab shows a
    picture about 320 pixels wide with a scroll bar across its bottom 12 or so,
    which hid the prediction grid's bottom row."""
    image = tf.image.decode_png(figures.png_bytes(fig, dpi=80), channels=4)
    strip = tf.fill([int(0.06 * int(image.shape[1])), image.shape[1], 4],
                    tf.constant(255, tf.uint8))
    return tf.concat([image, strip], axis=0)[None]


class Writer:
    """The run's summaries; a no-op on every worker but the chief."""

    def __init__(self, model_dir: str, enabled: bool = True):
        self._model_dir = model_dir
        with write_errors_explained(self._model_dir):
            self._writers = ({name: tf.summary.create_file_writer(
                os.path.join(model_dir, name)) for name in ("train", "eval")}
                if enabled else {})

    def train(self, record: dict) -> None:
        self._scalars("train", record, _tags(record, "train_"))

    @property
    def enabled(self) -> bool:
        return bool(self._writers)

    def eval(self, record: dict, pictures: dict | None = None) -> None:
        """record: the eval-history record; pictures: {tag: matplotlib Figure}."""
        self._scalars("eval", record, _tags(record, "test_"))
        if not self._writers:
            return
        with write_errors_explained(self._model_dir), \
                self._writers["eval"].as_default(step=record["step"]):
            for tag, figure in (pictures or {}).items():
                tf.summary.image(tag, _png_image(figure))
            self._writers["eval"].flush()

    def _scalars(self, name: str, record: dict, tags: dict[str, str]) -> None:
        if not self._writers:
            return
        with write_errors_explained(self._model_dir), \
                self._writers[name].as_default(step=record["step"]):
            for key, tag in tags.items():
                if key in record:
                    tf.summary.scalar(tag, record[key])
            self._writers[name].flush()

    def close(self) -> None:
        with write_errors_explained(self._model_dir):
            for writer in self._writers.values():
                writer.close()
