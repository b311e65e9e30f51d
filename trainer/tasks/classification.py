"""Classification: cross-entropy against the label (or soft targets), accuracy,
a confusion matrix, the class probabilities when serving. The default task.

`objective` is THE loss: change it (e.g. to a focal loss) and training, the test
loss and check_step follow; docs/changing-the-step.md shows the focal loss as a
worked example. Label smoothing and mixup/CutMix change the training targets only,
so the test loss stays the objective on the true labels.
"""
import dataclasses

import keras
import tensorflow as tf

import models
from trainer.output import figures
from trainer.settings import ConfigError, check_range, setting
from trainer.tasks import base

MAX_CONFUSION_CLASSES = 100  # beyond this a confusion picture is unreadable anyway


@dataclasses.dataclass(frozen=True)
class Settings:
    label_smoothing: float = setting(0.0, "Mix the one-hot target with uniform by this "
                                     "weight (0: off).")
    aux_loss_weight: float = setting(0.3, "Weight of the loss on a model's `aux_logits` "
                                     "output, if it has one.")
    tta_flip: bool = setting(False, "Evaluate on each test image and its mirror image, "
                             "averaging the logits.")
    tta_translate: bool = setting(False, "Also evaluate on the image shifted one pixel "
                                  "up-left and down-right (reflect-padded; with "
                                  "--tta_flip, airbench's 6-view multi-crop), half the "
                                  "weight to the shifted views.")

    def __post_init__(self):
        check_range("label_smoothing", self.label_smoothing, 0, 1, high_open=True)
        check_range("aux_loss_weight", self.aux_loss_weight, 0)


