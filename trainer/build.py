"""One way to build a run: a Config becomes the task, the strategy-scoped model,
optimizer and schedule, and the per-replica step functions.

Training (trainer/loop.py), trainer.check_step, trainer.evaluate, predict and
export (trainer/serving/) and the benchmark all build here, so what check_step
checks is what trains: a teacher, a new option or a new task wired in here is in
every command at once.
"""
import dataclasses
from typing import Callable

import keras
import tensorflow as tf

from data import pipeline, sources
import models
from trainer import averaging, flops, inputs, optimizers, schedules, step, tasks
from trainer.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes derived from the config, the data and the replica count."""
    train_examples: int
    eval_examples: int
    steps_per_epoch: int
    total_steps: int
    eval_steps: int
    per_replica_batch: int

    @classmethod
    def make(cls, config: Config, train_examples: int, eval_examples: int,
             num_replicas: int) -> "Plan":
        # The one place the batch is checked against the replicas.
        if config.batch_size % num_replicas:
            raise ConfigError(f"--batch_size={config.batch_size} does not divide by the "
                              f"{num_replicas} replicas; use a multiple of {num_replicas}")
        per_replica = config.batch_size // num_replicas
        if per_replica % config.grad_accum_steps:
            raise ConfigError(f"the per-replica batch {per_replica} does not divide into "
                              f"--grad_accum_steps={config.grad_accum_steps} micro-batches; "
                              f"use a batch size that is a multiple of "
                              f"{num_replicas * config.grad_accum_steps}")
        eval_batch = config.eval_batch_size or config.batch_size
        if eval_batch % num_replicas:
            raise ConfigError(f"--eval_batch_size={eval_batch} does not divide by the "
                              f"{num_replicas} replicas; use a multiple of {num_replicas}")
        steps_per_epoch = train_examples // config.batch_size
        if steps_per_epoch == 0:
            raise ConfigError(f"--batch_size={config.batch_size} is larger than the "
                              f"{train_examples} training examples; lower it")
        total = config.train_steps or config.epochs * steps_per_epoch
        return cls(train_examples, eval_examples, steps_per_epoch, total,
                   pipeline.eval_steps(eval_examples, eval_batch), per_replica)


def dataset_spec(config: Config) -> sources.DatasetSpec:
    """The run's dataset, with its split choices (every command reads it here)."""
    return sources.get_spec(config.dataset, config.data_dir, config.train_split,
                            config.eval_split)


def counts(config: Config, spec: sources.DatasetSpec) -> tuple[int, int]:
    """(training examples, evaluation examples)."""
    return tuple(sources.load(spec, split, config.data_dir, config.download_data)[1]
                 for split in (spec.train_split, spec.eval_split))


def plan(config: Config, spec: sources.DatasetSpec, num_replicas: int) -> Plan:
    return Plan.make(config, *counts(config, spec), num_replicas)


def make_schedule(config: Config, plan: Plan) -> schedules.WarmupSchedule:
    return schedules.WarmupSchedule(
        config.lr_schedule, config.learning_rate, plan.total_steps, plan.steps_per_epoch,
        warmup_steps=round(config.warmup_epochs * plan.steps_per_epoch),
        decay_rate=config.lr_decay_rate,
        sustain_steps=round(config.sustain_epochs * plan.steps_per_epoch),
        floor=config.min_learning_rate,
        start=config.warmup_start_factor * config.learning_rate
        if config.warmup_start_factor > 0 else None)


def make_task(config: Config, spec: sources.DatasetSpec) -> tasks.Task:
    """The run's task with its settings (nothing built yet: see Task.build)."""
    return tasks.get(config.task)(config.task_options(), spec,
                                  inputs.image_shape(config, spec))


def build_model(config: Config, spec: sources.DatasetSpec, task: tasks.Task,
                weights: str | None = None) -> keras.Model:
    """The run's model (fresh, or --weights; `weights` overrides that), checked
    against the task: a model whose outputs do not fit is a one-line ConfigError.
    Call under the strategy's scope."""
    try:
        task.check_kind(config.model)  # (an unknown model name: a ValueError)
        model = models.build(config.model, task.num_classes(),
                             inputs.image_shape(config, spec),
                             tiny=config.model_size == "tiny",
                             weights=config.weights if weights is None else weights,
                             options=config.model_options)
    except ValueError as err:  # bad weights file, image too small, bad option
        raise ConfigError(str(err)) from err
    task.check(config.model, model)
    return model


