"""What ONE replica does with its slice of the global batch: the training math.

`train_step` below is the step every task trains with unless it has its own
(`Task.train_step`: a GAN's two updates, an EMA teacher updated after the
optimizer). Both are written with the same public pieces, in the order a step
needs them:

    summed_gradients(objective, batch, options)   forward, backward, THE all-reduce
    gradient_at_offset / sam_gradient             a second pass at moved weights
    apply_or_skip(optimizer, grads, vars, finite) one update, or none if not finite
    per_step(value)                               a metric that is one value a step

An `Objective` says what to differentiate: a function of the batch returning the
per-example loss and metrics, and the variables. Random numbers in a step come
from trainer/randomness.py (the same on every replica and after a resume).
Settings of the step are `StepSettings` fields below: a new one is a field there
(its flag, help, range and resume rule come with it) and its use. A new metric is one
more key in the dict a step returns: the log line, TensorBoard and metrics.json
show every key (a name starting with "_" is the loop's, not shown). Check a
changed step with `python -m trainer.check_step`.

Batches are dicts from the data pipeline: "image", "label" (int; a task that reads
no labels ignores it), "index" (each example's key, for per-example random draws),
optionally "target" (soft targets [B, classes], from mixup), in evaluation "mask"
(0 for padding), or what the task's `training_batch` makes (e.g. two views).
Metrics are (total, weight) pairs summed over replicas and steps; what is shown is
total / weight, so sums over examples and per-step values (`per_step`) both come
out right.
"""
import dataclasses
from typing import Callable, Protocol

import keras
import tensorflow as tf

from trainer import averaging, distributed, optimizers, settings
from trainer.distributed import Metric  # (total, weight): shown as total / weight
from trainer.state import MAIN, TrainState, moving_statistics


class Task(Protocol):
    """What the default steps read of a task (trainer/tasks/base.py's Task, which
    imports this module for its default step)."""
    name: str
    output_model: str

    def loss(self, batch: dict, outputs) -> tuple[tf.Tensor, dict[str, Metric]]: ...
    def predict(self, model: keras.Model, images: tf.Tensor): ...
    def eval_metrics(self, batch: dict, predictions, weights: tf.Tensor
                     ) -> dict[str, Metric]: ...

SUM = tf.distribute.ReduceOp.SUM
STEP_METRICS = ("loss", "grad_norm", "skipped")  # the step's own

# One update with the given (already summed) gradients, or none where `finite` is
# false; the optimizer's own iteration count counts the updates applied only.
# (trainer/optimizers.py)
apply_or_skip = optimizers.apply_or_skip


_ = settings.section("the training step")  # (--help's heading of each field below)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The settings `train_step` below carries out, each a flag of its name (its
    help, range and resume rule here; trainer/settings.py). A task with a step of
    its own lists those it carries out in its `step_settings`; a run that sets
    another is refused, never silently ignored."""
    clip_grad_norm: float = _(0.0, "Clip the global norm of the gradient summed over "
                              "all replicas to this value (0: off).", low=0)
    grad_accum_steps: int = _(1, "Split each replica's batch into this many "
                              "micro-batches and add their gradients: one update per "
                              "step, less memory (the per-replica batch must divide).",
                              low=0, low_open=True)
    sam_rho: float = _(0.0, "Sharpness-aware minimization: take the gradient again at "
                       "the weights moved this far uphill along the summed gradient, "
                       "and apply that one (two passes a step; 0: off).", low=0)
    lookahead_every: int = _(0, "Lookahead (airbench): every N steps move slow weights "
                             "towards the weights by (1 - decay) and set the weights to "
                             "them; decay = lookahead_decay^N * (step/total)^3; at the "
                             "end the weights are the slow ones (0: off).", low=0,
                             resume=settings.ON_OFF)
    lookahead_decay: float = _(0.95, "Lookahead's per-step decay (see "
                               "--lookahead_every).", low=0, low_open=True, high=1)


# The step settings' names (docs/examples: a task whose step carries out them all).
SETTINGS = tuple(field.name for field in dataclasses.fields(StepSettings))


@dataclasses.dataclass(frozen=True)
class StepOptions(StepSettings):
    """What a step runs with: the run's StepSettings and what is derived from the
    run (trainer/build.py makes it)."""
    batch_size: int = dataclasses.field(kw_only=True)  # GLOBAL, summed over replicas
    total_steps: int = dataclasses.field(default=0, kw_only=True)  # (Lookahead's schedule)


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a gradient is taken of. loss_fn(batch) -> (per-example loss [B],
    {name: (total, weight)} of metrics), run on this replica's (micro-)batch;
    `variables`: what to differentiate it for; `models`: those the forward pass ran
    in training mode (their regularization losses are added; a second pass puts
    back their batch-norm statistics); `optimizer`: the one that will apply the
    gradient (its loss scale under mixed_float16)."""
    loss_fn: Callable[[dict], tuple[tf.Tensor, dict]]
    variables: list
    models: tuple = ()
    optimizer: keras.optimizers.Optimizer | None = None
    source: str = "the loss"  # who returned the metrics, for error lines


