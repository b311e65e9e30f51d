"""What a run leaves for a person to read: the train and eval history (kept in
metrics.json after every evaluation, so a killed or resumed run keeps its curve),
TensorBoard summaries, and at the end summary.png and the final metrics.json.
Only the chief writes files.
"""
import contextlib
import os
from typing import Callable, Iterator

from absl import logging
import numpy as np
import tensorflow as tf

from data import files
from trainer import averaging, checkpoints, faults, locks, run_settings
from trainer.output import figures, progress, summaries

METRICS_FILE = "metrics.json"
SUMMARY_FILE = "summary.png"


def _is_detail(value) -> bool:
    """Eval results that are pictures (sample predictions, a confusion matrix),
    not history: anything but a number."""
    return not isinstance(value, (int, float, str))


class Recorder:
    """The history and pictures of one run; `task` says which metric is best and
    what the pictures show."""

    def __init__(self, model_dir: str, is_chief: bool, start_step: int, task,
                 title: str, settings: dict | None = None):
        # (settings: the run's Config.settings(), for summary.png's title)
        self.model_dir, self.is_chief, self.settings = model_dir, is_chief, settings
        self.task, self.title = task, title
        self.train_history, self.eval_history = _previous_history(model_dir, start_step)
        # Times continue from the resumed step, so the curve reads as one run.
        previous = self.train_history + self.eval_history
        self._offsets = {key: max((r.get(key, 0.0) for r in previous), default=0.0)
                         for key in ("train_seconds", "wall_seconds")}
        self.last_details: dict = {}
        self.writer = summaries.Writer(model_dir, enabled=is_chief)
        self.save()  # "running" from the start: a resumed run's old "done" would
        # tell trainer.evaluate --watch that it has ended

    def _shift(self, record: dict) -> dict:
        return {**record, **{key: record[key] + offset
                             for key, offset in self._offsets.items() if key in record}}

    def train(self, record: dict) -> dict:
        """Records one log line; returns its history record."""
        record = self._shift(record)
        self.train_history = _before(self.train_history, record["step"]) + [record]
        self.writer.train(record)
        return record

    def eval(self, result: dict) -> dict:
        """Logs and records one evaluation; returns its history record (without
        pictures)."""
        logging.info("eval at step %d (epoch %.2f): %s  (%d examples)", result["step"],
                     result["epoch"], progress.format_test_metrics(result),
                     result["test_examples"])
        details = {key: value for key, value in result.items() if _is_detail(value)}
        record = self._shift({k: v for k, v in result.items() if k not in details})
        # A step evaluated again (a finished run rerun) replaces its old record.
        self.eval_history = _before(self.eval_history, record["step"]) + [record]
        self.last_details = details
        if self.writer.enabled:
            self.writer.eval(record, self.task.presenter(self.task).pictures(
                details.get("samples"), details,
                f"epoch {record['epoch']:.2f}, {self.describe(record)}"))
        self.save()
        return record

    def last_records(self) -> dict:
        """The last evaluation and the last log line's train_ metrics: what the final
        metrics.json begins with."""
        last_train = self.train_history[-1] if self.train_history else {}
        return {**self.eval_history[-1],
                **{k: v for k, v in last_train.items() if k.startswith("train_")},
                "train_seconds": self.eval_history[-1]["train_seconds"]}

    def describe(self, record: dict) -> str:
        """'test accuracy 0.8412' of the task's best metric in a record."""
        metric = self.task.best.metric
        return f"test {metric} {record[f'test_{metric}']:.4f}"

    def improved(self, record: dict) -> bool:
        """Whether `record` is the best evaluation so far (by the task's metric)."""
        key = f"test_{self.task.best.metric}"
        scored = [r[key] for r in self.eval_history if key in r and r is not record]
        if not scored:
            return True
        higher = self.task.best.higher_is_better
        best = max(scored) if higher else min(scored)
        return record[key] > best if higher else record[key] < best

    def save_evaluated_weights(self, name: str, model, state) -> str:
        """The weights just evaluated (the average with --ema_decay) of `model` to
        model_dir/name, by the chief, while this process still holds the run's
        directory (trainer/locks.py); returns their checksum (on every worker)."""
        with averaging.averaged_weights(state):
            if self.is_chief:
                locks.check_held(self.model_dir)
                checkpoints.save_weights(model, os.path.join(self.model_dir, name))
            return progress.weights_checksum(model)

    def save(self) -> None:
        """Writes the history so far (with every checkpoint, so a resume keeps it)."""
        self._write_metrics({"status": "running"})

    @contextlib.contextmanager
    def status_on_exit(self, step: Callable[[], int]) -> Iterator[None]:
        """metrics.json says how a run that ends inside ended: "stopped" (a stop
        signal: the same command resumes it), "diverged" (a non-finite loss or
        weight) or "failed" (any other error), with `step()` and the reason; never
        "running" after the process is gone. Nothing is written when the directory
        is another process's now (locks.LockLost)."""
        try:
            yield
        except BaseException as err:
            status = ("stopped" if isinstance(err, (faults.Preempted, KeyboardInterrupt))
                      else "diverged" if isinstance(err, (faults.TrainingDivergedError,
                                                          checkpoints.NonFiniteError))
                      else None if isinstance(err, locks.LockLost) else "failed")
            if status:
                reason = str(err).splitlines()[0] if str(err).strip() else ""
                try:
                    self._write_metrics({"status": status, "steps": step(), "ended_by":
                                         files.shorter(f"{type(err).__name__}: {reason}")})
                except files.WriteError as write_error:  # (the disk that failed)
                    logging.warning("%s (metrics.json could not say %r)", write_error,
                                    status)
            raise

    def finish(self, metrics: dict, schedule_points, steps_per_epoch: int) -> dict:
        """Writes the final metrics.json (the last evaluation's and log line's
        metrics, then `metrics`) and summary.png; returns the metrics."""
        metrics = {**self.last_records(), **metrics, "status": "done",
                   **{key: value.tolist() for key, value in self.last_details.items()
                      if isinstance(value, np.ndarray)}}
        metrics = self._write_metrics(metrics)
        self.writer.close()
        if self.is_chief:
            task, samples = self.task, self.last_details.get("samples")
            presenter = task.presenter(task)
            best = metrics[f"best_test_{task.best.metric}"]
            fig = figures.summary(
                self.train_history, self.eval_history, schedule_points, steps_per_epoch,
                tuple(dict.fromkeys(("loss", task.best.curve, task.best.metric))),
                (task.best.metric, task.best.higher_is_better),
                (lambda figure: presenter.draw_samples(figure, samples))
                if samples and presenter.draws_samples() else None,
                f"{self.title}: {self.describe(metrics)} (best {best:.4f}), "
                f"{metrics['train_seconds']:.0f} s of training"
                + ("\n" + settings_line(self.settings) if self.settings else ""))
            path = os.path.join(self.model_dir, SUMMARY_FILE)
            files.write_atomically(path, figures.png_bytes(fig))
            logging.info("Wrote %s, %s and TensorBoard summaries (tensorboard "
                         "--logdir=%s)", path, METRICS_FILE, self.model_dir)
        return metrics

    def best(self) -> dict:
        """The step and the task's metric of the best evaluation so far (the one
        best.weights.h5 holds)."""
        key, higher = f"test_{self.task.best.metric}", self.task.best.higher_is_better
        scored = [r for r in self.eval_history if key in r]
        if not scored:
            return {}
        best = (max if higher else min)(scored, key=lambda r: r[key])
        return {"best_step": best["step"], f"best_{key}": best[key], "best_metric": key,
                "higher_is_better": higher}

    def _write_metrics(self, values: dict) -> dict:
        values = {**values, **self.best(), "eval_history": self.eval_history,
                  "train_history": self.train_history}
        if self.is_chief:
            files.write_json(os.path.join(self.model_dir, METRICS_FILE), values)
        return values