def build_optimizer(config: Config,
                    schedule: keras.optimizers.schedules.LearningRateSchedule | float,
                    model: keras.Model,
                    precision: str = "float32", steps_per_epoch: int = 1
                    ) -> keras.optimizers.Optimizer:
    """The run's optimizer, built, with its learning-rate multipliers and, with
    --lookahead_every, the Lookahead's slow weights; call under the strategy's
    scope, after any initialisation of the weights."""
    try:
        optimizer = optimizers.create(config.optimizer, schedule,
                                      model.trainable_variables, config.weight_decay,
                                      config.momentum, precision, config.ema_decay,
                                      config.lr_multipliers, config.optimizer_options,
                                      config.decay_vectors, config.freeze_after_epochs,
                                      steps_per_epoch)
    except ValueError as err:  # bad --optimizer_options, --lr_multipliers, --freeze_...
        raise ConfigError(str(err)) from err
    if config.lookahead_every:
        averaging.add_lookahead(optimizer, model.trainable_variables
                                + step.moving_statistics(model))
    return optimizer


def init_from_data(model: keras.Model, config: Config, spec: sources.DatasetSpec) -> None:
    """Sets layers initialised from the data, e.g. airbench's patch whitening, from
    the first training images (a resumed run then restores them from the
    checkpoint, like every weight; --weights brought them already)."""
    if models.needs_data(model) and config.weights == "none":
        models.init_from_data(model, inputs.init_images(config, spec))


@dataclasses.dataclass(frozen=True)
class Run:
    """A built run: its task, model, optimizer, schedule and step options, and the
    per-replica step functions the distribution wrapper runs."""
    config: Config
    spec: sources.DatasetSpec
    plan: Plan
    task: tasks.Task
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    schedule: schedules.WarmupSchedule
    step_options: step.StepOptions

    def train_step(self, batch: dict) -> dict:
        return step.train_step(self.model, self.optimizer, self.task, batch,
                               self.step_options)

    def eval_step(self, batch: dict) -> dict:
        return step.eval_step(self.model, self.task, batch)


def build_run(config: Config, spec: sources.DatasetSpec, plan: Plan,
              strategy: tf.distribute.Strategy, precision: str = "float32",
              training: bool = True, initial_weights: list | None = None,
              adapt_model: Callable[[keras.Model], keras.Model] | None = None,
              adapt_fixed_model: Callable[[keras.Model], keras.Model] | None = None
              ) -> Run:
    """Builds everything a run trains and evaluates with, under `strategy`, in the
    mixed-precision policy `precision` (set globally, as Keras wants).

    training: also set data-initialised layers (patch whitening) from the first
    training images (unless the weights come from --weights or initial_weights) and
    build what the task trains with (a teacher); False for evaluation, whose
    weights come from a checkpoint. adapt_model (check_step: synchronized
    batch-norm, no dropout, float64) is applied to the model before
    initial_weights are set; adapt_fixed_model to the
    models a task uses without training them (a teacher)."""
    keras.mixed_precision.set_global_policy(precision)
    task = make_task(config, spec)
    with strategy.scope():
        # (evaluation: the weights come from a checkpoint, not from --weights)
        model = build_model(config, spec, task, weights=None if training else "none")
        if adapt_model is not None:
            model = adapt_model(model)
        if initial_weights is not None:
            model.set_weights(initial_weights)
        elif training:
            init_from_data(model, config, spec)
        if training:
            task.build(adapt_fixed_model)
        schedule = make_schedule(config, plan)  # a function of optimizer.iterations
        optimizer = build_optimizer(config, schedule, model, precision,
                                    plan.steps_per_epoch)
    step_options = step.StepOptions.from_config(config, total_steps=plan.total_steps)
    return Run(config, spec, plan, task, model, optimizer, schedule, step_options)


def training_flops_per_image(run: Run) -> float:
    """The float ops of one training step per image: 3 x the model's forward pass
    (the backward is about twice the forward), plus what the task adds (a
    teacher's forward pass), twice over with --sam_rho (two passes a step)."""
    config, spec = run.config, run.spec
    model = flops.training_flops_per_image(
        lambda: build_model(config, spec, run.task, weights="none"),
        inputs.image_shape(config, spec))
    return (model + run.task.extra_flops_per_image()) * (2 if config.sam_rho else 1)