def logits_of(outputs) -> tf.Tensor:
    """The main head's logits, in float32 at least (float64 stays), whatever the
    model returns."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
    return logits if logits.dtype == tf.float64 else tf.cast(logits, tf.float32)


def objective(targets: tf.Tensor, logits: tf.Tensor, smoothing: float = 0.0) -> tf.Tensor:
    """Per-example cross-entropy: targets are int labels [B] or soft targets
    [B, classes] (smoothed towards uniform by `smoothing`)."""
    if targets.dtype.is_integer:
        return keras.losses.sparse_categorical_crossentropy(targets, logits,
                                                            from_logits=True)
    return keras.losses.categorical_crossentropy(tf.cast(targets, logits.dtype), logits,
                                                 from_logits=True,
                                                 label_smoothing=smoothing)


def hits(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """1.0 where the top class is the label."""
    return tf.cast(tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels),
                   tf.float32)


class ClassificationPresenter(base.Presenter):
    """The class probabilities when serving; predict's top classes; pictures of
    the sample predictions and the confusion matrix."""

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.spec.class_names or tuple(str(i) for i in range(self.spec.num_classes))

    def check_data(self, spec) -> None:
        if spec.num_classes != self.spec.num_classes:
            raise ConfigError(f"{spec.name} has {spec.num_classes} classes but the model "
                              f"was trained on {self.spec.name} ({self.spec.num_classes}); "
                              f"pick a matching --dataset")

    def serve(self, logits: tf.Tensor) -> dict[str, tf.Tensor]:
        probabilities = tf.nn.softmax(tf.cast(logits, tf.float32))
        index = tf.argmax(probabilities, axis=-1)
        return {"probabilities": probabilities, "class_index": index,
                "class_name": tf.gather(tf.constant(list(self.class_names)), index)}

    def report(self, served: dict, title: str, image, example: dict | None,
               output_stem: str, top: int = 5) -> list[str]:
        """The top classes with their names and probabilities."""
        if example is not None and "label" in example:
            title += f", true class: {self.class_names[int(example['label'])]}"
        probabilities = served["probabilities"]
        order = probabilities.argsort()[::-1][:min(top, len(self.class_names))]
        width = max(len(self.class_names[i]) for i in order)
        return [title, *(f"  {rank}. {self.class_names[i]:<{width}}  "
                         f"{100 * probabilities[i]:6.2f}%"
                         for rank, i in enumerate(order, 1))]

    def draw_samples(self, figure, samples: dict) -> None:
        """Tiles titled 'predicted (p%)', green if right, red if wrong, with the
        true class under the wrong ones."""
        titles, colors = [], []
        for label, predicted, probabilities in zip(
                samples["label"], samples["class_index"], samples["probabilities"]):
            right = int(label) == int(predicted)
            title = (f"{figures.name_of(self.class_names, predicted)} "
                     f"({100 * probabilities.max():.0f}%)")
            titles.append(title if right else
                          f"{title}\ntrue: {figures.name_of(self.class_names, label)}")
            colors.append(figures.RIGHT if right else figures.WRONG)
        figures.image_grid(figure, samples["image"], titles, colors)

    def pictures(self, samples: dict | None, details: dict, title: str) -> dict:
        pictures = super().pictures(samples, details, title)
        if "confusion_matrix" in details:
            pictures["confusion_matrix"] = figures.confusion(
                details["confusion_matrix"], self.class_names, title=title)
        return pictures


@base.register
class Classification(base.Task):
    name = "classification"
    Settings = Settings
    batch_keys = ("image", "label", "target")  # "target": trains on mixed soft targets
    model_outputs = (models.LOGITS, models.HEADS)
    best = base.Best("accuracy", higher_is_better=True)
    presenter = ClassificationPresenter

    def loss(self, batch: dict, outputs) -> tuple[tf.Tensor, dict[str, base.Metric]]:
        """The objective against the targets (soft targets if the batch has them,
        else the labels, one-hot when smoothed), plus the weighted loss of an
        auxiliary head if the model has one; accuracy against the hard label (also
        under mixup)."""
        logits = logits_of(outputs)
        targets, smoothing = batch.get("target"), self.settings.label_smoothing
        if targets is None:
            targets = (tf.one_hot(batch["label"], tf.shape(logits)[-1]) if smoothing
                       else batch["label"])
        loss = objective(targets, logits, smoothing)
        if isinstance(outputs, dict) and "aux_logits" in outputs:
            loss += self.settings.aux_loss_weight * objective(
                targets, logits_of({"logits": outputs["aux_logits"]}), smoothing)
        return loss, self.accuracy(logits, batch["label"])

    @staticmethod
    def accuracy(logits: tf.Tensor, labels: tf.Tensor) -> dict[str, base.Metric]:
        correct = hits(logits, labels)
        return {"accuracy": (tf.reduce_sum(correct), tf.reduce_sum(tf.ones_like(correct)))}

    def predict(self, model: keras.Model, images: tf.Tensor) -> tf.Tensor:
        """Logits of the main head; with --tta_flip averaged with the mirror
        image's; with --tta_translate too, airbench's multi-crop: half that, half
        the mean of the same for the image shifted one pixel up-left and down-right
        (reflect-padded)."""
        def flip_averaged(images):
            logits = logits_of(model(images, training=False))
            if self.settings.tta_flip:
                logits = (logits + logits_of(model(tf.reverse(images, axis=[2]),
                                                   training=False))) / 2
            return logits

        logits = flip_averaged(images)
        if self.settings.tta_translate:
            height, width = tf.shape(images)[1], tf.shape(images)[2]  # (serving: any size)
            padded = tf.pad(images, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
            shifted = [padded[:, :height, :width], padded[:, 2:height + 2, 2:width + 2]]
            logits = 0.5 * logits + 0.25 * (flip_averaged(shifted[0])
                                            + flip_averaged(shifted[1]))
        return logits

    def eval_metrics(self, batch: dict, logits: tf.Tensor, weights: tf.Tensor
                     ) -> dict[str, base.Metric]:
        """Loss (the objective on the true labels) and accuracy; a confusion matrix
        (counts [true, predicted]) for up to MAX_CONFUSION_CLASSES classes."""
        labels = batch["label"]
        per_example_loss = objective(labels, logits)
        count = tf.reduce_sum(weights)
        weights = tf.cast(weights, per_example_loss.dtype)
        metrics = {"loss": (tf.reduce_sum(per_example_loss * weights), count),
                   "accuracy": (tf.reduce_sum(hits(logits, labels)
                                              * tf.cast(weights, tf.float32)), count)}
        classes = self.spec.num_classes
        if classes <= MAX_CONFUSION_CLASSES:
            metrics["confusion_matrix"] = (tf.math.confusion_matrix(
                labels, tf.argmax(logits, -1, output_type=labels.dtype),
                classes, weights=tf.cast(weights, tf.float32),
                dtype=tf.float32), count)
        return metrics
