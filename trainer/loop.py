"""The outer loop: build everything under the strategy, then train, evaluate,
checkpoint and report. The math of one step is in trainer/step.py; running it on
every replica is trainer/distributed.py.
"""
import contextlib
import dataclasses
import math
import os
import sys
from typing import IO

from absl import logging
import keras
import tensorflow as tf

from data import pipeline, sources
import models
from trainer import averaging, checkpoints, distributed, evaluation, faults, inference
from trainer import figures, inputs
from trainer import optimizers, progress_bar, recorder as recorder_lib, reporting, schedules
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


def _schedule(config: Config, plan: Plan) -> schedules.WarmupSchedule:
    return schedules.WarmupSchedule(
        config.lr_schedule, config.learning_rate, plan.total_steps, plan.steps_per_epoch,
        warmup_steps=round(config.warmup_epochs * plan.steps_per_epoch),
        decay_rate=config.lr_decay_rate,
        sustain_steps=round(config.sustain_epochs * plan.steps_per_epoch),
        floor=config.min_learning_rate)


def plot_schedule(config: Config) -> str:
    """Writes the run's learning-rate schedule to model_dir/lr_schedule.png (the
    data is only counted, nothing is trained); returns the path."""
    spec = sources.get_spec(config.dataset)
    counts = [sources.load(spec, split, config.data_dir, config.download_data)[1]
              for split in (spec.train_split, spec.eval_split)]
    plan = Plan.make(config, *counts, num_replicas=config.cpu_replicas)
    schedule = _schedule(config, plan)
    os.makedirs(config.model_dir, exist_ok=True)
    path = os.path.join(config.model_dir, "lr_schedule.png")
    with open(path, "wb") as f:
        f.write(figures.png_bytes(figures.schedule(
            schedules.sample_points(schedule, 200), plan.steps_per_epoch,
            f"{config.lr_schedule} schedule: {config.model} on {config.dataset}, "
            f"{plan.total_steps} steps")))
    logging.info("LR schedule %s: %s", config.lr_schedule, schedules.describe(schedule))
    return path


def _build_state(config: Config, spec: sources.DatasetSpec, plan: Plan, precision: str):
    """Model, schedule, optimizer (built) and step counter; call inside the scope."""
    try:
        model = models.build(config.model, spec.num_classes, inputs.image_shape(config, spec),
                             tiny=config.model_size == "tiny", weights=config.weights)
    except ValueError as err:  # bad weights file, image too small for the model, ...
        raise ConfigError(str(err)) from err
    schedule = _schedule(config, plan)
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


