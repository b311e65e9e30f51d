"""One way to build a run: a Config becomes the task, the strategy-scoped state
the task makes (models, optimizers, the step counter: trainer/state.py), the
schedule, and the per-replica step functions.

Training (trainer/loop.py), trainer.check_step, trainer.evaluate, predict and
export (trainer/serving/) and the benchmark all build here, so what check_step
checks is what trains: a teacher, a new option or a new task wired in here is in
every command at once.
"""
import dataclasses
import os
from typing import Callable

import keras
import tensorflow as tf

from data import files, pipeline, sources
import models
from trainer import averaging, checkpoints, flops, inputs, optimizers, schedules, step
from trainer import run_dir, run_settings, tasks, user_code
from trainer import state as state_lib
from trainer import config as config_lib
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
    def make(cls, loop: config_lib.LoopSettings, grad_accum_steps: int,
             train_examples: int, eval_examples: int, num_replicas: int) -> "Plan":
        # The one place the batch is checked against the replicas.
        if loop.batch_size % num_replicas:
            raise ConfigError(f"--batch_size={loop.batch_size} does not divide by the "
                              f"{num_replicas} replicas; use a multiple of {num_replicas}")
        per_replica = loop.batch_size // num_replicas
        if per_replica % grad_accum_steps:
            raise ConfigError(f"the per-replica batch {per_replica} does not divide into "
                              f"--grad_accum_steps={grad_accum_steps} micro-batches; "
                              f"use a batch size that is a multiple of "
                              f"{num_replicas * grad_accum_steps}")
        eval_batch = loop.eval_batch_size or loop.batch_size
        if eval_batch % num_replicas:
            raise ConfigError(f"--eval_batch_size={eval_batch} does not divide by the "
                              f"{num_replicas} replicas; use a multiple of {num_replicas}")
        steps_per_epoch = train_examples // loop.batch_size
        if steps_per_epoch == 0:
            raise ConfigError(f"--batch_size={loop.batch_size} is larger than the "
                              f"{train_examples} training examples; lower it")
        total = loop.train_steps or loop.epochs * steps_per_epoch
        return cls(train_examples, eval_examples, steps_per_epoch, total,
                   pipeline.eval_steps(eval_examples, eval_batch), per_replica)


def config_of_run(model_dir: str, flag: str = "--model_dir") -> Config:
    """The Config of the run in model_dir (run_config.json with the changes of later
    starts), checked as trainer.main checks its flags: the one place a run's
    settings are read back (evaluate, predict, export, a distillation's teacher, a
    GAN's Fréchet classifier), so that an edited or damaged file stops with one
    CheckpointError line naming it, its values cut short."""
    settings = run_dir.read_run_config(model_dir, flag)
    path = f"{model_dir.rstrip('/')}/{checkpoints.RUN_CONFIG}"
    try:  # the run's own code (its --import), so that its model and task are known
        user_code.import_modules(settings.get("imports") or "")
    except user_code.UserCodeError as err:
        raise checkpoints.CheckpointError(f"{path}: {err}") from err
    try:
        return run_settings.validate(run_settings.from_dict(settings), models.names(),
                                   sources.names())
    except (ConfigError, TypeError, ValueError) as err:
        problem = files.shorter(str(err).split(';')[0], 160) if isinstance(
            err, ConfigError) else (f"a value of the wrong type ({type(err).__name__}: "
                                    f"{files.shorter(str(err), 100)})")
        raise checkpoints.CheckpointError(
            f"{path} holds a setting no run can have: {problem.replace('--', '')}; "
            f"restore the file from a backup, or train the run again") from err


def dataset_spec(data: inputs.DataSettings, model_name: str) -> sources.DatasetSpec:
    """The run's dataset, with its split choices and the normalization its model
    declares (every command reads it here)."""
    return model_input_spec(sources.get_spec(data.dataset, data.data_dir,
                                             data.train_split, data.eval_split),
                            model_name)


def run_data(config: Config, spec: sources.DatasetSpec | None = None) -> inputs.RunData:
    """The data the run reads (its dataset's `spec`, read here unless given): the
    one object the input pipelines, the task and the plan take."""
    settings = config.group(inputs.DataSettings)
    return inputs.RunData(spec or dataset_spec(settings, config.model), settings,
                          config.batch_size, config.eval_batch_size, config.seed)


