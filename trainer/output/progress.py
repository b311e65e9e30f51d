"""Progress lines, images/sec, ETA, the set-up log lines, what the first steps
and the end say, the profiler's trace, and the weights' checksum."""
import contextlib
import dataclasses
import hashlib
import math
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf

from absl import logging

import models
from trainer import distributed, randomness, schedules
from trainer.output import console, progress_bar, startup


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# The live bar's fields by how long they stay as the terminal narrows: the ETAs
# longest, the skipped-update count (also a warning line) first to go.
(_ETA, _MAIN_METRIC, _METRIC, _LEARNING_RATE, _IMAGES_PER_SECOND, _FLOPS,
 _SKIPPED) = range(7)


SHOW_EVERY = 0.2  # seconds between the live bar's redraws (tqdm's own: 0.5)
_clock = time.monotonic  # (a test's own clock)


class Progress:
    """Accumulates the step's metric sums for the log lines (every --log_every steps,
    off a terminal) or the live bar (on one); all rates use training time only.
    Every metric the step returns is shown, in the order it returns them."""

    def __init__(self, total_steps: int, steps_per_epoch: int, global_batch_size: int,
                 start_step: int, bars: progress_bar.EpochBars | None = None,
                 flops_per_image: float = 0.0, peak_flops: float = 0.0):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.flops_per_image, self.peak_flops = flops_per_image, peak_flops
        self.global_batch_size = global_batch_size
        self.start_step = start_step
        self.train_seconds = 0.0
        self.skipped_steps = 0  # updates dropped for a non-finite gradient (--on_nan)
        self.input_wait_seconds = 0.0  # of train_seconds, spent waiting for batches
        self.input_timed = False  # whether the loop timed it (not under --deterministic)
        self.bars = bars
        self._window = _Window()  # since the last log line
        self._epoch = _Window()   # since the start of the epoch, for the bar
        self._shown_at = -math.inf  # when the bar was last drawn (time.monotonic)

    def add(self, sums: dict, num_steps: int, seconds: float) -> int:
        """Adds the sums of `num_steps` steps; returns how many were skipped."""
        sums = dict(sums)
        waited, timed = (float(v) for v in sums.pop(distributed.INPUT_WAIT, (0.0, 0)))
        self.input_wait_seconds += waited
        self.input_timed = self.input_timed or timed > 0
        self._window.waited += waited
        self._window.add(sums, num_steps, seconds)
        self._epoch.add(sums, num_steps, seconds)
        self.train_seconds += seconds
        skipped = 0
        if "skipped" in sums:  # (skipped steps, steps) summed over replicas
            total, weight = sums["skipped"]
            skipped = round(num_steps * float(total) / max(float(weight), 1e-9))
        if skipped:
            logging.warning("non-finite loss or gradient: skipped %d update(s) (%d in "
                            "this run)", skipped, self.skipped_steps + skipped)
        self.skipped_steps += skipped
        return skipped

    def input_wait_fraction(self) -> float | None:
        """Of the training time, the fraction the steps waited for their input
        (None: not timed)."""
        if not self.input_timed:
            return None
        return self.input_wait_seconds / self.train_seconds if self.train_seconds else 0.0

    @classmethod
    def for_run(cls, plan, start_step: int, global_batch_size: int, display,
                flops_per_image: float = 0.0, peak_flops: float = 0.0) -> "Progress":
        """The progress of a run of `plan` (trainer/build.py's Plan): a live bar on
        `display` if it is a terminal (None: the chief's alone shows one), else
        plain log lines."""
        bars = (progress_bar.EpochBars(plan.total_steps, plan.steps_per_epoch, display)
                if display is not None and progress_bar.is_live_terminal(display) else None)
        return cls(plan.total_steps, plan.steps_per_epoch, global_batch_size, start_step,
                   bars, flops_per_image, peak_flops)

    def live(self):
        """Within the block, log records print above the live bar (if there is one)."""
        return self.bars.above_the_bar() if self.bars else contextlib.nullcontext()

    def summary(self, step: int) -> dict:
        """What metrics.json says of the training's speed up to `step`."""
        return {"images_per_second": self.images_per_second(step),
                "input_wait_fraction": self.input_wait_fraction(),  # None: not timed
                "peak_memory_gib": peak_memory_bytes() / 2**30, **self.flop_rates(step),
                "skipped_steps": self.skipped_steps}

    def images_per_second(self, step: int) -> float:
        images = (step - self.start_step) * self.global_batch_size
        return images / self.train_seconds if self.train_seconds else 0.0

    def flop_rates(self, step: int) -> dict[str, float]:
        """The run's achieved training FLOP/s so far (and its fraction of the
        measured peak), for metrics.json."""
        rates = {"training_flops_per_image": self.flops_per_image,
                 "gflops_per_second": self.images_per_second(step)
                 * self.flops_per_image / 1e9}
        if self.peak_flops:
            rates.update(peak_gflops_per_second=self.peak_flops / 1e9,
                         fraction_of_peak=rates["gflops_per_second"] * 1e9
                         / self.peak_flops)
        return rates

    def _flops_text(self, images_per_second: float) -> str:
        rate = images_per_second * self.flops_per_image
        text = f"  {rate / 1e9:.0f} GFLOP/s"
        return text + (f" ({100 * rate / self.peak_flops:.0f}% of peak)"
                       if self.peak_flops else "")

    def _eta(self, step: int, rate: float, until: int | None = None) -> str:
        """Time to `until` (default: the end of the run) at `rate` images/sec."""
        steps_left = (until or self.total_steps) - step
        return _duration(steps_left * self.global_batch_size / max(rate, 1e-9))

    def show(self, step: int, learning_rate: float | Callable[[], float]) -> None:
        """Updates the live bar (if any) after the steps up to `step`: the epoch's
        running metrics, and the run's ETA at this epoch's speed. At most every
        SHOW_EVERY seconds, and at an epoch's or the run's end: fitting the fields
        to the width costs more than a small model's step. learning_rate: the next
        step's, or a function giving it (called only when the bar is drawn)."""
        if self.bars is None:
            return
        epoch_end = step % self.steps_per_epoch == 0 or step == self.total_steps
        now = _clock()
        if not epoch_end and now - self._shown_at < SHOW_EVERY:
            return
        self._shown_at = now
        if callable(learning_rate):
            learning_rate = learning_rate()
        means, rate = self._epoch.means(self.global_batch_size)
        epoch_end = min(self.total_steps,
                        (step - 1) // self.steps_per_epoch * self.steps_per_epoch
                        + self.steps_per_epoch)
        metrics = [(_MAIN_METRIC if index == 0 else _SKIPPED if key == "skipped"
                    else _METRIC, f"{key} {_number(value)}")
                   for index, (key, value) in enumerate(means.items())]
        self.bars.update(step, [
            *metrics, (_LEARNING_RATE, f"lr {learning_rate:.3g}"),
            (_IMAGES_PER_SECOND, f"{rate:,.0f} img/s"),
            (_FLOPS, self._flops_text(rate).strip()),
            (_ETA, (f"ETA epoch {self._eta(step, rate, epoch_end)} "
                    f"run {self._eta(step, rate)}",  # or, narrower:
                    f"ETA {self._eta(step, rate, epoch_end)}/{self._eta(step, rate)}"))])
        if step % self.steps_per_epoch == 0:
            self._epoch = _Window()

    def log(self, step: int, learning_rate: float) -> dict:
        """The values since the last call (one plain log line unless a live bar
        shows them); returns them as a train-history record, each metric as
        `train_<name>`."""
        means, rate = self._window.means(self.global_batch_size)
        waiting = (self._window.waited / self._window.seconds if self._window.seconds
                   else 0.0) if self.input_timed else None
        if self.bars is None:
            logging.info("step %d/%d  epoch %.2f  %s  lr %.3g  %.0f img/s%s%s  ETA %s",
                         step, self.total_steps, step / self.steps_per_epoch,
                         _format(means), learning_rate, rate, self._flops_text(rate),
                         input_text(waiting), self._eta(step, rate))
        self._window = _Window()
        return {"step": step, "epoch": step / self.steps_per_epoch,
                "train_seconds": self.train_seconds,
                **{f"train_{key}": value for key, value in means.items()
                   if value is not None},  # (None: every update skipped)
                "learning_rate": learning_rate, "images_per_second": rate,
                "gflops_per_second": rate * self.flops_per_image / 1e9,
                "input_wait_fraction": waiting}