def train_and_evaluate(config: Config, display: IO | None = None) -> dict:
    """Trains `config` in config.model_dir (resuming if a checkpoint is there),
    evaluates, saves `model.weights.h5`, `metrics.json`, `summary.png` and
    TensorBoard summaries; returns the metrics. display: where the live progress bar
    goes if it is a terminal (default stderr; otherwise plain log lines)."""
    runtime, precision, jit, is_chief, task_id = _set_up(config)
    strategy = runtime.strategy
    spec = sources.get_spec(config.dataset)
    if is_chief:  # so that predict and export work without the data files
        inference.keep_dataset_description(config.dataset, config.model_dir)
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
    start_step = int(step_var.numpy())
    if restored:
        logging.info("Resumed from %s at step %d", restored, start_step)
    manager = checkpoints.make_manager(config.model_dir, checkpoint,
                                       config.keep_checkpoints, is_chief, task_id)
    with inputs.data_errors_explained(spec):  # the training cache is filled here
        train_dataset, eval_dataset = inputs.distributed_datasets(
            config, spec, strategy, plan, start_step)
    # On a TPU every step is XLA-compiled anyway; an inner jit_compile is redundant.
    wrap_jit = jit and runtime.device_kind != "tpu"
    train_loop = distributed.make_train_loop(strategy, model, optimizer,
                                             config.batch_size, wrap_jit, config.on_nan,
                                             config.label_smoothing)
    evaluate = _evaluator(config, spec, strategy, model, optimizer, eval_dataset,
                          plan.eval_steps, wrap_jit, is_chief)
    display = display or sys.stderr
    bars = (progress_bar.EpochBars(plan.total_steps, plan.steps_per_epoch, display)
            if is_chief and progress_bar.is_live_terminal(display) else None)
    run = _Run(config, plan, step_var, manager, optimizer, schedule,
               reporting.Progress(plan.total_steps, plan.steps_per_epoch,
                                  config.batch_size, start_step, bars),
               recorder_lib.Recorder(config.model_dir, is_chief, start_step,
                                     spec.class_names, f"{config.model} on {config.dataset}"),
               strategy_lib.is_multi_worker(strategy))
    with inputs.data_errors_explained(spec), faults.SigtermWatcher() as sigterm, (
            bars.above_the_bar() if bars else contextlib.nullcontext()):
        step = _train(run, iter(train_dataset), train_loop, evaluate, sigterm)
    with averaging.averaged_weights(optimizer):  # save (and checksum) what was evaluated
        metrics = _finish(run, model, step, dict(runtime=runtime, precision=precision,
                                                 jit=jit, is_chief=is_chief))
    if run.multi_worker:  # leave together: the chief hosts the coordination
        strategy.reduce(tf.distribute.ReduceOp.SUM,  # service the others still use
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
    return metrics


def _set_up(config: Config):
    """The strategy and the settings that follow from the device; model_dir checked;
    precision policy, seeds and determinism set. Returns (runtime, precision, jit,
    is_chief, task_id)."""
    runtime = strategy_lib.create(config.strategy, config.tpu, config.require_tpu,
                                  config.cpu_replicas)
    precision = strategy_lib.resolve_precision(config.precision, runtime.device_kind,
                                               config.deterministic)
    jit = strategy_lib.resolve_jit(config.jit_compile, runtime.device_kind)
    is_chief, task_id = strategy_lib.worker_role(runtime.strategy)
    checkpoints.prepare_model_dir(config.model_dir, config.as_dict(), is_chief)
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    return runtime, precision, jit, is_chief, task_id


def _evaluator(config: Config, spec: sources.DatasetSpec, strategy, model, optimizer,
               eval_dataset, eval_steps: int, jit: bool, is_chief: bool):
    """evaluate() -> the metrics, confusion matrix and (on the chief, which draws
    the pictures) sample predictions of the evaluated weights (the average with
    --ema_decay, and the raw ones' accuracy too)."""
    samples = None
    if is_chief:
        with inputs.data_errors_explained(spec):
            samples = evaluation.load_samples(spec, inputs.image_shape(config, spec)[0],
                                              config.data_dir, config.download_data)
    classes = spec.num_classes
    eval_loop = distributed.make_eval_loop(
        strategy, model, jit, config.tta_flip,
        confusion_classes=classes if classes <= evaluation.MAX_CONFUSION_CLASSES else 0)
    return lambda: averaging.evaluate_raw_and_averaged(
        lambda: evaluation.evaluate(eval_loop, eval_dataset, eval_steps, model, samples,
                                    spec, config.tta_flip), optimizer)


@dataclasses.dataclass(frozen=True)
class _Run:
    """The state the outer loop drives."""
    config: Config
    plan: Plan
    step_var: tf.Variable
    manager: tf.train.CheckpointManager
    optimizer: keras.optimizers.Optimizer
    schedule: schedules.WarmupSchedule
    progress: reporting.Progress
    recorder: recorder_lib.Recorder
    multi_worker: bool


def _train(run: _Run, train_iterator, train_loop, evaluate, sigterm) -> int:
    """Train to plan.total_steps; log, evaluate and checkpoint on the way. Returns
    the last step."""
    config, plan, progress = run.config, run.plan, run.progress
    step = int(run.step_var.numpy())
    every = {"eval": config.eval_every or plan.steps_per_epoch,
             "checkpoint": config.checkpoint_every or plan.steps_per_epoch,
             "log": config.log_every or plan.steps_per_epoch}
    wall, evaluated = reporting.Stopwatch(), False
    due = lambda name: step % every[name] == 0 or step == plan.total_steps  # noqa: E731
    while step < plan.total_steps:
        # Also back in Python at every epoch's end: the progress bar starts anew there.
        stop = _next_stop(step, plan.total_steps, config.steps_per_loop,
                          plan.steps_per_epoch, *every.values())
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
        run.step_var.assign(step)
        learning_rate = float(run.schedule(run.optimizer.iterations))
        progress.show(step, learning_rate)
        # One worker alone cannot stop: in multi-worker runs, wait for the summed flag.
        if sums["stop_requested"] > 0 or (sigterm.requested and not run.multi_worker):
            run.manager.save(checkpoint_number=step)
            run.recorder.save()
            raise faults.Preempted(f"preempted (SIGTERM): saved a checkpoint at step "
                                   f"{step} in {config.model_dir}; run the same command "
                                   f"to resume")
        if due("log"):
            run.recorder.train(progress.log(step, learning_rate))
        if due("eval"):
            _evaluate(run, evaluate, step, wall)
            evaluated = step == plan.total_steps
        if due("checkpoint"):
            run.manager.save(checkpoint_number=step)
            run.recorder.save()
    if not evaluated:  # e.g. resumed after the last step: the pictures need one
        _evaluate(run, evaluate, step, wall)
    return step


def _evaluate(run: _Run, evaluate, step: int, wall: reporting.Stopwatch) -> None:
    result = evaluate()
    raw = (f"  (raw weights: {result['test_accuracy_raw']:.4f})"
           if "test_accuracy_raw" in result else "")
    logging.info("eval at step %d (epoch %.2f): test loss %.4f  test accuracy %.4f%s  "
                 "(%d examples)", step, step / run.plan.steps_per_epoch,
                 result["test_loss"], result["test_accuracy"], raw,
                 result["test_examples"])
    run.recorder.eval({"step": step, "epoch": step / run.plan.steps_per_epoch,
                       "wall_seconds": wall.elapsed(),
                       "train_seconds": run.progress.train_seconds, **result})


def _finish(run: _Run, model, step: int, context: dict) -> dict:
    """Write the weights, metrics.json and summary.png (chief only); return the
    metrics."""
    config, plan, runtime = run.config, run.plan, context["runtime"]
    progress, history = run.progress, run.recorder.eval_history
    last_train = run.recorder.train_history[-1] if run.recorder.train_history else {}
    metrics = {
        **history[-1],
        "best_test_accuracy": max(e["test_accuracy"] for e in history),
        **{k: last_train[k] for k in ("train_loss", "train_accuracy") if k in last_train},
        "train_seconds": history[-1]["train_seconds"],
        "images_per_second": progress.images_per_second(step),
        "steps": step, "epochs": step / plan.steps_per_epoch,
        "resumed_from_step": progress.start_step,
        "skipped_steps": progress.skipped_steps,
        "weights_sha256": reporting.weights_checksum(model),
        "model": config.model, "dataset": config.dataset,
        "strategy": type(runtime.strategy).__name__, "replicas": runtime.num_replicas,
        "device": runtime.device_kind, "precision": context["precision"],
        "jit_compile": context["jit"], "global_batch_size": config.batch_size,
        "per_replica_batch_size": plan.per_replica_batch,
    }
    if context["is_chief"]:
        model.save_weights(os.path.join(config.model_dir, inference.WEIGHTS_FILE))
    metrics = run.recorder.finish(metrics, schedules.sample_points(run.schedule, 200),
                                  plan.steps_per_epoch)
    logging.info("Done: test accuracy %.4f on %d examples, %.1f s training, %.0f img/s",
                 metrics["test_accuracy"], metrics["test_examples"],
                 metrics["train_seconds"], metrics["images_per_second"])
    return metrics
