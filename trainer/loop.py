"""The outer loop, one function read top to bottom: devices, data, the run's state
(models, optimizers, step counter) under the strategy, restore, then train / log /
evaluate / checkpoint, then the final outputs. The math of one step is the task's
(trainer/step.py by default); running it on every replica is
trainer/distributed.py.
"""
import contextlib
import functools
import os
import sys
from typing import IO

from absl import logging
import tensorflow as tf

from data import files, sources
from trainer import averaging, build, callbacks as callbacks_lib, checkpoints, distributed
from trainer import evaluation, faults, locks
from trainer import flops, inputs, provenance, run_dir, schedules
from trainer import strategy as strategy_lib
from trainer import config as config_lib
from trainer.config import Config
from trainer.output import figures, histograms, hparams, startup
from trainer.output import recorder as recorder_lib
from trainer.output import progress as progress_lib


def plot_schedule(settings: schedules.ScheduleSettings, plan: build.Plan,
                  model_dir: str, title: str) -> str:
    """Writes the run's learning-rate schedule to model_dir/lr_schedule.png (the
    data is only counted, nothing is trained); returns the path."""
    schedule = settings.make(plan.total_steps, plan.steps_per_epoch)
    tf.io.gfile.makedirs(model_dir)
    path = os.path.join(model_dir, "lr_schedule.png")
    files.write_atomically(path, figures.png_bytes(figures.schedule(
        schedules.sample_points(schedule, 200), plan.steps_per_epoch,
        f"{settings.lr_schedule} schedule: {title}, {plan.total_steps} steps")))
    logging.info("LR schedule %s: %s", settings.lr_schedule, schedules.describe(schedule))
    return path