INPUT_BOUND = 0.05  # waiting longer than this fraction of the time: the input limits


def input_text(fraction: float | None) -> str:
    """'  input wait 2%', '  input-bound: waited 31% of the time for data', or ''
    when the wait was not timed."""
    if fraction is None:
        return ""
    if fraction > INPUT_BOUND:
        return f"  input-bound: waited {100 * fraction:.0f}% of the time for data"
    return f"  input wait {100 * fraction:.0f}%"


def peak_memory_bytes() -> int:
    """This process's peak resident memory so far (0 where the OS does not say)."""
    try:
        import resource
    except ImportError:  # not on Linux or macOS
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def format_test_metrics(result: dict) -> str:
    """'test loss 0.5316  test accuracy 0.8860 ...': every scalar test_ metric of an
    evaluation, in the order the task returns them."""
    return "  ".join(f"{key.replace('_', ' ', 1)} {value:.4f}" for key, value in
                     result.items() if key.startswith("test_") and isinstance(value, float))


def _format(means: dict[str, float | None]) -> str:
    return "  ".join(f"{key} {_number(value)}" for key, value in means.items())


def _number(value: float | None) -> str:
    """'0.1234', or '-' for a metric no applied update counted (every update of
    those steps skipped: a loss of 0 would be a lie)."""
    return "-" if value is None else f"{value:.4f}"


