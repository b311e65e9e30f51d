"""Knowledge distillation (Hinton et al. 2015): a student learns from the labels
and from a teacher, a finished run given by --teacher_dir.

    loss = alpha * CE(label) + (1 - alpha) * T^2 * KL(softmax(teacher / T) || softmax(student / T))

The teacher is rebuilt from its run_config.json and its final (or best) weights,
under the same strategy as the student, frozen and in inference mode (batch-norm's
moving statistics, no dropout); no gradient reaches it. It is part of the run's
state ("teacher"), so the checkpoint keeps it: a resume trains against the same
teacher even if its directory changed meanwhile. Evaluation, predict and export
are those of classification: the student alone.

    python -m trainer.main --task=distill --teacher_dir=runs/airbench_cifar10
"""
import dataclasses

import tensorflow as tf

from trainer.settings import ConfigError, check_range, setting
from trainer.tasks import base, classification

@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    teacher_dir: str = setting("", "distill: the teacher, a finished run's directory "
                               "(its run_config.json and weights).")
    teacher_weights: str = setting("final", "distill: the teacher's final|best weights "
                                   "(model.weights.h5 or best.weights.h5).")
    distill_alpha: float = setting(0.5, "distill: weight of the cross-entropy on the "
                                   "labels; 1 - alpha goes to matching the teacher.")
    distill_temperature: float = setting(4.0, "distill: softmax temperature T of "
                                         "teacher and student in the KL term (scaled "
                                         "by T^2, so its gradient keeps its size).")

    def __post_init__(self):
        super().__post_init__()
        if not self.teacher_dir:
            raise ConfigError("--task=distill needs --teacher_dir=DIR, a finished run "
                              "(e.g. runs/airbench_cifar10)")
        if self.teacher_weights not in ("final", "best"):
            raise ConfigError(f"--teacher_weights must be final or best, got "
                              f"{self.teacher_weights!r}")
        check_range("distill_alpha", self.distill_alpha, 0, 1)
        check_range("distill_temperature", self.distill_temperature, 0, low_open=True)


def kl_at_temperature(teacher_logits: tf.Tensor, student_logits: tf.Tensor,
                      temperature: float) -> tf.Tensor:
    """Per-example KL(softmax(teacher / T) || softmax(student / T))."""
    teacher = tf.nn.log_softmax(teacher_logits / temperature)
    student = tf.nn.log_softmax(student_logits / temperature)
    return tf.reduce_sum(tf.exp(teacher) * (teacher - student), axis=-1)


@base.register
class Distill(classification.Classification):
    name = "distill"
    Settings = Settings
    recipe = {"model": "airbench_small"}

    def create_state(self, build):
        """The student and its optimizer, and (to train) the teacher, from its run
        directory (one-line errors if it cannot be)."""
        state = super().create_state(build)
        if build.training:
            self.teacher = build.frozen(build.finished_classifier(
                self.settings.teacher_dir, "--teacher_dir",
                self.settings.teacher_weights,
                tasks=("classification", "distill")))
            state.models["teacher"] = self.teacher
        return state

    def training_flops(self, state, forward, options) -> float:
        """The student's training step and the teacher's forward pass."""
        return (super().training_flops(state, forward, options)
                + forward(state.models["teacher"]) * (2 if options.sam_rho else 1))

    def loss(self, batch: dict, outputs) -> tuple[tf.Tensor, dict[str, base.Metric]]:
        cross_entropy, metrics = super().loss(batch, outputs)
        student = classification.logits_of(outputs)
        # Inference mode: no dropout in the teacher (training=True would draw masks,
        # and check_step fails; its batch-norm uses the moving statistics either
        # way, the teacher being frozen). No gradient flows into the teacher: its
        # backward pass would cost twice its forward, for nothing.
        teacher = tf.stop_gradient(tf.cast(classification.logits_of(
            self.teacher(batch["image"], training=False)), student.dtype))
        temperature, alpha = self.settings.distill_temperature, self.settings.distill_alpha
        kl = temperature ** 2 * kl_at_temperature(teacher, student, temperature)
        count = tf.reduce_sum(tf.ones_like(kl))
        agree = classification.hits(teacher, tf.argmax(student, -1, output_type=tf.int32))
        metrics.update(distill_kl=(tf.reduce_sum(kl), count),
                       teacher_agreement=(tf.reduce_sum(agree), tf.cast(count, tf.float32)))
        return alpha * cross_entropy + (1.0 - alpha) * kl, metrics
