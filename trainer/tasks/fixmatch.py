"""FixMatch (Sohn et al. 2020): semi-supervised classification from a few labels.
Two input streams (`streams`): --labelled_examples labelled images (the first of
each class, the same number of each) at --batch_size, and the whole training split
unlabelled at --unlabelled_factor times that, each image as a weak view (flip and
translation) and a strong one (RandAugment and Cutout, data/augment.py
`strong_view`). One step (`train_step`, the default step's pieces):

1. one forward pass, in training mode, over the labelled weak views and the
   unlabelled weak and strong views (batch-norm sees them all at once, as
   FixMatch's own code);
2. the loss: cross-entropy on the labelled images, plus --unlabelled_weight times
   the cross-entropy of each strong view against its weak view's predicted class
   (no gradient through the prediction), where that prediction's probability is
   at least --threshold;
3. THE all-reduce and one update (step.train_step with this objective: clipping,
   SAM, Lookahead and the run's precision work as for any task).

The per-example losses are laid out so that the step's division by the GLOBAL
batch (the labelled one) gives FixMatch's loss: mean over the B labelled images
plus weight x mean over the 7B unlabelled ones. Evaluation, predict and export are
classification's. `pseudo_accuracy` (the confident pseudo-labels' accuracy, read
from the labels the unlabelled stream still carries) is for monitoring only.

    python -m trainer.main --task=fixmatch --model=airbench_small
"""
import dataclasses

import tensorflow as tf

from data import augment
from trainer import step
from trainer.inputs import Stream
from trainer.settings import check_range, setting
from trainer.tasks import base, classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    labelled_examples: int = setting(4000, "fixmatch: labelled training examples, the "
                                     "first of each class in the split's order, the "
                                     "same number of each.")
    unlabelled_factor: int = setting(7, "fixmatch: unlabelled images per labelled one "
                                     "in a step (mu).")
    threshold: float = setting(0.95, "fixmatch: the confidence a weak view's "
                               "prediction needs to be a strong view's target.")
    unlabelled_weight: float = setting(1.0, "fixmatch: the weight of the unlabelled "
                                       "loss (lambda_u).")

    def __post_init__(self):
        super().__post_init__()
        check_range("labelled_examples", self.labelled_examples, 1)
        check_range("unlabelled_factor", self.unlabelled_factor, 1)
        check_range("threshold", self.threshold, 0, 1)
        check_range("unlabelled_weight", self.unlabelled_weight, 0)


@base.register
class FixMatch(classification.Classification):
    name = "fixmatch"
    Settings = Settings
    # The default step's settings it carries out (its batch is two streams: no
    # micro-batches).
    step_settings = tuple(name for name in step.SETTINGS if name != "grad_accum_steps")
    # FixMatch's CIFAR-10 settings (SGD-Nesterov 0.03, decay 5e-4, cosine, an EMA
    # of the weights, B = 64), on a model that trains fast here; the model's own
    # recipe's speed-run tricks (airbench's) are turned off: they are not FixMatch's.
    recipe = dict(model="airbench_small", dataset="cifar10", batch_size=64,
                  optimizer="sgd", momentum=0.9, learning_rate=0.03, weight_decay=5e-4,
                  lr_schedule="cosine", warmup_epochs=0.0, min_learning_rate=0.0,
                  warmup_start_factor=0.0, ema_decay=0.999, augment="translate_flip",
                  alternating_flip=False, lr_multipliers="", freeze_after_epochs="",
                  decay_vectors=False, lookahead_every=0, label_smoothing=0.0,
                  tta_flip=False, tta_translate=False, epochs=10)

    def streams(self) -> dict[str, Stream]:
        settings = self.settings
        return {"labelled": Stream(examples=f"balanced:{settings.labelled_examples}"),
                "unlabelled": Stream(batch_factor=settings.unlabelled_factor,
                                     make_batch=self.weak_and_strong)}

    @staticmethod
    def weak_and_strong(images, labels, key, standard, normalize) -> dict:
        """Two views of every unlabelled image, each from its own half of the key:
        the run's standard (weak) augmentation and FixMatch's strong view."""
        weak_key, strong_key = augment._seeds(key, 2)  # noqa: SLF001
        weak = standard(images, labels, weak_key)
        strong, _ = normalize(augment.strong_view(images, strong_key), labels)
        return {"weak": weak["image"], "strong": strong,
                "label": tf.cast(labels, tf.int32)}  # (monitoring only)

    def train_step(self, state, batch: dict, options) -> dict[str, base.Metric]:
        model = state.models["main"]
        settings = self.settings
        factor = float(settings.unlabelled_factor)

        def fixmatch_loss(both):
            labelled, unlabelled = both["labelled"], both["unlabelled"]
            count = tf.shape(labelled["image"])[0]
            unlabelled_count = tf.shape(unlabelled["weak"])[0]
            logits = classification.logits_of(model(tf.concat(
                [labelled["image"], unlabelled["weak"], unlabelled["strong"]], 0),
                training=True))
            supervised_logits, weak_logits, strong_logits = tf.split(
                logits, [count, unlabelled_count, unlabelled_count])
            supervised = classification.objective(labelled["label"], supervised_logits,
                                                  settings.label_smoothing)
            guess = tf.nn.softmax(tf.stop_gradient(weak_logits))
            confident = tf.cast(tf.reduce_max(guess, -1) >= settings.threshold,
                                logits.dtype)
            pseudo = tf.argmax(guess, -1, output_type=tf.int32)
            unsupervised = classification.objective(pseudo, strong_logits) * confident
            # The step divides by the GLOBAL labelled batch B: the unlabelled terms,
            # 7B of them, count 1/7 each, so the sum is FixMatch's two means.
            per_example = tf.concat(
                [supervised, unsupervised * (settings.unlabelled_weight / factor)], 0)
            hits = tf.cast(tf.equal(pseudo, unlabelled["label"]), logits.dtype) * confident
            seen = tf.cast(unlabelled_count, logits.dtype)
            return per_example, {
                "supervised_loss": (tf.reduce_sum(supervised),
                                    tf.cast(count, logits.dtype)),
                "accuracy": (tf.reduce_sum(tf.cast(tf.equal(tf.argmax(
                    supervised_logits, -1, output_type=tf.int32), labelled["label"]),
                    logits.dtype)), tf.cast(count, logits.dtype)),
                "unlabelled_loss": (tf.reduce_sum(unsupervised), seen),
                "confident": (tf.reduce_sum(confident), seen),
                "pseudo_accuracy": (tf.reduce_sum(hits), tf.reduce_sum(confident))}

        objective = step.Objective(fixmatch_loss, model.trainable_variables, (model,),
                                   state.optimizers["main"], "task fixmatch's loss")
        metrics = step.train_step(state, self, batch, objective=objective, options=options)
        # "loss": FixMatch's loss per labelled image (its weight counted the 1 + 7
        # terms of each labelled image's share).
        total, weight = metrics["loss"]
        return {**metrics, "loss": (total, weight / (1.0 + factor))}

    def training_flops(self, state, forward, options) -> float:
        """Per labelled image: forward and backward over it and its 2 x factor
        unlabelled views."""
        return 3.0 * forward(state.models["main"]) * (
            1 + 2 * self.settings.unlabelled_factor)