@dataclasses.dataclass(frozen=True)
class Steps:
    """Several training steps of a task and when each runs (`Task.train_steps`).

    `parts`: (name, step, count) in order; each step is per replica, like
    `Task.train_step`: step(state, batch, options) -> {name: (total, weight)}.
    repeat=True: the parts again and again (WGAN-GP: ("critic", ..., 5),
    ("generator", ..., 1)); repeat=False: phases, each part once, the last (count
    0) to the run's end (a head alone for 1,000 steps, then the whole network).

    Which step runs is a pure function of the run's step counter, so a resume, a
    loop of any length and check_step follow it. The choice is made outside the
    replicas (one compiled step per part, one `switch_case` around them): no
    collective under a `tf.cond` in a replica, no gradient computed and thrown
    away. Every step consumes one batch of the stream (the data position stays
    the step), and a metric that one step does not return counts nothing there
    (weight 0)."""
    parts: tuple[tuple[str, Callable, int], ...]
    repeat: bool = True
    # part name -> globs on check_step's variable names ("main/backbone*": model
    # "main"'s variables whose path starts with "backbone"; "!glob": except those):
    # what must not change while that part runs; check_step FAILs a step that
    # changes one.
    frozen: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        names = [name for name, _, _ in self.parts]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"Steps needs parts with distinct names, got {names}")
        if any(isinstance(globs, str) or not all(isinstance(g, str) for g in globs)
               for globs in self.frozen.values()):
            raise ValueError(f"Steps.frozen maps a part to a tuple of globs, e.g. "
                             f"{{'head': ('main/*',)}}; got {self.frozen!r}")
        unknown = [part for part in self.frozen if part not in names]
        if unknown:
            raise ValueError(f"Steps.frozen names {unknown[0]!r}, not a part of {names}")
        counts = [count for _, _, count in self.parts]
        fixed = counts if self.repeat else counts[:-1]
        if any(not isinstance(c, int) or c < 1 for c in fixed) or (
                not self.repeat and counts[-1] != 0):
            raise ValueError(f"Steps {names}: each part runs a whole number of steps "
                             f">= 1{'' if self.repeat else ', the last 0 (to the end)'}; "
                             f"got {counts}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.parts)

    @property
    def cycle(self) -> int:
        """Steps of one cycle (repeat) or before the last phase."""
        return sum(count for _, _, count in self.parts)

    def starts(self) -> list[int]:
        """The step (from 0) at which each part first runs."""
        return [sum(c for _, _, c in self.parts[:i]) for i in range(len(self.parts))]

    def index_at(self, step):
        """The part that runs at step `step` (0-based; a Python int or an int
        tensor: the state's counter before the step)."""
        position = step % self.cycle if self.repeat else step
        index = 0
        for i, start in enumerate(self.starts()[1:], 1):
            index = (tf.where(position >= start, i, index) if tf.is_tensor(step)
                     else (i if position >= start else index))
        return tf.cast(index, tf.int32) if tf.is_tensor(step) else index

    def name_at(self, step: int) -> str:
        return self.parts[self.index_at(step)][0]

    def bound(self, bind: Callable[[Callable], Callable]) -> "Steps":
        """The same schedule with each step replaced by bind(step)."""
        return Steps(tuple((name, bind(fn), count) for name, fn, count in self.parts),
                     self.repeat, self.frozen)

    def describe(self) -> str:
        listed = ", ".join(f"{name} x{count}" if count else f"{name} to the end"
                           for name, _, count in self.parts)
        return f"{listed}{', repeated' if self.repeat else ''}"


# do_not_convert: no Python branch on a tensor, no task code below (start-up time;
# docs/changing-the-step.md).
@tf.autograph.experimental.do_not_convert
def per_step(value) -> Metric:
    """A metric that is one value per step, the same on every replica (computed
    after the all-reduce, like grad_norm): shown as that value, averaged over the
    steps of a log line. Python numbers are fine."""
    return tf.cast(value, tf.float32), tf.constant(1.0)


@tf.autograph.experimental.do_not_convert
def global_mean(per_example_loss: tf.Tensor, options: StepOptions) -> tf.Tensor:
    # Divide by the GLOBAL batch, not this replica's share: the replicas' gradients
    # are summed, so the sum is the gradient of the global-batch mean.
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=options.batch_size)


