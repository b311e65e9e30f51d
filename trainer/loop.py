"""The outer loop: build everything under the strategy, then train, evaluate,
checkpoint and report. The math of one step is in trainer/step.py; running it on
every replica is trainer/distributed.py.
"""
import contextlib
import dataclasses
import math
import os

from absl import logging
import keras
import tensorflow as tf

from data import augment, pipeline, sources
import models
from trainer import averaging, checkpoints, distributed, faults, optimizers, reporting
from trainer import schedules
from trainer import strategy as strategy_lib
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
        if config.batch_size % num_replicas:
            raise ConfigError(f"--batch_size={config.batch_size} does not divide by the "
                              f"{num_replicas} replicas; use a multiple of {num_replicas}")
        steps_per_epoch = train_examples // config.batch_size
        if steps_per_epoch == 0:
            raise ConfigError(f"--batch_size={config.batch_size} is larger than the "
                              f"{train_examples} training examples; lower it")
        total = config.train_steps or config.epochs * steps_per_epoch
        return cls(train_examples, eval_examples, steps_per_epoch, total,
                   pipeline.eval_steps(eval_examples, config.batch_size),
                   config.batch_size // num_replicas)


def _worker_role(strategy: tf.distribute.Strategy) -> tuple[bool, int]:
    """(is_chief, task_id): the chief alone writes summaries, metrics and weights."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True, 0
    task_type, task_id = resolver.task_type, resolver.task_id or 0
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return task_type == "chief" or (task_type == "worker" and task_id == 0
                                    and not has_chief), task_id


def image_shape(config: Config, spec: sources.DatasetSpec) -> tuple[int, int, int]:
    size = config.image_size or spec.image_shape[0]
    return (size, size, spec.image_shape[2])


def _prepare(config: Config, spec: sources.DatasetSpec):
    """Per-example decode-time resize, when the run's size differs from the data's."""
    shape = image_shape(config, spec)
    return (augment.make_resize(shape[0])
            if spec.variable_size or shape != spec.image_shape else None)


def train_input_fn(config: Config, spec: sources.DatasetSpec, train_examples: int,
                   start_step: int = 0):
    """The training input for `distribute_datasets_from_function`: each input
    worker's pipeline, resuming at `start_step` (the data position is the step)."""
    normalize = augment.make_normalize(spec.mean, spec.std)
    train_augment = augment.TRAIN_AUGMENTATIONS[config.augment or spec.augment]

    def train_fn(context):
        ds, _ = sources.load(spec, spec.train_split, config.data_dir, config.download_data,
                             context=context)  # this worker's shard
        return pipeline.make_train(ds, context, config.batch_size, train_augment,
                                   normalize, config.shuffle_buffer, seed=config.seed,
                                   prepare=_prepare(config, spec),
                                   num_examples=train_examples, shard=False,
                                   start_step=start_step)
    return train_fn


def _distributed_datasets(config: Config, spec: sources.DatasetSpec,
                          strategy: tf.distribute.Strategy, plan: Plan, start_step: int):
    normalize = augment.make_normalize(spec.mean, spec.std)

    def eval_fn(context):
        ds, n = sources.load(spec, spec.eval_split, config.data_dir, config.download_data)
        return pipeline.make_eval(ds, n, context, config.batch_size, normalize,
                                  prepare=_prepare(config, spec))

    return (strategy.distribute_datasets_from_function(
                train_input_fn(config, spec, plan.train_examples, start_step)),
            strategy.distribute_datasets_from_function(eval_fn))


def _build_state(config: Config, spec: sources.DatasetSpec, plan: Plan, precision: str):
    """Model, schedule, optimizer (built) and step counter; call inside the scope."""
    try:
        model = models.build(config.model, spec.num_classes, image_shape(config, spec),
                             tiny=config.model_size == "tiny", weights=config.weights)
    except ValueError as err:  # bad weights file, image too small for the model, ...
        raise ConfigError(str(err)) from err
    schedule = schedules.WarmupSchedule(
        config.lr_schedule, config.learning_rate, plan.total_steps, plan.steps_per_epoch,
        warmup_steps=round(config.warmup_epochs * plan.steps_per_epoch),
        decay_rate=config.lr_decay_rate,
        sustain_steps=round(config.sustain_epochs * plan.steps_per_epoch),
        floor=config.min_learning_rate)
    optimizer = optimizers.create(config.optimizer, schedule, model.trainable_variables,
                                  config.weight_decay, config.momentum, precision,
                                  config.ema_decay)
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return model, schedule, optimizer, step


def _next_stop(step: int, total: int, steps_per_loop: int, *intervals: int) -> int:
    """The next step at which the loop must return to Python."""
    stops = [total, step + steps_per_loop]
    stops += [(step // i + 1) * i for i in intervals if i > 0]
    return min(stops)


def _evaluate(eval_loop, eval_dataset, plan: Plan) -> dict:
    sums = {k: float(v) for k, v in eval_loop(iter(eval_dataset),
                                              tf.constant(plan.eval_steps)).items()}
    count = sums["count"]
    return {"test_loss": sums["loss_sum"] / count, "test_accuracy": sums["correct"] / count,
            "test_examples": int(round(count))}


@contextlib.contextmanager
def _data_errors_explained(spec: sources.DatasetSpec):
    """A corrupt input file surfaces deep in the graph without its name: find it."""
    try:
        yield
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
        culprit = sources.explain_read_error(spec)
        if culprit:
            raise sources.DatasetError(culprit) from err
        raise


def train_and_evaluate(config: Config) -> dict:
    """Trains `config` in config.model_dir (resuming if a checkpoint is there),
    evaluates, saves `model.weights.h5` and `metrics.json`; returns the metrics."""
    runtime = strategy_lib.create(config.strategy, config.tpu, config.require_tpu,
                                  config.cpu_replicas)
    strategy = runtime.strategy
    precision = strategy_lib.resolve_precision(config.precision, runtime.device_kind,
                                               config.deterministic)
    jit = strategy_lib.resolve_jit(config.jit_compile, runtime.device_kind)
    is_chief, task_id = _worker_role(strategy)
    checkpoints.prepare_model_dir(config.model_dir, config.as_dict(), is_chief)
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    spec = sources.get_spec(config.dataset)
    _, train_examples = sources.load(spec, spec.train_split, config.data_dir,
                                     config.download_data)
    _, eval_examples = sources.load(spec, spec.eval_split, config.data_dir,
                                    config.download_data)
    plan = Plan.make(config, train_examples, eval_examples, runtime.num_replicas)
    with strategy.scope():
        model, schedule, optimizer, step_var = _build_state(config, spec, plan, precision)
        checkpoint = checkpoints.training_checkpoint(model, optimizer, step_var)
    reporting.log_setup(config, spec, runtime, plan, precision, jit, schedule, model)
    restored = checkpoints.restore_latest(checkpoint, config.model_dir)
    if restored:
        logging.info("Resumed from %s at step %d", restored, int(step_var.numpy()))
    manager = checkpoints.make_manager(config.model_dir, checkpoint,
                                       config.keep_checkpoints, is_chief, task_id)
    with _data_errors_explained(spec):  # the training cache is filled here
        train_dataset, eval_dataset = _distributed_datasets(config, spec, strategy, plan,
                                                            int(step_var.numpy()))
    # On a TPU every step is XLA-compiled anyway; an inner jit_compile is redundant.
    wrap_jit = jit and runtime.device_kind != "tpu"
    train_loop = distributed.make_train_loop(strategy, model, optimizer,
                                             config.batch_size, wrap_jit, config.on_nan,
                                             config.label_smoothing)
    eval_loop = distributed.make_eval_loop(strategy, model, wrap_jit, config.tta_flip)
    context = dict(runtime=runtime, precision=precision, jit=jit, plan=plan,
                   is_chief=is_chief)
    with _data_errors_explained(spec), faults.SigtermWatcher() as sigterm:
        history = _run(config, plan, iter(train_dataset), train_loop,
                       lambda: averaging.evaluate_raw_and_averaged(
                           lambda: _evaluate(eval_loop, eval_dataset, plan), optimizer),
                       step_var,
                       manager, optimizer, schedule, sigterm, is_multi_worker(strategy))
    with averaging.averaged_weights(optimizer):  # save (and checksum) what was evaluated
        metrics = _finish(config, model, history, context)
    if is_multi_worker(strategy):  # leave together: the chief hosts the coordination
        strategy.reduce(tf.distribute.ReduceOp.SUM,  # service the others still use
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
    return metrics


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    return strategy.extended._in_multi_worker_mode()  # noqa: SLF001 (no public API)


def _run(config: Config, plan: Plan, train_iterator, train_loop, evaluate, step_var,
         manager, optimizer, schedule, sigterm, multi_worker: bool) -> dict:
    """Train to plan.total_steps; log, evaluate and checkpoint on the way."""
    step = int(step_var.numpy())
    progress = reporting.Progress(plan.total_steps, plan.steps_per_epoch,
                                  config.batch_size, start_step=step)
    every = {"eval": config.eval_every or plan.steps_per_epoch,
             "checkpoint": config.checkpoint_every or plan.steps_per_epoch,
             "log": config.log_every or plan.steps_per_epoch}
    evals, last_train, wall = [], {}, reporting.Stopwatch()
    due = lambda name: step % every[name] == 0 or step == plan.total_steps  # noqa: E731
    while step < plan.total_steps:
        stop = _next_stop(step, plan.total_steps, config.steps_per_loop, *every.values())
        with reporting.Stopwatch() as watch:
            sums = {k: float(v) for k, v in train_loop(
                train_iterator, tf.constant(stop - step),
                tf.constant(float(sigterm.requested))).items()}
        if not math.isfinite(sums["loss_sum"]):
            raise faults.TrainingDivergedError(
                f"non-finite loss at step {step + int(sums['steps'])}; stopped without "
                f"saving it: the last good checkpoint in {config.model_dir} is kept "
                f"(lower the learning rate, or pass --on_nan=skip_step)")
        progress.add(sums, stop - step, watch.seconds)
        step = stop
        step_var.assign(step)
        # One worker alone cannot stop: in multi-worker runs, wait for the summed flag.
        if sums["stop_requested"] > 0 or (sigterm.requested and not multi_worker):
            manager.save(checkpoint_number=step)
            raise faults.Preempted(f"preempted (SIGTERM): saved a checkpoint at step "
                                   f"{step} in {config.model_dir}; run the same command "
                                   f"to resume")
        if due("log"):
            last_train = progress.log(step, float(schedule(optimizer.iterations)))
        if due("eval"):
            evals.append(_eval_record(evaluate, step, plan, wall, progress))
        if due("checkpoint"):
            manager.save(checkpoint_number=step)
    if not evals or evals[-1]["step"] != step:  # e.g. resumed after the last step
        evals.append(_eval_record(evaluate, step, plan, wall, progress))
    return {"evals": evals, "last_train": last_train, "progress": progress, "step": step}


def _eval_record(evaluate, step: int, plan: Plan, wall, progress) -> dict:
    result = evaluate()
    raw = (f"  (raw weights: {result['test_accuracy_raw']:.4f})"
           if "test_accuracy_raw" in result else "")
    logging.info("eval at step %d (epoch %.2f): test loss %.4f  test accuracy %.4f%s  "
                 "(%d examples)", step, step / plan.steps_per_epoch, result["test_loss"],
                 result["test_accuracy"], raw, result["test_examples"])
    return {"step": step, "epoch": step / plan.steps_per_epoch,
            "wall_seconds": wall.elapsed(), "train_seconds": progress.train_seconds,
            **result}


def _finish(config: Config, model, history: dict, context: dict) -> dict:
    """Write the weights and metrics.json (chief only); return the metrics."""
    final, plan, runtime = history["evals"][-1], context["plan"], context["runtime"]
    progress = history["progress"]
    metrics = {
        **final,
        "best_test_accuracy": max(e["test_accuracy"] for e in history["evals"]),
        **history["last_train"],
        "train_seconds": progress.train_seconds,
        "images_per_second": progress.images_per_second(history["step"]),
        "steps": history["step"], "epochs": history["step"] / plan.steps_per_epoch,
        "resumed_from_step": progress.start_step,
        "skipped_steps": progress.skipped_steps,
        "weights_sha256": reporting.weights_checksum(model),
        "model": config.model, "dataset": config.dataset,
        "strategy": type(runtime.strategy).__name__, "replicas": runtime.num_replicas,
        "device": runtime.device_kind, "precision": context["precision"],
        "jit_compile": context["jit"], "global_batch_size": config.batch_size,
        "per_replica_batch_size": plan.per_replica_batch,
        "eval_history": history["evals"],
    }
    if context["is_chief"]:
        model.save_weights(os.path.join(config.model_dir, "model.weights.h5"))
        reporting.write_json(os.path.join(config.model_dir, "metrics.json"), metrics)
    logging.info("Done: test accuracy %.4f on %d examples, %.1f s training, %.0f img/s",
                 metrics["test_accuracy"], metrics["test_examples"],
                 metrics["train_seconds"], metrics["images_per_second"])
    return metrics
