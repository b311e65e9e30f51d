"""A mean teacher (Tarvainen and Valpola 2017): the student learns from the labels
and from agreeing with a teacher whose weights are an exponential moving average
of the student's, updated after every optimizer step.

One task file. Copy it into trainer/tasks/ (every module there is a task), then:

    python -m trainer.check_step --task=mean_teacher --model=cifar_cnn --model_size=tiny --dataset=synthetic --batch_size=64
    python -m trainer.main --task=mean_teacher --model=cifar_cnn

The teacher is a model of the run's state ("teacher"): the checkpoint saves and
restores it, check_step compares it (on 1 and 2 replicas, and each replica's copy
against the other's), and it is the output model: evaluation, the weights files,
predict and export use the teacher.
"""
import dataclasses

import tensorflow as tf

from trainer import step
from trainer.settings import check_range, setting
from trainer.tasks import base, classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    teacher_decay: float = setting(0.99, "mean_teacher: the teacher's moving-average "
                                   "decay per step.")
    consistency_weight: float = setting(1.0, "mean_teacher: weight of the squared "
                                        "difference of the student's and the "
                                        "teacher's class probabilities.")

    def __post_init__(self):
        super().__post_init__()
        check_range("teacher_decay", self.teacher_decay, 0, 1)
        check_range("consistency_weight", self.consistency_weight, 0)


@base.register
class MeanTeacher(classification.Classification):
    name = "mean_teacher"
    Settings = Settings
    output_model = "teacher"  # evaluated, saved, served

    def create_state(self, build):
        student = build.model()
        teacher = build.model()  # the same network (adapted alike by check_step)
        for mine, theirs in zip(teacher.weights, student.weights):
            mine.assign(theirs)  # the teacher starts as the student
        return build.state({"main": student, "teacher": teacher},
                           {"main": build.optimizer(student)})

    def consistency_loss(self, student, teacher, batch):
        """(per-example: cross-entropy + weight x ||p_student - p_teacher||^2,
        metrics)."""
        outputs = student(batch["image"], training=True)
        per_example, metrics = self.loss(batch, outputs)
        p_student = tf.nn.softmax(classification.logits_of(outputs))
        p_teacher = tf.stop_gradient(tf.nn.softmax(classification.logits_of(
            teacher(batch["image"], training=False))))
        distance = tf.reduce_sum(tf.square(p_student - tf.cast(p_teacher,
                                                               p_student.dtype)), -1)
        metrics["consistency"] = (tf.reduce_sum(distance),
                                  tf.cast(tf.size(distance), distance.dtype))
        return per_example + self.settings.consistency_weight * distance, metrics

    def update_teacher(self, student, teacher) -> None:
        """teacher <- decay x teacher + (1 - decay) x student, every weight (batch-
        norm statistics too). In the replica: every replica updates its own copy
        from the same student, so the copies stay equal."""
        decay = self.settings.teacher_decay
        for mine, theirs in zip(teacher.weights, student.weights):
            mine.assign(decay * mine + (1.0 - decay) * tf.cast(theirs, mine.dtype))

    step_settings = step.SETTINGS  # the default step's, all of them

    def train_step(self, state, batch, options):
        """The default step (trainer/step.py) on the consistency loss, then the
        teacher from the updated student."""
        student, teacher = state.models["main"], state.models["teacher"]
        objective = step.Objective(
            lambda b: self.consistency_loss(student, teacher, b),
            student.trainable_variables, (student,), state.optimizers["main"],
            "task mean_teacher's loss")
        metrics = step.train_step(state, self, batch, options, objective)  # THE sum
        self.update_teacher(student, teacher)  # AFTER the update
        return metrics