def _next_stop(step: int, total: int, steps_per_loop: int, *intervals: int,
               marks: tuple[int, ...] = ()) -> int:
    """The next step at which the loop must return to Python: a multiple of an
    interval, or one of the `marks`."""
    stops = [total, step + steps_per_loop, *(m for m in marks if m > step)]
    stops += [(step // i + 1) * i for i in intervals if i > 0]
    return min(stops)


@functools.lru_cache(maxsize=16)
def _steps_tensor(steps: int) -> tf.Tensor:
    """A loop call's step count as a tensor, made once per value (an eager op a
    call otherwise, at --steps_per_loop=1 a step)."""
    return tf.constant(steps)


def train_and_evaluate(config: Config, display: IO | None = None,
                       stop_signals: faults.StopSignals | None = None,
                       extra_callbacks: tuple = ()) -> dict:
    """Trains `config` in config.model_dir (resuming from its checkpoint), evaluates,
    saves model.weights.h5, metrics.json, summary.png and TensorBoard summaries;
    returns the final metrics. display: the live progress bar's terminal (default
    stderr); stop_signals: the command's watcher (default: one for the steps);
    extra_callbacks: beside the run's own (trainer/callbacks.py), e.g. lr_find's."""
    stop_signals = stop_signals or faults.StopSignals()
    # The time to the first step, phase by phase, and a line every 10 s in each.
    start_up = startup.StartUp()
    # --- Devices, precision, seeds --------------------------------------------------
    with start_up.phase("setting up the devices"):
        runtime = strategy_lib.set_up(config.group(strategy_lib.DeviceSettings),
                                      config.deterministic, config.seed)
    strategy, precision, jit = runtime.strategy, runtime.precision, runtime.jit
    is_chief, task_id = strategy_lib.worker_role(strategy)

    # --- How much data, how many steps ----------------------------------------------
    run_dir.check_previous_run(config.model_dir, config.as_dict())  # (reads only)
    with start_up.phase("reading the dataset's description"):
        data = build.run_data(config)
    spec = data.spec
    plan = build.plan(config, spec, runtime.num_replicas)
    profile = config.group(config_lib.LoopSettings).profile_range(plan.total_steps)
    finished = checkpoints.finished_run(config.model_dir, plan.total_steps)
    if finished is not None:  # a rerun of a finished run changes nothing
        progress_lib.log_finished(config.model_dir, finished)
        return finished

    # --- Task, state and checkpoint, built under the strategy -------------------------
    # (trainer/build.py, as every command builds them; a task that does not fit the
    # model or the data stops here, before anything is written to model_dir)
    with start_up.phase("building the model and the step"):
        run = build.build_run(config, spec, plan, strategy, precision)
    task, state, schedule = run.task, run.state, run.schedule
    where = provenance.collect(f"{runtime.name}: {runtime.num_replicas} x "
                               f"{runtime.device_kind}")
    run_dir.prepare_model_dir(config.model_dir, config.as_dict(), is_chief, where)
    if is_chief:  # so that predict and export work without the data files
        sources.keep_description(config.dataset, config.model_dir)
    # The run's callbacks (trainer/callbacks.py), saved in every checkpoint beside
    # the state, so their own state resumes with it.
    tensorboard = [hparams.HParams(), *([histograms.Histograms()] if config.histograms
                                        else [])]
    run_callbacks = callbacks_lib.for_run(config, task, tensorboard, extra_callbacks)
    # The step's arithmetic, counted once, for the GFLOP/s of every log line.
    with start_up.phase("counting the step's FLOPs"):
        flops_per_image = build.training_flops_per_image(run)
        peak = (flops.run_peak_flops(precision, strategy, runtime.device_kind)
                if config.measure_peak else 0.0)
    progress_lib.log_setup(run, runtime, flops_per_image, peak)
    with strategy.scope(), start_up.phase("restoring"):  # all the state holds
        manager = checkpoints.resume(state, run_callbacks, config.model_dir,
                                     config.keep_checkpoints, is_chief, task_id,
                                     config.async_checkpoints)
    # state.step is the one step counter: schedules, data position, draws, logs.
    start_step = int(state.step.numpy())
    if strategy_lib.is_multi_worker(strategy):  # all from the same checkpoint, or none
        checkpoints.check_same_step(strategy, start_step)

    # --- Input pipelines: the stream resumes at the step ----------------------------
    with start_up.phase("preparing the input (filling the cache, if in memory)"):
        pipelines = inputs.distribute(strategy, data, plan.train_examples, start_step,
                                      plan.total_steps, run.task_input)
    with inputs.data_errors_explained(spec):  # only the chief draws pictures
        samples = (evaluation.load_samples(spec, data.image_shape[0], config.data_dir,
                                           config.download_data) if is_chief else None)

    # --- The step on every replica ---------------------------------------------------
    wrap_jit = jit and runtime.device_kind != "tpu"  # a TPU compiles the whole loop
    train_loop = distributed.make_train_loop(strategy, run.train_steps, wrap_jit,
                                             state=state)
    eval_loop = distributed.make_eval_loop(strategy, run.eval_step, wrap_jit)
    splits = evaluation.SplitMapper(strategy, data, state, cache=pipelines.in_memory)
    # A stop signal ends an evaluation between its steps (a worker that can stop alone).
    stop_requested = stop_signals.poll(alone=not strategy_lib.is_multi_worker(strategy))

    # --- What people see --------------------------------------------------------------
    progress = progress_lib.Progress.for_run(
        plan, start_step, config.batch_size, (display or sys.stderr) if is_chief else None,
        flops_per_image, peak)
    recorder = recorder_lib.Recorder(config.model_dir, is_chief, start_step, task,
                                     f"{config.model} on {config.dataset}", config.settings())
    wall = progress_lib.Stopwatch()
    run_callbacks.train_begin(callbacks_lib.Context.of(run, start_step, is_chief))

    def stop_here(at_step: int) -> None:
        """A stop signal: this step saved, exit 75; the same command resumes."""
        locks.check_held(config.model_dir)
        checkpoints.save(manager, at_step, state, wait=True)  # (metrics.json: "stopped")
        raise faults.Preempted(f"stopped by {stop_signals.signal}: saved a checkpoint at step "
                               f"{at_step} in {config.model_dir}; run the same command "
                               f"to resume")

    def record_evaluation(at_step: int) -> None:
        """Evaluates (the average with --ema_decay, then the raw weights too)."""
        try:
            result = averaging.evaluate_raw_and_averaged(
                lambda: evaluation.evaluate(eval_loop, pipelines.eval, plan, spec, task,
                                            run.output_model, samples, state, splits,
                                            stop_requested), state)
        except evaluation.Stopped:
            stop_here(at_step)
        record = recorder.eval({"step": at_step, "epoch": at_step / plan.steps_per_epoch,
                                "wall_seconds": wall.elapsed(),
                                "train_seconds": progress.train_seconds, **result})
        if recorder.improved(record):  # keep the best weights
            recorder.save_evaluated_weights(checkpoints.BEST_WEIGHTS_FILE,
                                            run.output_model, state)
        run_callbacks.eval(at_step, {**record, **recorder.last_details}, state)

    # --- Train: in-graph loops of up to steps_per_loop steps --------------------------
    every = {"eval": config.eval_every or plan.steps_per_epoch,
             "checkpoint": config.checkpoint_every or plan.steps_per_epoch,
             "log": config.log_every or plan.steps_per_epoch}
    current, evaluated_at = start_step, None
    profiler = progress_lib.Profiler(profile if is_chief else (),  # one trace, the chief's
                                     os.path.join(config.model_dir, "train"))
    with (recorder.status_on_exit(lambda: current), inputs.data_errors_explained(spec),
          stop_signals.while_training(lambda: current), profiler.stopped_at_exit(),
          progress.live(), checkpoints.writes_finished(manager)):  # (no write left)
        train_iterator = iter(pipelines.train)
        while current < plan.total_steps:
            # Back in Python at every epoch's end too: the progress bar starts anew.
            stop = _next_stop(current, plan.total_steps, config.steps_per_loop,
                              plan.steps_per_epoch, *every.values(), marks=profiler.marks)
            first_call = current == start_step  # (start-up's last phases, timed)
            trace = lambda: train_loop.get_concrete_function(  # noqa: E731
                train_iterator, _steps_tensor(stop - current), stop_signals.flag)
            # (profiled: one step a call, marked; a stop request: fewer steps)
            with start_up.first_call(first_call, trace, current, stop, wrap_jit), \
                    profiler.step(current, stop), progress_lib.Stopwatch() as watch:
                sums, stopping = train_loop(train_iterator, _steps_tensor(stop - current),
                                            stop_signals.flag)
                sums = tf.nest.map_structure(lambda t: t.numpy(), sums)  # waits
            stop = current + int(sums.pop(distributed.STEPS_DONE)[0])
            if first_call:  # what start-up cost, phase by phase
                progress_lib.log_first_steps(current + 1, stop, start_up,
                                             train_loop, train_iterator, stop_signals.flag)
            nonfinite_at = int(sums.pop(distributed.NONFINITE_AT)[0])
            counted = int(sums.pop(distributed.STEP_COUNTER)[0])
            skipped = progress.add(sums, stop - current, watch.seconds)
            faults.check_steps(nonfinite_at, skipped, config.on_nan, current + 1, stop,
                               state, manager.latest_checkpoint, counted)
            current = stop
            learning_rate = lambda: float(schedule(current))  # noqa: E731  (when shown)
            progress.show(current, learning_rate)
            if float(stopping) > 0 or stop_requested():
                stop_signals.signal = stop_signals.signal or "another worker's signal"
                stop_here(current)
            due = lambda name: (current % every[name] == 0  # noqa: E731
                                or current == plan.total_steps)
            if due("log"):
                run_callbacks.log(current, recorder.train(progress.log(current,
                                                                       learning_rate())))
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
    weights_sha256 = recorder.save_evaluated_weights(checkpoints.WEIGHTS_FILE,
                                                     run.output_model, state)
    metrics = {
        **progress.summary(current), "steps": current, "epochs": current / plan.steps_per_epoch,
        **({"stopped_early": run_callbacks.stop_reason} if run_callbacks.stop_reason
           else {}),
        "resumed_from_step": start_step, "weights_sha256": weights_sha256,
        **run.about(), **runtime.about(), "provenance": where,
        "state_sha256": progress_lib.state_checksum(state)}  # (raw, all of it)
    metrics = recorder.finish(metrics, schedules.sample_points(schedule, 200),
                              plan.steps_per_epoch)
    run_callbacks.train_end(metrics)
    progress_lib.log_done(recorder.describe(metrics), metrics)
    strategy_lib.leave_together(strategy)  # the chief hosts the coordination service
    return metrics
