"""Progress lines, images/sec, ETA, and metrics.json."""
import hashlib
import json
import os
import time

from absl import logging

from trainer import schedules


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Accumulates step sums between log lines; all rates use training time only."""

    def __init__(self, total_steps: int, steps_per_epoch: int, global_batch_size: int,
                 start_step: int):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.global_batch_size = global_batch_size
        self.start_step = start_step
        self.train_seconds = 0.0
        self.skipped_steps = 0  # updates dropped for a non-finite loss (--on_nan)
        self._window = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
        self._window_seconds, self._window_steps = 0.0, 0

    def add(self, sums: dict, num_steps: int, seconds: float) -> None:
        for key in self._window:
            self._window[key] += sums[key]
        self._window_seconds += seconds
        self._window_steps += num_steps
        self.train_seconds += seconds
        skipped = int(sums.get("skipped", 0))
        if skipped:
            logging.warning("non-finite loss: skipped %d update(s) (%d in this run)",
                            skipped, self.skipped_steps + skipped)
        self.skipped_steps += skipped

    def images_per_second(self, step: int) -> float:
        images = (step - self.start_step) * self.global_batch_size
        return images / self.train_seconds if self.train_seconds else 0.0

    def log(self, step: int, learning_rate: float) -> dict:
        """Logs one line for the steps since the last call; returns its values."""
        count = max(self._window["count"], 1.0)
        loss, accuracy = self._window["loss_sum"] / count, self._window["correct"] / count
        rate = (self._window_steps * self.global_batch_size /
                max(self._window_seconds, 1e-9))
        eta = (self.total_steps - step) * self.global_batch_size / max(rate, 1e-9)
        logging.info("step %d/%d  epoch %.2f  loss %.4f  accuracy %.4f  lr %.3g  "
                     "%.0f img/s  ETA %s", step, self.total_steps,
                     step / self.steps_per_epoch, loss, accuracy, learning_rate, rate,
                     _duration(eta))
        self._window = dict.fromkeys(self._window, 0.0)
        self._window_seconds, self._window_steps = 0.0, 0
        return {"train_loss": loss, "train_accuracy": accuracy}


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


def write_json(path: str, values: dict) -> None:
    """Writes atomically: a crash mid-write never leaves a truncated file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def weights_checksum(model) -> str:
    """SHA-256 of every weight array in order: equal iff the weights are bitwise equal."""
    digest = hashlib.sha256()
    for weights in model.get_weights():
        digest.update(weights.tobytes())
    return digest.hexdigest()


def log_setup(config, spec, runtime, plan, precision: str, jit: bool, schedule,
              model) -> None:
    """The run's set-up in a few log lines, before the first step."""
    logging.info("Strategy: %s", runtime.describe())
    logging.info("Batch: global %d = %d replicas x %d per replica | precision %s | "
                 "XLA %s", config.batch_size, runtime.num_replicas,
                 plan.per_replica_batch, precision, "on" if jit else "off")
    logging.info("Model %s: %s parameters | data %s: %d train / %d eval examples | "
                 "%d steps (%d per epoch, %.2f epochs)", config.model,
                 f"{model.count_params():,}", config.dataset, plan.train_examples,
                 plan.eval_examples, plan.total_steps, plan.steps_per_epoch,
                 plan.total_steps / plan.steps_per_epoch)
    if spec.holdout_fraction:
        logging.info("Evaluation split: a fixed %.0f%% of %s %r held out by a hash of the "
                     "example index (same every run); training uses the rest",
                     100 * spec.holdout_fraction, spec.name, spec.train_split)
    if config.ema_decay:
        logging.info("Weight averaging: EMA with decay %g per step; evaluation and "
                     "model.weights.h5 use the average", config.ema_decay)
    logging.info("LR schedule %s: %s", config.lr_schedule, ", ".join(
        f"step {s}: {lr:.3g}" for s, lr in schedules.sample_points(schedule)))