def _forward_backward(objective: Objective, batch: dict, options: StepOptions):
    """This replica's gradient of its part of the global mean loss, and its metrics."""
    with tf.GradientTape() as tape:
        per_example_loss, metrics = objective.loss_fn(batch)
        loss = global_mean(per_example_loss, options)
        for model in objective.models:
            if model.losses:  # weight regularizers: every replica and micro-batch adds them
                loss += tf.nn.scale_regularization_loss(
                    tf.add_n(model.losses)) / options.grad_accum_steps
        # Identity, except under mixed_float16: scaled up so float16 gradients do not
        # underflow (unscaled after the sum, below).
        scaled_loss = (objective.optimizer.scale_loss(loss) if objective.optimizer
                       is not None else loss)
    gradients = tape.gradient(scaled_loss, objective.variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    count = tf.reduce_sum(tf.ones_like(per_example_loss))
    metrics = distributed.summable(metrics, objective.source, STEP_METRICS)
    return gradients, {"loss": (tf.reduce_sum(per_example_loss), count), **metrics}


def replica_gradients(objective: Objective, batch: dict, options: StepOptions):
    """THIS replica's gradient of its part of the global mean loss (not summed
    over replicas yet), in grad_accum_steps micro-batches, and its metric sums."""
    steps = options.grad_accum_steps
    if steps == 1:
        return _forward_backward(objective, batch, options)
    micro = {key: tf.reshape(t, [steps, -1, *t.shape[1:]]) for key, t in batch.items()}
    gradients, sums = _forward_backward(
        objective, {key: t[0] for key, t in micro.items()}, options)
    for i in tf.range(1, steps):  # a graph loop: one micro-batch in memory at a time
        more, more_sums = _forward_backward(
            objective, {key: t[i] for key, t in micro.items()}, options)
        gradients = [g + m for g, m in zip(gradients, more)]
        sums = tf.nest.map_structure(tf.add, sums, more_sums)
    return gradients, sums


@tf.autograph.experimental.do_not_convert
def all_reduce_sum(values):
    """THE cross-replica sum (of a tensor or a list of them), in a replica context."""
    return tf.distribute.get_replica_context().all_reduce(SUM, values)


def summed_gradients(objective: Objective, batch: dict, options: StepOptions):
    """(gradient of the GLOBAL batch's mean loss, this replica's metric sums).

    THE all-reduce. After it every replica holds the same gradient; anything that
    must see the whole batch's gradient (its norm, clipping, the finite check, a
    second pass) comes after it."""
    gradients, sums = replica_gradients(objective, batch, options)
    gradients = all_reduce_sum(gradients)
    return optimizers.unscale(objective.optimizer, gradients), sums  # (mixed_float16)


def gradient_at_offset(objective: Objective, batch: dict, options: StepOptions,
                       offsets: list, finite: tf.Tensor) -> list:
    """The summed gradient at objective.variables + `offsets` (one each): a second
    forward and backward pass, for steps that take a gradient at perturbed weights
    (SAM and its family). Afterwards the variables are bitwise what they were and
    the batch-norm statistics of objective.models hold only the first pass's
    update. Where `finite` (the first gradient's) is false no offset is applied, so
    no NaN reaches the weights and the step stays skippable."""
    statistics = [v for model in objective.models for v in moving_statistics(model)]
    weights = list(objective.variables)
    kept_weights = [tf.identity(w) for w in weights]
    kept_statistics = [tf.identity(v) for v in statistics]
    for weight, offset in zip(weights, offsets):
        weight.assign_add(tf.where(finite, tf.cast(offset, weight.dtype),
                                   tf.zeros_like(weight)))
    gradients, _ = summed_gradients(objective, batch, options)
    for variable, kept in zip(weights + statistics, kept_weights + kept_statistics):
        variable.assign(kept)
    return gradients


def sam_gradient(objective: Objective, batch: dict, options: StepOptions,
                 gradients: list, grad_norm: tf.Tensor, finite: tf.Tensor):
    """Sharpness-aware minimization (Foret et al. 2021): the summed gradient at
    w + rho * g / ||g||, with g the summed gradient and its GLOBAL norm, so every
    replica moves its weights alike. Returns (that gradient, its norm: what
    clipping and the log see, whether both gradients are finite)."""
    scale = options.sam_rho / (grad_norm + 1e-12)
    gradients = gradient_at_offset(objective, batch, options,
                                   [scale * g for g in gradients], finite)
    grad_norm = tf.linalg.global_norm(gradients)
    return gradients, grad_norm, tf.logical_and(finite, tf.math.is_finite(grad_norm))


def supervised(state: TrainState, task: Task, name: str = MAIN) -> Objective:
    """The task's loss on the outputs of model `name` in training mode."""
    model = state.models[name]
    return Objective(lambda batch: task.loss(batch, model(batch["image"], training=True)),
                     model.trainable_variables, (model,), state.optimizers[name],
                     f"task {task.name}'s loss")


def train_step(state: TrainState, task: Task, batch: dict, options: StepOptions,
               objective: Objective | None = None) -> dict[str, Metric]:
    """Forward, backward, the cross-replica sum, one update; on one replica.
    `objective`: what to descend (default: the task's loss on model "main"); a
    task with another loss on one model and its optimizer passes its own and keeps
    every step setting (SimCLR's contrastive loss)."""
    objective = objective or supervised(state, task)
    optimizer = objective.optimizer
    # Batch-norm updates its moving statistics in the forward pass, before anyone
    # knows whether the gradient is finite: keep them (a few numbers per channel),
    # to undo a skipped step's.
    statistics = [v for model in objective.models for v in moving_statistics(model)]
    kept_statistics = [tf.identity(v) for v in statistics]
    gradients, sums = summed_gradients(objective, batch, options)
    grad_norm = tf.linalg.global_norm(gradients)
    finite = tf.math.is_finite(grad_norm)  # the same on every replica

    if options.sam_rho:  # SAM: the gradient again, at the weights moved rho uphill
        gradients, grad_norm, finite = sam_gradient(objective, batch, options,
                                                    gradients, grad_norm, finite)
    if options.clip_grad_norm:
        gradients, _ = tf.clip_by_global_norm(gradients, options.clip_grad_norm,
                                              use_norm=grad_norm)
    # One update, the same on every replica (the optimizer does not sum again), or
    # none for a non-finite gradient. (An update that overflows a weight anyway, at
    # a huge learning rate, stops the run before anything is saved: the wrapper
    # checks the state after every step, trainer/distributed.py.)
    apply_or_skip(optimizer, gradients, objective.variables, finite)
    for variable, kept in zip(statistics, kept_statistics):
        variable.assign(tf.where(finite, variable, kept))
    if options.lookahead_every:  # airbench: every k steps, back to the slow weights
        averaging.lookahead_step(optimizer, options.lookahead_every,
                                 options.lookahead_decay, options.total_steps)

    applied = tf.cast(finite, tf.float32)
    skipped = 1.0 - applied
    if optimizers.loss_scaled(optimizer):  # a gradient overflow at a finite loss is
        loss_total = all_reduce_sum(sums["loss"][0])  # the loss scale's business
        scale_only = tf.logical_and(tf.logical_not(finite),
                                    tf.math.is_finite(loss_total))
        skipped *= 1.0 - tf.cast(scale_only, tf.float32)
    # A skipped step's examples are not counted in the metrics.
    return {**{key: (tf.where(finite, total, tf.zeros_like(total)),
                     weight * tf.cast(applied, weight.dtype))
               for key, (total, weight) in sums.items()},
            "grad_norm": (tf.where(finite, grad_norm, tf.zeros_like(grad_norm)), applied),
            "skipped": per_step(skipped)}


def eval_step(state: TrainState, task: Task, batch: dict) -> dict[str, Metric]:
    """The task's evaluation metrics of its output model on one replica; padded
    examples (mask 0) count 0."""
    predictions = task.predict(state.models[task.output_model], batch["image"])
    return task.eval_metrics(batch, predictions, tf.cast(batch["mask"], tf.float32))