def model_input_spec(spec: sources.DatasetSpec, model_name: str) -> sources.DatasetSpec:
    """`spec` with the mean and std that make its images what model `model_name`
    takes (its input contract, models.register(input_range=...)): the dataset's
    own for the built-in models, [0, 1], [-1, 1] or [0, 255] for others. Training,
    evaluation, predict and export all normalize with these."""
    mean, std = models.input_normalization(model_name, spec.mean, spec.std)
    return dataclasses.replace(spec, mean=mean, std=std)


def plan(config: Config, spec: sources.DatasetSpec, num_replicas: int) -> Plan:
    """The run's sizes: its batches and length over the data's split sizes."""
    return Plan.make(config.group(config_lib.LoopSettings), config.grad_accum_steps,
                     *run_data(config, spec).counts(), num_replicas)


def make_task(config: Config, spec: sources.DatasetSpec) -> tasks.Task:
    """The run's task with its settings (nothing built yet: see Task.build)."""
    return tasks.get(config.task)(run_settings.task_settings_of(config), spec,
                                  run_data(config, spec).image_shape)


def build_model(model: config_lib.ModelSettings, input_shape: tuple[int, int, int],
                task: tasks.Task, weights: str | None = None,
                num_classes: int | None = None) -> keras.Model:
    """The run's model (fresh, or --weights; `weights` overrides that), checked
    against the task: a model whose outputs do not fit is a one-line ConfigError.
    num_classes: its logits (default: the dataset's classes, for a task that reads
    logits). Call under the strategy's scope."""
    if num_classes is None:
        num_classes = tasks.num_classes(task)
    try:
        tasks.check_model_kind(task, model.model)  # (an unknown model name: a ValueError)
        built = models.build(model.model, num_classes, input_shape,
                             tiny=model.model_size == "tiny",
                             weights=model.weights if weights is None else weights,
                             options=model.model_options)
    except ValueError as err:  # bad weights file, image too small, bad option
        raise ConfigError(str(err)) from err
    tasks.check_model(task, model.model, built, num_classes)
    return built


def build_optimizer(settings: optimizers.OptimizerSettings, lookahead: bool,
                    schedule: keras.optimizers.schedules.LearningRateSchedule | float,
                    model: keras.Model,
                    precision: str = "float32", steps_per_epoch: int = 1,
                    step_counter: tf.Variable | None = None,
                    variables: list | None = None) -> keras.optimizers.Optimizer:
    """The run's optimizer for `variables` (default: `model`'s trainable ones),
    built, with its learning-rate multipliers and, with `lookahead`
    (--lookahead_every), the Lookahead's slow weights; call under the strategy's
    scope, after any initialisation of the weights. step_counter: the run's step,
    which the schedule and the freezes read (default: the optimizer's own
    iteration count)."""
    variables = list(model.trainable_variables if variables is None else variables)
    try:
        optimizer = optimizers.create(
            settings, schedules.on_step(schedule, step_counter), variables,
            precision, steps_per_epoch, step_counter)
    except ValueError as err:  # bad --optimizer_options, --lr_multipliers, --freeze_...
        raise ConfigError(str(err)) from err
    if lookahead:
        averaging.add_lookahead(optimizer, variables + step.moving_statistics(model))
    return optimizer


def init_from_data(model: keras.Model, weights: str, data: inputs.RunData) -> None:
    """Sets layers initialised from the data, e.g. airbench's patch whitening, from
    the first training images, unless `weights` (--weights) brought them (a resumed
    run then restores them from the checkpoint, like every weight)."""
    if models.needs_data(model) and weights == "none":
        models.init_from_data(model, inputs.init_images(data))


# What a state is built for: a task builds only what that needs (the output model
# always). TRAIN: everything the step trains and reads; EVALUATE: what the eval
# step reads, weights from a checkpoint; SERVE: the output model alone.
TRAIN, EVALUATE, SERVE = "train", "evaluate", "serve"


def check_step_settings(task: tasks.Task, options: step.StepOptions) -> None:
    """ConfigError if the run sets a step setting the task's own step does not
    carry out (its `step_settings`): it would be silently ignored."""
    if not tasks.has_own_step(task):
        return  # the default step: all of them
    defaults = step.StepOptions(batch_size=options.batch_size)
    for name in step.SETTINGS:
        value = getattr(options, name)
        if value != getattr(defaults, name) and name not in task.step_settings:
            carried = ", ".join(f"--{n}" for n in task.step_settings) or "none"
            raise ConfigError(
                f"--task={task.name} has a step of its own that does not carry out "
                f"--{name} (set to {value}); give --{name}={getattr(defaults, name)} "
                f"(the step settings it carries out: {carried})")


