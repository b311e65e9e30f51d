"""The outer loop, one function read top to bottom: devices, data, the run's state
(models, optimizers, step counter) under the strategy, restore, then train / log /
evaluate / checkpoint, then the final outputs. The math of one step is the task's
(trainer/step.py by default); running it on every replica is
trainer/distributed.py.
"""
import contextlib
import os
import sys
from typing import IO

from absl import logging
import keras
import tensorflow as tf

from data import files, sources
import models
from trainer import averaging, build, callbacks as callbacks_lib, checkpoints, distributed
from trainer import evaluation, faults, locks
from trainer import flops, inputs, provenance, randomness, schedules
from trainer import strategy as strategy_lib
from trainer import config as config_lib
from trainer.config import Config, ConfigError
from trainer.output import figures, histograms, hparams, progress_bar
from trainer.output import recorder as recorder_lib
from trainer.output import progress as progress_lib


def plot_schedule(config: Config) -> str:
    """Writes the run's learning-rate schedule to model_dir/lr_schedule.png (the
    data is only counted, nothing is trained); returns the path."""
    plan = build.plan(config, build.dataset_spec(config), config.cpu_replicas)
    schedule = build.make_schedule(config, plan)
    tf.io.gfile.makedirs(config.model_dir)
    path = os.path.join(config.model_dir, "lr_schedule.png")
    files.write_atomically(path, figures.png_bytes(figures.schedule(
        schedules.sample_points(schedule, 200), plan.steps_per_epoch,
        f"{config.lr_schedule} schedule: {config.model} on {config.dataset}, "
        f"{plan.total_steps} steps")))
    logging.info("LR schedule %s: %s", config.lr_schedule, schedules.describe(schedule))
    return path


@contextlib.contextmanager
def _profiler_stopped_at_exit():
    """A run that ends (or fails) between --profile_steps' A and B still stops the
    profiler, so the next run in this process can start one."""
    try:
        yield
    finally:
        try:
            tf.profiler.experimental.stop()
        except tf.errors.UnavailableError:  # stopped at B already
            pass


