"""A task of my own: classification with a confidence penalty (Pereyra et al.
2017: the cross-entropy minus beta x the entropy of the prediction), with a step
of its own made of tfloop's pieces (trainer/step.py), and a setting of its own
(--penalty_beta)."""
import dataclasses

import keras
import tensorflow as tf

from trainer import step, tasks
from trainer.settings import check_range, setting
from trainer.tasks import classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    penalty_beta: float = setting(0.1, "confidence_penalty: the entropy's weight.")

    def __post_init__(self):
        super().__post_init__()
        check_range("penalty_beta", self.penalty_beta, 0)


@tasks.register
class ConfidencePenalty(classification.Classification):
    name = "confidence_penalty"
    Settings = Settings

    def train_step(self, state, batch, options):
        model = state.models["main"]

        def loss_fn(batch):  # per example; the step averages over the GLOBAL batch
            logits = model(batch["image"], training=True)
            cross_entropy = keras.losses.sparse_categorical_crossentropy(
                batch["label"], logits, from_logits=True)
            entropy = -tf.reduce_sum(tf.nn.softmax(logits) * tf.nn.log_softmax(logits), -1)
            return (cross_entropy - self.settings.penalty_beta * entropy,
                    {**self.accuracy(logits, batch["label"]),
                     "entropy": (tf.reduce_sum(entropy), tf.cast(tf.size(entropy),
                                                                 tf.float32))})

        # The default step with this objective: the all-reduce, clipping, the
        # finite check and the update, as every task's.
        return step.train_step(state, self, batch, options, step.Objective(
            loss_fn, model.trainable_variables, (model,), state.optimizers["main"]))