class StateBuilder:
    """What `Task.create_state(build)` builds with, under the run's strategy and
    precision: the run's models and optimizers, made the one way every command
    makes them (so trainer.check_step can adapt every model: float64, synchronized
    batch-norm, no dropout).

    What a task builds with: build.data (the RunData: spec, image shape, batch
    sizes), build.plan, build.options (the StepOptions), build.schedule,
    build.strategy, build.precision, build.purpose (TRAIN, EVALUATE or SERVE),
    build.training (purpose == TRAIN). Not the run's every setting: a task reads
    its own `settings`, and the model and optimizer settings are applied here."""

    def __init__(self, config: Config, spec: sources.DatasetSpec, plan: Plan | None,
                 strategy: tf.distribute.Strategy, precision: str, purpose: str,
                 task: tasks.Task,
                 adapt_model: Callable[[keras.Model], keras.Model] | None = None,
                 adapt_fixed_model: Callable[[keras.Model], keras.Model] | None = None):
        self._config, self.spec, self.plan, self.strategy = config, spec, plan, strategy
        self.precision, self.purpose, self.task = precision, purpose, task
        self.training = purpose == TRAIN
        self._adapt, self._adapt_fixed = adapt_model, adapt_fixed_model
        self.data = run_data(config, spec)
        self.options = self.schedule = None
        if plan is not None:
            self.options = step.StepOptions(
                **dataclasses.asdict(config.group(step.StepSettings)),
                batch_size=config.batch_size, total_steps=plan.total_steps)
            check_step_settings(task, self.options)
            self.schedule = config.group(schedules.ScheduleSettings).make(
                plan.total_steps, plan.steps_per_epoch)
        self.step = state_lib.new_step_counter()  # THE step counter (under the scope)
        self._optimizer_notes: dict[int, str] = {}  # id(optimizer): how it differs
        self.optimizer_notes: dict[str, str] = {}  # the same by name (build.state)

    def model(self, name: str | None = None, num_classes: int | None = None,
              options: str | None = None) -> keras.Model:
        """A model to train. Default: --model, checked against the task, with its
        --model_options and --weights (in training) and its layers set from the
        data (patch whitening). `name`: another registered model (e.g. a GAN's
        discriminator) on the run's image shape, with `options` (its
        --model_options-like text) and `num_classes` (also for --model: another
        number of logits than the dataset's classes)."""
        config = self._config
        if name is None:
            model = build_model(config.group(config_lib.ModelSettings),
                                self.data.image_shape, self.task,
                                weights=None if self.training else "none",
                                num_classes=num_classes)
            if self.training:
                init_from_data(model, config.weights, self.data)
        else:
            try:
                model = models.build(name, num_classes, self.data.image_shape,
                                     tiny=config.model_size == "tiny",
                                     options=options or "")
            except ValueError as err:
                raise ConfigError(str(err)) from err
        return self._adapt(model) if self._adapt is not None else model

    def frozen(self, model: keras.Model) -> keras.Model:
        """`model` (e.g. a teacher loaded from a finished run) used but never
        trained: frozen, its batch-norm on its moving statistics."""
        model = self._adapt_fixed(model) if self._adapt_fixed is not None else model
        model.trainable = False
        return model

    def finished_classifier(self, directory: str, flag: str, weights: str = "final",
                            tasks: tuple[str, ...] = ("classification",)) -> keras.Model:
        """The model of a finished run in `directory` (a run of one of `tasks` on
        this run's dataset and image size; its run_config.json checked as this run's
        flags are, config_of_run), with its "final" (model.weights.h5) or "best"
        (best.weights.h5) weights: a distillation teacher, the Fréchet distance's
        classifier. Anything else is one line: also final weights of a run that has
        not finished (resumed, stopped: they are an older end's)."""
        weights_file = {"final": checkpoints.WEIGHTS_FILE,
                        "best": checkpoints.BEST_WEIGHTS_FILE}[weights]
        path = os.path.join(directory, weights_file)
        for needed in (os.path.join(directory, checkpoints.RUN_CONFIG), path):
            if not tf.io.gfile.exists(needed):
                raise ConfigError(f"{flag}={directory}: {needed} not found; give a "
                                  f"finished run's directory")
        run = config_of_run(directory, flag)
        served, why = checkpoints.weights_to_serve(directory)
        if weights == "final" and served != weights_file:
            raise ConfigError(f"{flag}={directory}: {why}; let it finish, or take its "
                              f"{checkpoints.BEST_WEIGHTS_FILE}")
        if run.task not in tasks:
            raise ConfigError(f"{flag}={directory} is a {run.task} run; give a run of "
                              f"task {' or '.join(tasks)}")
        spec, input_shape = self.spec, self.task.input_shape
        if run.dataset != spec.name:
            raise ConfigError(f"{flag}={directory} was trained on {run.dataset}, this "
                              f"run on {spec.name}; they need the same dataset")
        size = run.image_size or spec.image_shape[0]
        if (size, size, input_shape[2]) != tuple(input_shape):
            raise ConfigError(f"{flag}={directory} sees {size}x{size} images, this run "
                              f"{input_shape[0]}x{input_shape[1]}; set --image_size={size}")
        try:
            return models.build(run.model, spec.num_classes, input_shape,
                                tiny=run.model_size == "tiny", options=run.model_options,
                                weights=path)
        except ValueError as err:
            raise ConfigError(f"{flag}={directory}: {files.shorter(str(err))}") from err

    def optimizer(self, model: keras.Model, learning_rate: float | None = None,
                  variables: list | None = None, **changes
                  ) -> keras.optimizers.Optimizer | None:
        """The run's optimizer for `model` (--optimizer and its options, the
        --lr_schedule at the run's step, multipliers, freezes, weight decay, EMA,
        Lookahead, loss scaling): built, slots and all. `learning_rate`: another
        peak of the same schedule (its shape, warm-up and length the run's);
        `variables`: a subset of the model's trainable variables (a head alone;
        default all); `changes`: other OptimizerSettings values (e.g.
        optimizer="sgd", optimizer_options="beta_1=0.0,beta_2=0.9") for this
        optimizer alone. The run's log names each optimizer that differs from the
        run's. None when the state is built to serve (no optimizer is needed)."""
        if self.purpose == SERVE:
            return None
        run_settings_ = self._config.group(optimizers.OptimizerSettings)
        try:
            settings = dataclasses.replace(run_settings_, **changes)
        except TypeError as err:  # (not a field of OptimizerSettings)
            raise ConfigError(f"build.optimizer: {err}") from err
        schedule = self.schedule
        if learning_rate is not None:
            schedule = dataclasses.replace(
                self._config.group(schedules.ScheduleSettings), learning_rate=learning_rate
            ).make(self.plan.total_steps, self.plan.steps_per_epoch)
        trainable = model.trainable_variables
        if variables is not None:
            outside = [getattr(v, "path", v.name) for v in variables
                       if not any(v is t for t in trainable)]
            if outside or not variables:
                raise ConfigError(f"build.optimizer: variables must be some of "
                                  f"{model.name}'s trainable variables; "
                                  + (f"{outside[0]} is not" if outside else "got none"))
        optimizer = build_optimizer(settings, self._config.lookahead_every > 0, schedule,
                                    model, self.precision, self.plan.steps_per_epoch,
                                    self.step, variables)
        differs = [f"{key}={value}" for key, value in changes.items()
                   if getattr(run_settings_, key) != value]
        if learning_rate is not None:
            differs.insert(0, f"peak {learning_rate:g}: {schedules.describe(schedule)}")
        if variables is not None:
            differs.append(f"{len(variables)} of {model.name}'s {len(trainable)} "
                           f"trainable variables")
        self._optimizer_notes[id(optimizer)] = ", ".join(differs)
        return optimizer

    def variable(self, initial_value, name: str, dtype=None) -> tf.Variable:
        """An extra variable of the state (not trained by an optimizer: a queue and
        its pointer, a running statistic), saved, restored and compared with the
        rest. A step updates it alike on every replica (from values summed or
        gathered over the replicas): the first replica's update is kept, as for the
        step counter (check_step compares every replica's copy)."""
        return tf.Variable(initial_value, dtype=dtype, trainable=False, name=name,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def state(self, models: dict, optimizers: dict | None = None,
              extras: dict | None = None) -> state_lib.TrainState:
        """The TrainState of these parts and the run's step counter and seed."""
        optimizers = {k: v for k, v in (optimizers or {}).items() if v is not None}
        self.optimizer_notes = {name: self._optimizer_notes[id(optimizer)]
                                for name, optimizer in optimizers.items()
                                if self._optimizer_notes.get(id(optimizer))}
        return state_lib.TrainState(dict(models), optimizers, self.step,
                                    self._config.seed, dict(extras or {}))


@dataclasses.dataclass(frozen=True)
class Run:
    """A built run: its task, state (models, optimizers, step counter), schedule
    and step options, and the per-replica step functions the distribution wrapper
    runs."""
    config: Config
    spec: sources.DatasetSpec
    plan: Plan | None
    task: tasks.Task
    state: state_lib.TrainState
    schedule: schedules.WarmupSchedule | None
    step_options: step.StepOptions | None
    optimizer_notes: dict = dataclasses.field(default_factory=dict)  # name: how it
    # differs from the run's optimizer (build.optimizer's changes), for the log

    @property
    def train_steps(self) -> step.Steps:
        """The task's training step(s) on this run's state and options, each a
        per-replica fn(batch), and when each runs: what the distribution wrapper
        (distributed.make_train_loop) runs."""
        def bind(train_step):
            return lambda batch: train_step(self.state, batch, self.step_options)
        return self.task.train_steps(self.plan).bound(bind)

    def eval_step(self, batch: dict) -> dict:
        return self.task.eval_step(self.state, batch)

    @property
    def task_input(self) -> Callable | dict | None:
        return task_input(self.task)

    def about(self) -> dict:
        """What metrics.json says of the run: what it trains on what, its batch, its
        every setting."""
        config = self.config
        return {"task": config.task, "model": config.model, "dataset": config.dataset,
                "global_batch_size": config.batch_size,
                "per_replica_batch_size": self.plan.per_replica_batch,
                "settings": config.as_dict()}

    @property
    def output_model(self) -> keras.Model:
        """What the weights files, predict and export hold: the task's output model."""
        return self.state.models[self.task.output_model]


def build_run(config: Config, spec: sources.DatasetSpec, plan: Plan | None,
              strategy: tf.distribute.Strategy, precision: str = "float32",
              purpose: str = TRAIN,
              adapt_model: Callable[[keras.Model], keras.Model] | None = None,
              adapt_fixed_model: Callable[[keras.Model], keras.Model] | None = None
              ) -> Run:
    """Builds everything a run trains and evaluates with, under `strategy`, in the
    mixed-precision policy `precision` (set globally, as Keras wants): the task,
    and the state its `create_state` makes for `purpose` (TRAIN: with the
    --weights and data-initialised layers; EVALUATE: the weights come from a
    checkpoint; SERVE: the output model alone, from a weights file; plan may then
    be None). adapt_model (check_step: synchronized batch-norm, no dropout,
    float64) is applied to every model the state trains, adapt_fixed_model to the
    models it uses without training them (a teacher)."""
    keras.mixed_precision.set_global_policy(precision)
    task = make_task(config, spec)
    with strategy.scope():
        builder = StateBuilder(config, spec, plan, strategy, precision, purpose, task,
                               adapt_model, adapt_fixed_model)
        state = task.create_state(builder)
    if task.output_model not in state.models:
        raise ConfigError(f"task {task.name}'s output model {task.output_model!r} is not "
                          f"among its state's models ({', '.join(state.models)})")
    return Run(config, spec, plan, task, state, builder.schedule, builder.options,
               builder.optimizer_notes)


def task_input(task: tasks.Task) -> Callable | dict | None:
    """What the task's input pipeline yields, as inputs.train_input_fn takes it: its
    named streams (Task.streams), else its `training_batch` if it has its own, else
    None (the pipeline's standard batch, without the call)."""
    streams = task.streams()
    if streams:
        if not tasks.has_own_step(task):
            raise ConfigError(f"task {task.name} declares input streams "
                              f"({', '.join(streams)}); the default step reads one batch: "
                              f"give it a train_step of its own that reads them")
        return dict(streams)
    return task.training_batch if tasks.makes_own_batches(task) else None


def training_flops_per_image(run: Run) -> float:
    """The float ops of one training step per example, as the task counts them
    (Task.training_flops: by default 3 x the model's forward pass, twice over with
    --sam_rho; a GAN's both networks, a teacher's forward pass)."""
    return run.task.training_flops(run.state, flops.forward_flops_of, run.step_options)
