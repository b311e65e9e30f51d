"""Adversarial training (Madry et al. 2018): each step trains on the batch attacked
by projected gradient descent (PGD) within an L-infinity ball of --epsilon pixels;
evaluation reports the accuracy on attacked test images beside the clean one.

One task file. Copy it into trainer/tasks/ (every module there is a task), then:

    python -m trainer.check_step --task=adversarial --model=cifar_cnn --model_size=tiny --dataset=synthetic --batch_size=64
    python -m trainer.main --task=adversarial --model=resnet

The attack's random start is drawn per example from the step's seed
(trainer/randomness.py), so 1 and 2 replicas attack alike and a resume attacks as
the uninterrupted run would. The attack runs the model in inference mode: its
batch-norm statistics move once a step, in the training pass, not once per attack
step (check_step reports a model that moves them more often).
"""
import dataclasses

import tensorflow as tf

from trainer import randomness, step
from trainer.settings import check_range, setting
from trainer.tasks import base, classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    epsilon: float = setting(8 / 255, "adversarial: the attack's L-infinity radius, "
                             "in pixels of [0, 1].")
    attack_steps: int = setting(3, "adversarial: PGD steps per training step.")
    attack_step_size: float = setting(2 / 255, "adversarial: each PGD step's size, in "
                                      "pixels of [0, 1].")

    def __post_init__(self):
        super().__post_init__()
        check_range("epsilon", self.epsilon, 0)
        check_range("attack_steps", self.attack_steps, 1)
        check_range("attack_step_size", self.attack_step_size, 0)


@base.register
class Adversarial(classification.Classification):
    name = "adversarial"
    Settings = Settings
    best = base.Best("robust_accuracy", higher_is_better=True)

    def random_start(self, state, batch, radius):
        """Each example's start in the ball, from (--seed, the step, its index)."""
        images = batch["image"]
        return radius * randomness.per_example_uniform(
            state, batch, "pgd start", images.shape[1:], -1.0, 1.0, images.dtype)

    def attack(self, state, model, batch) -> tf.Tensor:
        """PGD on the model's inputs (normalized: the radius is epsilon / std per
        channel), the model in inference mode; a stopped tensor."""
        images, labels = batch["image"], batch["label"]
        std = tf.constant(self.spec.std, images.dtype)
        mean = tf.constant(self.spec.mean, images.dtype)
        radius, size = self.settings.epsilon / std, self.settings.attack_step_size / std
        low, high = (0.0 - mean) / std, (1.0 - mean) / std  # the valid pixels
        attacked = tf.clip_by_value(images + self.random_start(state, batch, radius),
                                    low, high)
        for _ in range(self.settings.attack_steps):
            with tf.GradientTape() as tape:
                tape.watch(attacked)
                logits = classification.logits_of(model(attacked, training=False))
                loss = tf.reduce_sum(classification.objective(labels, logits))
            attacked = attacked + size * tf.sign(tf.cast(tape.gradient(loss, attacked),
                                                         images.dtype))
            attacked = tf.clip_by_value(attacked, images - radius, images + radius)
            attacked = tf.clip_by_value(attacked, low, high)
        return tf.stop_gradient(attacked)

    step_settings = step.SETTINGS  # it runs the default step, all of them

    def train_step(self, state, batch, options):
        """The default step (trainer/step.py) on the attacked batch."""
        attacked = self.attack(state, state.models["main"], batch)
        return step.train_step(state, self, {**batch, "image": attacked}, options)

    def eval_step(self, state, batch):
        """Classification's metrics, and the accuracy on the attacked images."""
        metrics = super().eval_step(state, batch)
        model = state.models[self.output_model]
        attacked = self.attack(state, model, batch)
        right = classification.hits(self.predict(model, attacked), batch["label"])
        weights = tf.cast(batch["mask"], tf.float32)
        metrics["robust_accuracy"] = (tf.reduce_sum(right * weights),
                                      tf.reduce_sum(weights))
        return metrics

    def training_flops(self, state, forward, options) -> float:
        """The training step's, and per attack step a forward and a backward pass
        to the input (about 3 forward passes)."""
        return (super().training_flops(state, forward, options)
                + 3.0 * self.settings.attack_steps * forward(state.models["main"]))
