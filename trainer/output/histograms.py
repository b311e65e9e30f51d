"""--histograms: TensorBoard histograms of every trained weight and of its gradient
at every evaluation, in the run directory's `histograms/` events (the Histograms
and Distributions tabs; tags `weights/<variable path>` and
`gradients/<variable path>`, the model's name first when the state has several).
A built-in callback (trainer/callbacks.py), on the chief, outside the step.

The gradient is the default step's objective: the task's `loss` on the main
model's outputs in training mode (its mean, plus the model's regularization
losses), at the current weights (the raw ones with --ema_decay), on one fixed
batch: the evaluation's sample examples (the first 20 test examples, those of the
prediction pictures, unaugmented; the same at every evaluation, so the histograms
compare across steps). It is computed with `stateless_call`: nothing of the state changes (no
batch-norm statistics, no random generator). A task with a step of its own (a
GAN, SimCLR) trains another objective: its weights are written, not gradients.
"""
import os

from absl import logging
import tensorflow as tf

from trainer import callbacks
from trainer.output import summaries
from trainer.state import TrainState
from trainer.tasks import base

DIRECTORY = "histograms"


def _tags(state: TrainState) -> list[tuple[str, object]]:
    """(tag suffix, variable) of every trained variable of the state's models."""
    several = len(state.models) > 1
    return [((f"{name}/" if several else "") + variable.path, variable)
            for name, model in state.models.items()
            for variable in model.trainable_variables]


def sample_gradients(task: base.Task, state: TrainState, samples: dict | None
                     ) -> list | None:
    """The gradient of the default step's objective on `samples` for each of the
    main model's trainable variables (module docstring); None where it is not the
    task's objective or the samples lack what its loss reads."""
    if base.has_own_step(task) or not samples:
        return None
    keys = [key for key in task.batch_keys if key != "target"]  # (only mixed batches)
    if any(key not in samples for key in keys):
        return None
    batch = {key: tf.convert_to_tensor(samples[key]) for key in keys}
    batch["image"] = base.normalize(task.spec, samples["image"])
    model = state.models["main"]
    trainable = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        tape.watch(trainable)
        outputs, _, losses = model.stateless_call(
            trainable, non_trainable, batch["image"], training=True, return_losses=True)
        per_example_loss, _ = task.loss(batch, outputs)
        loss = tf.reduce_mean(tf.cast(per_example_loss, tf.float32))
        if losses:
            loss += tf.add_n([tf.cast(x, tf.float32) for x in losses])
    return tape.gradient(loss, trainable, unconnected_gradients=tf.UnconnectedGradients.ZERO)


class Histograms(callbacks.Callback):
    """Weight and gradient histograms at every evaluation (module docstring)."""
    name = "histograms"

    def __init__(self):
        self.context: callbacks.Context | None = None
        self.writer: tf.summary.SummaryWriter | None = None

    def on_train_begin(self, context: callbacks.Context) -> None:
        if not context.is_chief:
            return
        self.context = context
        with summaries.write_errors_explained(context.model_dir):
            self.writer = tf.summary.create_file_writer(
                os.path.join(context.model_dir, DIRECTORY))
        if base.has_own_step(context.task):
            logging.info("--histograms: task %s trains with a step of its own: weight "
                         "histograms only, no gradients", context.task.name)

    def on_eval(self, step: int, results: dict, state: TrainState) -> None:
        if self.writer is None:
            return
        gradients = sample_gradients(self.context.task, state, results.get("samples"))
        gradient_of = ({} if gradients is None else dict(zip(
            (id(v) for v in state.models["main"].trainable_variables), gradients)))
        with summaries.write_errors_explained(self.context.model_dir), \
                self.writer.as_default(step=step):
            for tag, variable in _tags(state):
                tf.summary.histogram(f"weights/{tag}", tf.cast(variable.value, tf.float32))
                if id(variable) in gradient_of:
                    tf.summary.histogram(f"gradients/{tag}",
                                         tf.cast(gradient_of[id(variable)], tf.float32))
            self.writer.flush()

    def on_train_end(self, metrics: dict) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
