"""Phased fine-tuning: first the head alone on a frozen backbone (its batch-norm in
inference mode), then the whole network, the backbone at a tenth of the head's
learning rate. Two steps on a schedule of phases (`train_steps`), two optimizers
over parts of one model (`build.optimizer(model, variables=...,
learning_rate=...)`), and what the head phase must not change declared to
check_step (`frozen`).

One task file. Copy it into trainer/tasks/ (every module there is a task), or
`--import` the package holding it (docs/own-code.md), then:

    python -m trainer.check_step --task=phased_finetune --model=cifar_cnn --model_size=tiny --dataset=synthetic --batch_size=64
    python -m trainer.main --task=phased_finetune --model=cifar_cnn --weights=runs/cifar_cnn/model.weights.h5

check_step checks each phase (from its first step): on 1 and 2 replicas, and that
no backbone variable (weights or batch-norm statistics) changes in a head step.
"""
import dataclasses

import keras
import tensorflow as tf

import models
from trainer import step
from trainer.settings import ConfigError, check_range, setting
from trainer.tasks import base, classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    head_epochs: float = setting(1.0, "phased_finetune: epochs of the head alone.")
    backbone_lr_factor: float = setting(0.1, "phased_finetune: the backbone's peak "
                                        "learning rate over the head's.")

    def __post_init__(self):
        super().__post_init__()
        check_range("head_epochs", self.head_epochs, 0, low_open=True)
        check_range("backbone_lr_factor", self.backbone_lr_factor, 0, low_open=True)


def head_layer(model: keras.Model) -> keras.layers.Layer:
    """The classifier's head: its Dense layer named "logits" (the built-in
    classifiers'; what models.features_of takes the features before)."""
    named = {layer.name: layer for layer in model.layers}
    if not isinstance(named.get("logits"), keras.layers.Dense):
        raise ConfigError(f"phased_finetune needs a model whose head is a Dense layer "
                          f"named 'logits'; {model.name} has none")
    return named["logits"]


@base.register
class PhasedFinetune(classification.Classification):
    name = "phased_finetune"
    Settings = Settings
    step_settings = ()  # its steps carry out none of the default step's settings

    def create_state(self, build):
        model = build.model()                                   # --model, --weights
        head = head_layer(model).trainable_variables
        backbone = [v for v in model.trainable_variables if not any(v is h for h in head)]
        self.features = models.features_of(model)               # (shares the weights)
        self.head = head_layer(model)
        optimizers = {"main": build.optimizer(model, variables=head)}  # the run's peak
        if build.training:  # the backbone's own optimizer, at a tenth of the peak
            optimizers["backbone"] = build.optimizer(
                model, variables=backbone,
                learning_rate=build.schedule.peak * self.settings.backbone_lr_factor)
        return build.state({"main": model}, optimizers)

    def train_steps(self, plan) -> step.Steps:
        # (called before the state exists: by check_step, by the log)
        head_steps = max(1, round(self.settings.head_epochs * plan.steps_per_epoch))
        return step.Steps((("head", self.head_step, head_steps),
                           ("whole", self.whole_step, 0)), repeat=False,
                          # in the head phase, nothing of the model but its head moves
                          frozen={"head": ("main/*", "!main/logits/*")})

    def head_step(self, state, batch, options):
        # The backbone in inference mode (its batch-norm statistics stay) and out of
        # the tape: only the head's gradient is taken, summed once, applied.
        features = tf.stop_gradient(self.features(batch["image"], training=False))
        objective = step.Objective(lambda b: self.loss(b, self.head(features)),
                                   self.head.trainable_variables, (state.models["main"],),
                                   state.optimizers["main"], "task phased_finetune's loss")
        return step.train_step(state, self, batch, options, objective)

    def whole_step(self, state, batch, options):
        model = state.models["main"]
        head, backbone = state.optimizers["main"], state.optimizers["backbone"]
        everything = step.supervised(state, self)  # the loss on all trainable weights
        gradients, sums = step.summed_gradients(everything, batch, options)  # THE sum
        norm = tf.linalg.global_norm(gradients)
        finite = tf.math.is_finite(norm)
        in_head = [any(v is h for h in self.head.trainable_variables)
                   for v in model.trainable_variables]
        for optimizer, wanted in ((head, True), (backbone, False)):
            pairs = [(g, v) for g, v, h in zip(gradients, model.trainable_variables, in_head)
                     if h == wanted]
            step.apply_or_skip(optimizer, [g for g, _ in pairs], [v for _, v in pairs],
                               finite)
        return {**sums, "grad_norm": step.per_step(norm),
                "skipped": step.per_step(1.0 - tf.cast(finite, tf.float32))}