def settings_line(settings: dict, width: int = 150) -> str:
    """'seed 1; not the recipe's: learning_rate=0.01, ...' for summary.png's title:
    the seed, and the settings (`Config.settings()`) that differ from what the
    model, dataset and task train with by default (config.changed_from_recipe), cut
    at `width` characters."""
    changed = run_settings.changed_from_recipe(settings)
    changed.pop("seed", None)
    line = f"seed {settings['seed']}; " + (
        "not the recipe's: " + ", ".join(f"{name}={value}" for name, value in changed.items())
        if changed else f"{settings['model']}'s recipe")
    return line if len(line) <= width else line[:width - 1] + "…"


def _before(history: list[dict], step: int) -> list[dict]:
    return [r for r in history if r["step"] < step]


def _previous_history(model_dir: str, start_step: int) -> tuple[list, list]:
    """The history up to `start_step` of the run being resumed (none for a new run)."""
    path = os.path.join(model_dir, METRICS_FILE)
    if start_step == 0 or not tf.io.gfile.exists(path):
        return [], []
    try:
        previous = files.read_json(path)
        histories = [previous.get(key, []) for key in ("train_history", "eval_history")]
        if not all(isinstance(h, list) and all(isinstance(r, dict) and isinstance(
                r.get("step"), (int, float)) for r in h) for h in histories):
            raise files.BadFileError(f"{path} holds history records without a step")
    except files.BadFileError as err:  # half written, or of another shape
        logging.warning("%s; the history restarts at step %d", err, start_step)
        return [], []
    return tuple([r for r in history if r["step"] <= start_step] for history in histories)
