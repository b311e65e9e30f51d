"""What a run leaves for a person to read: the train and eval history (kept in
metrics.json after every evaluation, so a killed or resumed run keeps its curve),
TensorBoard summaries, and at the end summary.png and the final metrics.json.
Only the chief writes files.
"""
import json
import os

from absl import logging
import tensorflow as tf

from trainer.output import figures, progress as reporting, summaries

METRICS_FILE = "metrics.json"
SUMMARY_FILE = "summary.png"
_DETAILS = ("confusion", "samples")  # eval results that are pictures, not history


class Recorder:

    def __init__(self, model_dir: str, is_chief: bool, start_step: int,
                 class_names, title: str):
        self.model_dir, self.is_chief = model_dir, is_chief
        self.class_names, self.title = class_names, title
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

    def train(self, record: dict) -> None:
        record = self._shift(record)
        self.train_history = _before(self.train_history, record["step"]) + [record]
        self.writer.train(record)

    def eval(self, result: dict) -> dict:
        """Records one evaluation; returns its history record (without pictures)."""
        details = {key: result[key] for key in _DETAILS if key in result}
        record = self._shift({k: v for k, v in result.items() if k not in _DETAILS})
        # A step evaluated again (a finished run rerun) replaces its old record.
        self.eval_history = _before(self.eval_history, record["step"]) + [record]
        self.last_details = details
        self.writer.eval(record, details, self.class_names)
        self.save()
        return record

    def save(self) -> None:
        """Writes the history so far (with every checkpoint, so a resume keeps it)."""
        self._write_metrics({"status": "running"})

    def finish(self, metrics: dict, schedule_points, steps_per_epoch: int) -> dict:
        """Writes the final metrics.json and summary.png; returns the metrics."""
        metrics = {**metrics, "status": "done"}
        if "confusion" in self.last_details:
            metrics["confusion_matrix"] = self.last_details["confusion"].tolist()
        metrics = self._write_metrics(metrics)
        self.writer.close()
        if self.is_chief:
            fig = figures.summary(
                self.train_history, self.eval_history, schedule_points, steps_per_epoch,
                self.last_details.get("samples"), self.class_names,
                f"{self.title}: test accuracy {metrics['test_accuracy']:.2%} "
                f"(best {metrics['best_test_accuracy']:.2%}), "
                f"{metrics['train_seconds']:.0f} s of training")
            path = os.path.join(self.model_dir, SUMMARY_FILE)
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write(figures.png_bytes(fig))
            logging.info("Wrote %s, %s and TensorBoard summaries (tensorboard "
                         "--logdir=%s)", path, METRICS_FILE, self.model_dir)
        return metrics

    def best(self) -> dict:
        """The step and accuracy of the best evaluation so far (best.weights.h5)."""
        if not self.eval_history:
            return {}
        best = max(self.eval_history, key=lambda r: r["test_accuracy"])
        return {"best_step": best["step"], "best_test_accuracy": best["test_accuracy"]}

    def _write_metrics(self, values: dict) -> dict:
        values = {**values, **self.best(), "eval_history": self.eval_history,
                  "train_history": self.train_history}
        if self.is_chief:
            reporting.write_json(os.path.join(self.model_dir, METRICS_FILE), values)
        return values


def _before(history: list[dict], step: int) -> list[dict]:
    return [r for r in history if r["step"] < step]


def _previous_history(model_dir: str, start_step: int) -> tuple[list, list]:
    """The history up to `start_step` of the run being resumed (none for a new run)."""
    path = os.path.join(model_dir, METRICS_FILE)
    if start_step == 0 or not tf.io.gfile.exists(path):
        return [], []
    try:
        with tf.io.gfile.GFile(path) as f:
            previous = json.load(f)
    except (tf.errors.OpError, ValueError):
        logging.warning("could not read %s; the history restarts at step %d",
                        path, start_step)
        return [], []
    keep = lambda history: [r for r in history if r["step"] <= start_step]  # noqa: E731
    return (keep(previous.get("train_history", [])),
            keep(previous.get("eval_history", [])))