def _next_stop(step: int, total: int, steps_per_loop: int, *intervals: int,
               marks: tuple[int, ...] = ()) -> int:
    """The next step at which the loop must return to Python: a multiple of an
    interval, or one of the `marks`."""
    stops = [total, step + steps_per_loop, *(m for m in marks if m > step)]
    stops += [(step // i + 1) * i for i in intervals if i > 0]
    return min(stops)


def _warn_of_stateful_random_ops(train_loop, iterator) -> None:
    """One warning line if the traced step draws with a stateful random op: its
    numbers differ on each replica and after a resume (trainer/randomness.py)."""
    graph = train_loop.get_concrete_function(iterator, tf.constant(1),
                                             tf.constant(0.0)).graph
    found = randomness.stateful_random_ops(graph)
    if found:
        logging.warning("the step draws with a stateful random op, %s: replicas draw "
                        "other numbers and a resumed run too; draw from "
                        "trainer.randomness (step_seed, per_example_normal, ...)",
                        "; ".join(found[:3]) + (" ..." if len(found) > 3 else ""))


def train_and_evaluate(config: Config, display: IO | None = None,
                       stop_signals: faults.StopSignals | None = None,
                       extra_callbacks: tuple = ()) -> dict:
    """Trains `config` in config.model_dir (resuming if a checkpoint is there),
    evaluates, saves `model.weights.h5`, `metrics.json`, `summary.png` and
    TensorBoard summaries; returns the final metrics. display: where the live
    progress bar goes if it is a terminal (default stderr; else plain log lines).
    stop_signals: the command's stop-signal watcher (installed before this is called),
    else one installed for the training steps. extra_callbacks: callbacks
    (trainer/callbacks.py) beside the run's own, e.g. trainer.tools.lr_find's."""
    stop_signals = stop_signals or faults.StopSignals()
    since_start = progress_lib.Stopwatch()  # for the time to the first step
    # --- Devices, precision, seeds --------------------------------------------------
    runtime = strategy_lib.create(config.strategy, config.tpu, config.require_tpu,
                                  config.cpu_replicas)
    strategy = runtime.strategy
    precision = strategy_lib.resolve_precision(config.precision, runtime.device_kind,
                                               config.deterministic)
    jit = strategy_lib.resolve_jit(config.jit_compile, runtime.device_kind,
                                 runtime.num_replicas)
    is_chief, task_id = strategy_lib.worker_role(strategy)
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()

    # --- How much data, how many steps ----------------------------------------------
    checkpoints.check_previous_run(config.model_dir, config.as_dict())  # (reads only)
    spec = build.dataset_spec(config)
    logging.info("Model input: %s (%s's input_range)",
                 models.INPUT_RANGES[models.entry(config.model).input_range], config.model)
    plan = build.plan(config, spec, runtime.num_replicas)
    profile = (config_lib.profile_range(config.profile_steps) if config.profile_steps
               else ())
    if profile and profile[1] > plan.total_steps:
        raise ConfigError(f"--profile_steps={config.profile_steps}: the run has "
                          f"{plan.total_steps} steps; profile steps within it")

    finished = checkpoints.finished_run(config.model_dir, plan.total_steps)
    if finished is not None:  # a rerun of a finished run changes nothing
        logging.info("The run in %s is finished (%d steps%s; its metrics.json and "
                     "weights are kept as they are); nothing to do. %s", config.model_dir,
                     finished["steps"], f": {finished['stopped_early']}"
                     if finished.get("stopped_early") else "",
                     "Another --model_dir trains anew" if finished.get("stopped_early")
                     else "A larger --train_steps or --epochs trains it further")
        return finished

    # --- Task, state and checkpoint, built under the strategy -------------------------
    # (trainer/build.py, as every command builds them; a task that does not fit the
    # model or the data stops here, before anything is written to model_dir)
    run = build.build_run(config, spec, plan, strategy, precision)
    task, state, schedule = run.task, run.state, run.schedule
    where = provenance.collect(f"{runtime.name}: {runtime.num_replicas} x "
                               f"{runtime.device_kind}")
    checkpoints.prepare_model_dir(config.model_dir, config.as_dict(), is_chief, where)
    if is_chief:  # so that predict and export work without the data files
        sources.keep_description(config.dataset, config.model_dir)
    # The run's callbacks (trainer/callbacks.py): saved in every checkpoint beside
    # the state, so their own state resumes with it.
    tensorboard = [hparams.HParams(), *([histograms.Histograms()] if config.histograms
                                        else [])]
    run_callbacks = callbacks_lib.Callbacks([*callbacks_lib.for_run(config, task,
                                                                    tensorboard),
                                             *extra_callbacks])
    with strategy.scope():  # everything the state holds, all of it restored
        checkpoint = checkpoints.training_checkpoint(state)
    progress_lib.log_setup(config, spec, runtime, plan, precision, jit, schedule, state,
                           run.step_options)
    # The step's arithmetic, counted once, for the GFLOP/s of every log line.
    flops_per_image = build.training_flops_per_image(run)
    peak = (flops.run_peak_flops(precision, strategy, runtime.device_kind)
            if config.measure_peak else 0.0)
    logging.info("%.0f MFLOP per training image%s", flops_per_image / 1e6,
                 f"; the run's {precision} matmul peak {peak / 1e9:.0f} GFLOP/s"
                 if peak else "")
    # (partial: the file also holds the callbacks' state, restored below)
    restored = checkpoints.restore_latest(checkpoint, config.model_dir, partial=True)
    # state.step is the one step counter: schedules, data position, draws, logs.
    start_step = int(state.step.numpy())
    if restored:
        logging.info("Resumed from %s at step %d", restored, start_step)
        checkpoints.restore_callbacks(run_callbacks, restored)
    if strategy_lib.is_multi_worker(strategy):  # all from the same checkpoint, or none
        checkpoints.check_same_step(strategy, start_step)
    manager = checkpoints.make_manager(
        config.model_dir, checkpoints.training_checkpoint(state, run_callbacks),
        config.keep_checkpoints, is_chief, task_id)

    # --- Input pipelines: the stream resumes at the step ----------------------------
    # In memory (decoded once, before the first step) or streamed from the files.
    mode, record_files, why = inputs.choose_mode(config, spec, plan.train_examples,
                                                 strategy_lib.num_workers(strategy))
    logging.info("Input: %s", why)
    with inputs.data_errors_explained(spec):  # the training cache is filled here
        train_counts: list[int] = []  # what each pipeline read: all that was promised?
        train_dataset = strategy.distribute_datasets_from_function(
            inputs.train_input_fn(config, spec, plan.train_examples, start_step,
                                  plan.total_steps, train_counts, mode, record_files,
                                  task))
        inputs.check_train_count(strategy, spec, train_counts, plan.train_examples)
        eval_dataset = strategy.distribute_datasets_from_function(
            inputs.eval_input_fn(config, spec, cache=mode == inputs.MEMORY_MODE))
        samples = (evaluation.load_samples(spec, inputs.image_shape(config, spec)[0],
                                           config.data_dir, config.download_data)
                   if is_chief else None)  # only the chief draws pictures

    # --- The step on every replica ---------------------------------------------------
    wrap_jit = jit and runtime.device_kind != "tpu"  # a TPU compiles the whole loop
    train_loop = distributed.make_train_loop(strategy, run.train_step, wrap_jit,
                                             state=state)
    eval_loop = distributed.make_eval_loop(strategy, run.eval_step, wrap_jit)
    splits = evaluation.SplitMapper(strategy, config, spec, state,
                                    cache=mode == inputs.MEMORY_MODE)

    multi_worker = strategy_lib.is_multi_worker(strategy)
    # A stop signal ends an evaluation between its steps (one worker of several
    # cannot stop alone: the others would wait in a collective).
    stop_requested = (lambda: False) if multi_worker else (lambda: stop_signals.requested)

    def evaluate() -> dict:
        """The evaluated weights' metrics (the average with --ema_decay, and then
        the raw weights' metrics too)."""
        return averaging.evaluate_raw_and_averaged(
            lambda: evaluation.evaluate(eval_loop, eval_dataset, plan, spec, task,
                                        run.output_model, samples, state, splits,
                                        stop_requested),
            state)

    # --- What people see --------------------------------------------------------------
    display = display or sys.stderr
    bars = (progress_bar.EpochBars(plan.total_steps, plan.steps_per_epoch, display)
            if is_chief and progress_bar.is_live_terminal(display) else None)
    progress = progress_lib.Progress(plan.total_steps, plan.steps_per_epoch,
                                     config.batch_size, start_step, bars,
                                     flops_per_image, peak)
    recorder = recorder_lib.Recorder(config.model_dir, is_chief, start_step, task,
                                     f"{config.model} on {config.dataset}", config)
    wall = progress_lib.Stopwatch()
    context = callbacks_lib.Context(config, config.model_dir, task, state,
                                    plan.steps_per_epoch, plan.total_steps, start_step,
                                    is_chief)
    run_callbacks.train_begin(context)

    def stop_here(at_step: int) -> None:
        """A stop signal (SIGTERM, SIGINT, SIGHUP): this step saved, then the
        command exits 75 and the same command resumes."""
        locks.check_held(config.model_dir)
        checkpoints.save(manager, at_step, state)  # (metrics.json: recorder's "stopped")
        raise faults.Preempted(f"stopped by {stop_signals.signal}: saved a checkpoint at step "
                               f"{at_step} in {config.model_dir}; run the same command "
                               f"to resume")

    def record_evaluation(at_step: int) -> None:
        try:
            result = evaluate()
        except evaluation.Stopped:
            stop_here(at_step)
        logging.info("eval at step %d (epoch %.2f): %s  (%d examples)", at_step,
                     at_step / plan.steps_per_epoch,
                     progress_lib.format_test_metrics(result), result["test_examples"])
        record = recorder.eval({"step": at_step, "epoch": at_step / plan.steps_per_epoch,
                                "wall_seconds": wall.elapsed(),
                                "train_seconds": progress.train_seconds, **result})
        if is_chief and recorder.improved(record):  # keep the best weights
            locks.check_held(config.model_dir)  # (still this process's directory?)
            with averaging.averaged_weights(state):  # (those just evaluated)
                checkpoints.save_weights(run.output_model, os.path.join(
                    config.model_dir, checkpoints.BEST_WEIGHTS_FILE))
        run_callbacks.eval(at_step, {**record, **recorder.last_details}, state)

    # --- Train: in-graph loops of up to steps_per_loop steps --------------------------
    every = {"eval": config.eval_every or plan.steps_per_epoch,
             "checkpoint": config.checkpoint_every or plan.steps_per_epoch,
             "log": config.log_every or plan.steps_per_epoch}
    current, evaluated_at = start_step, None
    profile = profile if is_chief else ()  # one trace, the chief's
    profiling = False
    with recorder.status_on_exit(lambda: current), inputs.data_errors_explained(spec), (
            stop_signals.while_training()), (
            bars.above_the_bar() if bars else contextlib.nullcontext()), (
            _profiler_stopped_at_exit() if profile else contextlib.nullcontext()):
        train_iterator = iter(train_dataset)
        while current < plan.total_steps:
            # Back in Python at every epoch's end too: the progress bar starts anew.
            stop = _next_stop(current, plan.total_steps, config.steps_per_loop,
                              plan.steps_per_epoch, *every.values(), marks=profile)
            if profile and current == profile[0]:  # a trace for TensorBoard's Profile tab
                tf.profiler.experimental.start(os.path.join(config.model_dir, "train"))
                profiling = True
            if current == start_step:  # (otherwise silent for a while)
                logging.info("Tracing the step%s; the first steps follow",
                             " and compiling it with XLA" if jit else "")
            with progress_lib.Stopwatch() as watch:
                sums, stopping = train_loop(train_iterator,
                                                  tf.constant(stop - current),
                                                  tf.constant(float(stop_signals.requested)))
                sums = tf.nest.map_structure(lambda t: t.numpy(), sums)  # waits
            nonfinite_at = int(sums.pop(distributed.NONFINITE_AT)[0])
            if profiling and stop >= profile[1]:
                tf.profiler.experimental.stop()
                profiling = False
                logging.info("profiler trace of steps %d-%d in %s (TensorBoard's Profile "
                             "tab; python -m trainer.tools.profile_summary --logdir=%s)",
                             profile[0], profile[1], os.path.join(config.model_dir, "train"),
                             config.model_dir)
            if current == start_step:  # what start-up costs: building, caching, tracing
                logging.info("Steps %d-%d done %.1f s after the start", current + 1, stop,
                             since_start.elapsed())
                _warn_of_stateful_random_ops(train_loop, train_iterator)
            if nonfinite_at:  # no copy to undo it: stop before anything is saved
                raise faults.diverged(
                    f"step {nonfinite_at} left a weight non-finite "
                    f"({', '.join(state.nonfinite()[:3])})", manager.latest_checkpoint,
                    "lower the learning rate, or check the step's arithmetic")
            skipped = progress.add(sums, stop - current, watch.seconds)
            if skipped and config.on_nan == "stop":
                raise faults.diverged(
                    f"non-finite loss or gradient at {skipped} step(s) in steps "
                    f"{current + 1}-{stop} (those updates were not applied)",
                    manager.latest_checkpoint,
                    "lower the learning rate, or pass --on_nan=skip_step")
            current = stop
            if current != int(state.step.numpy()):
                raise RuntimeError(f"the step counter must advance once per step, by the "
                                   f"wrapper alone (at step {current} it is "
                                   f"{int(state.step.numpy())}): a task's step must not "
                                   f"assign state.step")
            learning_rate = float(schedule(current))  # that of the next step
            progress.show(current, learning_rate)
            # One worker alone cannot stop: in multi-worker runs, wait for the sum.
            if float(stopping) > 0 or stop_requested():
                stop_signals.signal = stop_signals.signal or "another worker's signal"
                stop_here(current)
            due = lambda name: (current % every[name] == 0  # noqa: E731
                                or current == plan.total_steps)
            if due("log"):
                run_callbacks.log(current, recorder.train(progress.log(current,
                                                                       learning_rate)))
            if due("eval"):
                record_evaluation(current)
                evaluated_at = current
            if due("checkpoint"):
                locks.check_held(config.model_dir)
                checkpoints.save(manager, current, state)
                recorder.save()
                run_callbacks.checkpoint(current, manager.latest_checkpoint)
            if run_callbacks.stop_reason:  # (the same on every worker)
                logging.info("%s: the run ends at step %d", run_callbacks.stop_reason,
                             current)
                break
        if evaluated_at != current:  # e.g. resumed after the last step: the pictures
            record_evaluation(current)  # need one

    # --- Final outputs (chief only), with the evaluated weights -----------------------
    history = recorder.eval_history
    last_train = recorder.train_history[-1] if recorder.train_history else {}
    with averaging.averaged_weights(state):
        metrics = {
            **history[-1],
            **{k: v for k, v in last_train.items() if k.startswith("train_")},
            "train_seconds": history[-1]["train_seconds"],
            "images_per_second": progress.images_per_second(current),
            "input_wait_fraction": progress.input_wait_fraction(),  # None: not timed
            "peak_memory_gib": progress_lib.peak_memory_bytes() / 2**30,
            **progress.flop_rates(current),
            "steps": current, "epochs": current / plan.steps_per_epoch,
            **({"stopped_early": run_callbacks.stop_reason}
               if run_callbacks.stop_reason else {}),
            "resumed_from_step": start_step, "skipped_steps": progress.skipped_steps,
            "weights_sha256": progress_lib.weights_checksum(run.output_model),
            "task": config.task, "model": config.model, "dataset": config.dataset,
            "strategy": runtime.name, "replicas": runtime.num_replicas,
            "device": runtime.device_kind, "precision": precision, "jit_compile": jit,
            "global_batch_size": config.batch_size,
            "per_replica_batch_size": plan.per_replica_batch,
            "settings": config.as_dict(), "provenance": where,
        }
        if is_chief:
            locks.check_held(config.model_dir)
            checkpoints.save_weights(run.output_model, os.path.join(
                config.model_dir, checkpoints.WEIGHTS_FILE))
    metrics["state_sha256"] = progress_lib.state_checksum(state)  # (raw, all of it)
    metrics = recorder.finish(metrics, schedules.sample_points(schedule, 200),
                              plan.steps_per_epoch)
    run_callbacks.train_end(metrics)
    logging.info("Done: %s on %d examples, %.1f s training, %.0f img/s%s, peak "
                 "memory %.2f GiB", recorder.describe(metrics), metrics["test_examples"],
                 metrics["train_seconds"], metrics["images_per_second"],
                 progress_lib.input_text(metrics["input_wait_fraction"]),
                 metrics["peak_memory_gib"])
    if multi_worker:  # leave together: the chief hosts the coordination service
        strategy.reduce(tf.distribute.ReduceOp.SUM,  # that the others still use
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
    return metrics
