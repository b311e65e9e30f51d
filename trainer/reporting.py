"""Progress lines, images/sec, ETA, and metrics.json."""
import hashlib
import json
import os
import time

from absl import logging

from trainer import progress_bar, schedules


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Accumulates step sums for the log lines (every --log_every steps, off a
    terminal) or the live bar (on one); all rates use training time only."""

    def __init__(self, total_steps: int, steps_per_epoch: int, global_batch_size: int,
                 start_step: int, bars: progress_bar.EpochBars | None = None):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.global_batch_size = global_batch_size
        self.start_step = start_step
        self.train_seconds = 0.0
        self.skipped_steps = 0  # updates dropped for a non-finite loss (--on_nan)
        self.bars = bars
        self._window = _Window()  # since the last log line
        self._epoch = _Window()   # since the start of the epoch, for the bar

    def add(self, sums: dict, num_steps: int, seconds: float) -> None:
        self._window.add(sums, num_steps, seconds)
        self._epoch.add(sums, num_steps, seconds)
        self.train_seconds += seconds
        skipped = int(sums.get("skipped", 0))
        if skipped:
            logging.warning("non-finite loss: skipped %d update(s) (%d in this run)",
                            skipped, self.skipped_steps + skipped)
        self.skipped_steps += skipped

    def images_per_second(self, step: int) -> float:
        images = (step - self.start_step) * self.global_batch_size
        return images / self.train_seconds if self.train_seconds else 0.0

    def _eta(self, step: int, rate: float, until: int | None = None) -> str:
        """Time to `until` (default: the end of the run) at `rate` images/sec."""
        steps_left = (until or self.total_steps) - step
        return _duration(steps_left * self.global_batch_size / max(rate, 1e-9))

    def show(self, step: int, learning_rate: float) -> None:
        """Updates the live bar (if any) after the steps up to `step`: the epoch's
        running loss and accuracy, and the run's ETA at this epoch's speed."""
        if self.bars is None:
            return
        loss, accuracy, rate = self._epoch.means(self.global_batch_size)
        epoch_end = min(self.total_steps,
                        (step - 1) // self.steps_per_epoch * self.steps_per_epoch
                        + self.steps_per_epoch)
        self.bars.update(step, f"loss {loss:.4f}  acc {accuracy:.4f}  "
                               f"lr {learning_rate:.3g}  {rate:,.0f} img/s  "
                               f"ETA epoch {self._eta(step, rate, epoch_end)} "
                               f"run {self._eta(step, rate)}")
        if step % self.steps_per_epoch == 0:
            self._epoch = _Window()

    def log(self, step: int, learning_rate: float) -> dict:
        """The values since the last call (one plain log line unless a live bar
        shows them); returns them as a train-history record."""
        loss, accuracy, rate = self._window.means(self.global_batch_size)
        if self.bars is None:
            logging.info("step %d/%d  epoch %.2f  loss %.4f  accuracy %.4f  lr %.3g  "
                         "%.0f img/s  ETA %s", step, self.total_steps,
                         step / self.steps_per_epoch, loss, accuracy, learning_rate,
                         rate, self._eta(step, rate))
        self._window = _Window()
        return {"step": step, "epoch": step / self.steps_per_epoch,
                "train_seconds": self.train_seconds, "train_loss": loss,
                "train_accuracy": accuracy, "learning_rate": learning_rate,
                "images_per_second": rate}


class _Window:
    """Sums of loss, hits, examples, steps and seconds over some steps."""

    def __init__(self):
        self.sums = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
        self.steps, self.seconds = 0, 0.0

    def add(self, sums: dict, num_steps: int, seconds: float) -> None:
        for key in self.sums:
            self.sums[key] += sums[key]
        self.steps += num_steps
        self.seconds += seconds

    def means(self, global_batch_size: int) -> tuple[float, float, float]:
        """(mean loss, accuracy, images/sec)."""
        count = max(self.sums["count"], 1.0)
        rate = self.steps * global_batch_size / max(self.seconds, 1e-9)
        return self.sums["loss_sum"] / count, self.sums["correct"] / count, rate


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
    logging.info("LR schedule %s: %s", config.lr_schedule, schedules.describe(schedule))