class _Window:
    """(total, weight) of every metric, steps and seconds over some steps."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}
        self.steps, self.seconds, self.waited = 0, 0.0, 0.0

    def add(self, sums: dict, num_steps: int, seconds: float) -> None:
        for key, (total, weight) in sums.items():
            if np.size(total) == 1 and not key.startswith("_"):  # ("_": the loop's)
                kept = self.sums.setdefault(key, [0.0, 0.0])
                kept[0] += float(total)
                kept[1] += float(weight)
        self.steps += num_steps
        self.seconds += seconds

    def means(self, global_batch_size: int) -> tuple[dict[str, float | None], float]:
        """({metric: total / weight, None where nothing was counted}, images/sec)."""
        rate = self.steps * global_batch_size / max(self.seconds, 1e-9)
        means = distributed.means(self.sums)
        return {key: value if self.sums[key][1] else None
                for key, value in means.items()}, rate


class Stopwatch:
    """`with Stopwatch() as w: ...` then w.seconds; or w.elapsed() while running."""

    def __init__(self):
        self.start, self.seconds = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = self.elapsed()


def weights_checksum(model) -> str:
    """SHA-256 of every weight array in order: equal iff the weights are bitwise equal."""
    digest = hashlib.sha256()
    for weights in model.get_weights():
        digest.update(weights.tobytes())
    return digest.hexdigest()


def state_checksum(state) -> str:
    """SHA-256 of everything a TrainState holds (every model, optimizer and extra
    variable, and the step), in order: equal iff bitwise equal."""
    digest = hashlib.sha256()
    for _, variable in state.compared_variables():
        digest.update(np.asarray(variable.numpy()).tobytes())
    return digest.hexdigest()


def initial_weights(model: str, weights: str) -> str:
    """--weights in words: above all, that a model with a pretrained backbone to
    fine-tune (xception) starts from random weights unless --weights names some."""
    if weights not in ("", "none"):
        return f"{weights} (--weights; a resumed run's come from its checkpoint)"
    if models.takes_backbone_weights(model):
        return (f"random, {model}'s backbone too: this trains from scratch, not "
                f"fine-tunes (--weights=imagenet: ImageNet's, Keras' download; or "
                f"--weights=PATH: Keras' notop file, or a run's model.weights.h5)")
    return "random (--weights=none)"


def log_setup(run, runtime, flops_per_image: float, peak: float) -> None:
    """The set-up of `run` (trainer/build.py's Run: its config, data, plan, task,
    state and step) on `runtime`'s devices in a few log lines, before the first
    step; the step's float ops per image and the device's measured peak (0: not
    measured)."""
    config, spec, plan, state = run.config, run.spec, run.plan, run.state
    precision, jit = runtime.precision, runtime.jit
    # The run directory holds the run now: its log file gets every line, these too.
    console.log_to(os.path.join(config.model_dir, console.log_file_name(runtime.strategy)))
    logging.info("Model input: %s (%s's input_range)",
                 models.INPUT_RANGES[models.entry(config.model).input_range], config.model)
    logging.info("Initial weights: %s", initial_weights(config.model, config.weights))
    logging.info("Strategy: %s", runtime.describe())
    logging.info("Batch: global %d = %d replicas x %d per replica%s | precision %s | "
                 "XLA %s", config.batch_size, runtime.num_replicas,
                 plan.per_replica_batch,
                 (f" ({config.grad_accum_steps} micro-batches of "
                  f"{plan.per_replica_batch // config.grad_accum_steps})"
                  if config.grad_accum_steps > 1 else ""),
                 precision, "on" if jit else "off")
    changed = [f"{field.name}={getattr(run.step_options, field.name)}"
               for field in dataclasses.fields(run.step_options)
               if field.name not in ("batch_size", "total_steps")  # (in other lines)
               and getattr(run.step_options, field.name) != field.default]
    logging.info("Step: %s", " ".join(changed) or "the default (no clipping, "
                 "accumulation, SAM or Lookahead)")
    settings = ", ".join(f"{k}={v}" for k, v in vars(run.task.settings).items())
    logging.info("Task: %s%s", config.task, f" ({settings})" if settings else "")
    sizes = ", ".join(f"{name} {model.count_params():,}" + (
        "" if name in state.optimizers else " (no optimizer)")
        for name, model in state.models.items())
    extras = (f" | extra state {', '.join(state.extras)}" if state.extras else "")
    logging.info("Model %s: parameters %s%s | data %s: %d train / %d eval examples | "
                 "%d steps (%d per epoch, %.2f epochs)", config.model, sizes, extras,
                 config.dataset, plan.train_examples,
                 plan.eval_examples, plan.total_steps, plan.steps_per_epoch,
                 plan.total_steps / plan.steps_per_epoch)
    if spec.eval_pattern:
        logging.info("Evaluation split: the files of %s", spec.eval_pattern)
    elif spec.holdout_files:
        logging.info("Evaluation split: the last %.0f%% of the files (at least one), the "
                     "same every run; training uses the others", 100 * spec.holdout_fraction)
    elif spec.holdout_fraction:
        logging.info("Evaluation split: a fixed %.0f%% of %s %r held out by a hash of the "
                     "example index (same every run); training uses the rest",
                     100 * spec.holdout_fraction, spec.name, spec.train_split)
    if config.ema_decay:
        logging.info("Weight averaging: EMA with decay %g per step; evaluation and "
                     "model.weights.h5 use the average", config.ema_decay)
    logging.info("Optimizer %s, LR schedule %s: %s", config.optimizer, config.lr_schedule,
                 schedules.describe(run.schedule))
    for name, note in run.optimizer_notes.items():  # (build.optimizer's changes)
        logging.info("Optimizer %s: %s", name, note)
    steps = run.task.train_steps(plan)
    if len(steps.parts) > 1:
        logging.info("Training steps: %s (each optimizer counts its own updates)",
                     steps.describe())
    logging.info("%.0f MFLOP per training image%s", flops_per_image / 1e6,
                 f"; the run's {precision} matmul peak {peak / 1e9:.0f} GFLOP/s"
                 if peak else "")


def log_finished(model_dir: str, metrics: dict) -> None:
    """The line of a rerun of a finished run (`metrics`: its final ones)."""
    early = metrics.get("stopped_early")
    logging.info("The run in %s is finished (%d steps%s; its metrics.json and weights "
                 "are kept as they are); nothing to do. %s", model_dir, metrics["steps"],
                 f": {early}" if early else "", "Another --model_dir trains anew" if early
                 else "A larger --train_steps or --epochs trains it further")


def log_first_steps(first: int, last: int, start_up: startup.StartUp, train_loop,
                    iterator, stop_flag) -> None:
    """What start-up cost, phase by phase (`start_up`: since the command started),
    and one warning line if the traced step draws with a stateful random op: its
    numbers differ on each replica and after a resume (trainer/randomness.py)."""
    logging.info("Steps %d-%d done %.1f s after the command started: %s", first, last,
                 start_up.since_command(), start_up.describe())
    graph = train_loop.get_concrete_function(iterator, tf.constant(1),  # (the one traced)
                                             stop_flag).graph
    found = randomness.stateful_random_ops(graph)
    if found:
        logging.warning("the step draws with a stateful random op, %s: replicas draw "
                        "other numbers and a resumed run too; draw from "
                        "trainer.randomness (step_seed, per_example_normal, ...)",
                        "; ".join(found[:3]) + (" ..." if len(found) > 3 else ""))


def log_done(describe: str, metrics: dict) -> None:
    logging.info("Done: %s on %d examples, %.1f s training, %.0f img/s%s, peak "
                 "memory %.2f GiB", describe, metrics["test_examples"],
                 metrics["train_seconds"], metrics["images_per_second"],
                 input_text(metrics["input_wait_fraction"]), metrics["peak_memory_gib"])


class Profiler:
    """--profile_steps A,B: a TensorFlow profiler trace of steps A+1 to B in
    `log_dir` (TensorBoard's Profile tab). `marks`: the steps the loop must stop at:
    every one from A to B, so that each traced step is a call of its own, marked as
    a step for XProf (its Overview Page finds no step in a trace without markers,
    and one marker around many in-graph steps would be one step)."""

    def __init__(self, steps: tuple[int, int] | tuple, log_dir: str):
        self.first, self.last = steps or (-1, -1)
        self.marks = tuple(range(self.first, self.last + 1)) if steps else ()
        self.log_dir, self.running = log_dir, False

    @contextlib.contextmanager
    def step(self, current: int, stop: int) -> Iterator[None]:
        """Around the call that trains from step `current` to `stop`: starts the
        trace at A, marks a traced call as step `current + 1` (XProf's step marker:
        a root "train" event with a step_num), and stops the trace once `stop`
        reaches B (an exception leaves that to `stopped_at_exit`)."""
        if self.marks and current == self.first:
            tf.profiler.experimental.start(self.log_dir)
            self.running = True
        if self.running:
            with tf.profiler.experimental.Trace("train", step_num=current + 1, _r=1):
                yield
        else:
            yield
        if self.running and stop >= self.last:
            tf.profiler.experimental.stop()
            self.running = False
            run_dir = os.path.dirname(self.log_dir.rstrip("/"))
            logging.info("profiler trace of steps %d-%d in %s (TensorBoard's Profile tab; "
                         "python -m trainer.tools.profile_summary --logdir=%s)",
                         self.first + 1, self.last, self.log_dir, run_dir)

    @contextlib.contextmanager
    def stopped_at_exit(self) -> Iterator[None]:
        """A run that ends (or fails) between A and B still stops the profiler, so
        the next run in this process can start one."""
        try:
            yield
        finally:
            if self.marks:
                try:
                    tf.profiler.experimental.stop()
                except tf.errors.UnavailableError:  # stopped at B already
                    pass
