"""Callbacks: a run's own Python code between steps, outside the compiled step
(a picture logged at every evaluation, early stopping, a learning-rate range test,
a CSV log), without an edit of the loop.

A callback subclasses `Callback` and overrides the hooks it needs:

    on_train_begin(context)          after the state is built and restored
    on_log(step, metrics)            every --log_every steps: the training record
                                     (as metrics.json's train_history holds it)
    on_eval(step, results, state)    after every evaluation: the record (as
                                     eval_history holds it) and the task's details
                                     (e.g. "samples", a confusion matrix), the state
    on_checkpoint(step, path)        after a checkpoint is written
    on_train_end(metrics)            with the final metrics (metrics.json)

`context.request_stop(reason)` ends the run after the current step: an evaluation
if that step had none, the final outputs, metrics.json's "stopped_early" names the
reason, and the run counts as finished. `state_dict()` / `load_state_dict()` are
the callback's own state, saved in every checkpoint and restored with it, so a
killed and resumed run continues as if it had never stopped.

Where it runs: in the loop's Python, between the compiled steps, on every worker
with the same numbers (metrics and evaluations are all-reduced), so that a stop
is decided alike everywhere (one worker alone cannot stop: the others would wait
in a collective). Write files only where `context.is_chief`.

Which callbacks a run has: the CSV log (log.csv) and TensorBoard's HParams and
settings Text (trainer/output/hparams.py) always; weight and gradient histograms
with --histograms; early stopping with --early_stop_patience; those named by
--callbacks (registered with `@callbacks.register("name")`, e.g. in a module of
your own given with --import); and those the task returns from `Task.callbacks()`.

Compared with Keras (`keras.callbacks.Callback`: on_epoch_end(logs),
model.stop_training) and Lightning (`Callback.on_validation_end(trainer, module)`,
trainer.should_stop, state_dict): the same hooks by step instead of by epoch
(a run may log and evaluate at any step), a stop that is the same on every
worker, and state that resumes with the checkpoint as Lightning's does.
"""
import csv
import dataclasses
import io
import json
import os
from typing import Any, Callable, ClassVar

from absl import logging
import tensorflow as tf

from data import files

CSV_FILE = "log.csv"


@dataclasses.dataclass
class Context:
    """What a callback sees of the run (on_train_begin)."""
    config: Any                 # the run's trainer.config.Config
    model_dir: str
    task: Any                   # the run's Task
    state: Any                  # the TrainState (models, optimizers, step, extras)
    steps_per_epoch: int
    total_steps: int
    start_step: int             # > 0: resumed at this step
    is_chief: bool
    stop_reason: str = ""

    @classmethod
    def of(cls, run, start_step: int, is_chief: bool) -> "Context":
        """The context of a built run (trainer/build.py's Run) started at `start_step`."""
        return cls(run.config, run.config.model_dir, run.task, run.state,
                   run.plan.steps_per_epoch, run.plan.total_steps, start_step, is_chief)

    def request_stop(self, reason: str) -> None:
        """Ends the run after the current step (see the module docstring)."""
        self.stop_reason = self.stop_reason or reason

    def summary_writer(self, name: str = "callbacks") -> tf.summary.SummaryWriter:
        """A TensorBoard writer of model_dir/name (a no-op writer off the chief)."""
        if not self.is_chief:
            return tf.summary.create_noop_writer()
        return tf.summary.create_file_writer(os.path.join(self.model_dir, name))


class Callback:
    """Override the hooks you need; `name` keys the callback's saved state."""
    name: ClassVar[str] = ""

    def on_train_begin(self, context: Context) -> None:
        pass

    def on_log(self, step: int, metrics: dict) -> None:
        pass

    def on_eval(self, step: int, results: dict, state) -> None:
        pass

    def on_checkpoint(self, step: int, path: str) -> None:
        pass

    def on_train_end(self, metrics: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """The callback's state (JSON-able), saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict returned, when the run resumes."""


_REGISTRY: dict[str, Callable[[], Callback]] = {}


def register(name: str):
    """`@callbacks.register("my_images")` above a Callback subclass (or a function
    returning one, called without arguments) makes it --callbacks=my_images."""
    def add(factory: Callable[[], Callback]) -> Callable[[], Callback]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"two callbacks are registered as {name!r}")
        _REGISTRY[name] = factory
        return factory
    return add


def names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def parse_names(text: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'); an unknown name is a ValueError listing the known ones."""
    chosen = tuple(filter(None, (part.strip() for part in text.split(","))))
    for name in chosen:
        if name not in _REGISTRY:
            raise ValueError(f"--callbacks: unknown callback {name!r}; registered: "
                             f"{', '.join(names()) or 'none'} (register yours with "
                             f"@trainer.callbacks.register in a module given with "
                             f"--import)")
    return chosen


class Callbacks(tf.train.experimental.PythonState):
    """The run's callbacks, called in order; as a checkpoint object (the loop saves
    it beside the state) their state_dicts are saved and restored with each
    checkpoint."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)
        keys = [self._key(i, c) for i, c in enumerate(self.callbacks)]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two callbacks of the run have the same name: {keys}")
        self.context: Context | None = None
        self.restored = False  # from a checkpoint (deserialize was called)

    @staticmethod
    def _key(index: int, callback: Callback) -> str:
        return callback.name or type(callback).__name__

    @property
    def stop_reason(self) -> str:
        return self.context.stop_reason if self.context else ""

    # --- the checkpoint (tf.train.experimental.PythonState) ----------------------------
    def serialize(self) -> str:
        return json.dumps({self._key(i, c): c.state_dict()
                           for i, c in enumerate(self.callbacks)})

    def deserialize(self, string_value) -> None:
        saved = json.loads(string_value.numpy() if hasattr(string_value, "numpy")
                           else string_value)
        self.restored = True
        for i, callback in enumerate(self.callbacks):
            key = self._key(i, callback)
            if key in saved:
                callback.load_state_dict(saved[key])
            else:  # added on this resume: it starts afresh
                logging.info("callback %s has no saved state; it starts afresh", key)

    # --- the hooks ------------------------------------------------------------------
    def train_begin(self, context: Context) -> None:
        self.context = context
        for callback in self.callbacks:
            callback.on_train_begin(context)

    def log(self, step: int, metrics: dict) -> None:
        for callback in self.callbacks:
            callback.on_log(step, metrics)

    def eval(self, step: int, results: dict, state) -> None:
        for callback in self.callbacks:
            callback.on_eval(step, results, state)

    def checkpoint(self, step: int, path: str) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(step, path)

    def train_end(self, metrics: dict) -> None:
        for callback in self.callbacks:
            callback.on_train_end(metrics)


# --- Built on it ---------------------------------------------------------------------

class EarlyStopping(Callback):
    """Stops the run when the task's best metric (the one best.weights.h5 follows,
    e.g. test accuracy) has not improved by more than `min_delta` for `patience`
    evaluations in a row."""
    name = "early_stopping"

    def __init__(self, patience: int, metric: str, higher_is_better: bool,
                 min_delta: float = 0.0):
        self.patience, self.metric, self.min_delta = patience, metric, min_delta
        self.higher_is_better = higher_is_better
        self.best: float | None = None
        self.best_step = 0
        self.evaluations_without_improvement = 0
        self.context: Context | None = None

    def on_train_begin(self, context: Context) -> None:
        self.context = context

    def on_eval(self, step: int, results: dict, state) -> None:
        value = float(results[f"test_{self.metric}"])
        gain = (value - self.best if self.higher_is_better else self.best - value
                ) if self.best is not None else float("inf")
        if gain > self.min_delta:
            self.best, self.best_step = value, step
            self.evaluations_without_improvement = 0
            return
        self.evaluations_without_improvement += 1
        if self.evaluations_without_improvement >= self.patience:
            self.context.request_stop(
                f"early stopping: test {self.metric} has not improved for "
                f"{self.evaluations_without_improvement} evaluations (best "
                f"{self.best:.4f} at step {self.best_step}; --early_stop_patience="
                f"{self.patience})")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step,
                "evaluations_without_improvement": self.evaluations_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.evaluations_without_improvement = state["evaluations_without_improvement"]


class CsvLogger(Callback):
    """model_dir/log.csv: one row per log line ("train") and per evaluation
    ("eval"), the numbers metrics.json's histories hold, for a spreadsheet or
    pandas. Rewritten whole (atomically) at every row; a resumed run keeps the
    rows up to its step."""
    name = "csv_logger"

    def __init__(self):
        self.rows: list[dict] = []
        self.path = ""
        self.is_chief = False

    def on_train_begin(self, context: Context) -> None:
        self.path = os.path.join(context.model_dir, CSV_FILE)
        self.is_chief = context.is_chief
        self.rows = [row for row in read_csv(self.path)
                     if float(row.get("step") or 0) <= context.start_step
                     ] if context.start_step else []

    def on_log(self, step: int, metrics: dict) -> None:
        self._add("train", metrics)

    def on_eval(self, step: int, results: dict, state) -> None:
        self._add("eval", results)

    def _add(self, kind: str, record: dict) -> None:
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        self.rows.append({"kind": kind, **numbers})
        if self.is_chief:
            files.write_atomically(self.path, to_csv(self.rows).encode())


def to_csv(rows: list[dict]) -> str:
    """Rows with the union of their columns (step, epoch, kind first; a value a row
    lacks is empty)."""
    columns = list(dict.fromkeys(["step", "epoch", "kind",
                                  *(key for row in rows for key in row)]))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def read_csv(path: str) -> list[dict]:
    """The rows of a log.csv (none if there is no file); values as strings."""
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        return list(csv.DictReader(io.StringIO(f.read())))


def for_run(config, task, tensorboard: list[Callback], extra: tuple = ()) -> "Callbacks":
    """A run's callbacks (see the module docstring): the CSV log, TensorBoard's
    (`tensorboard`: HParams and Text, histograms with --histograms: trainer/output/
    makes them, importing this module), early stopping with --early_stop_patience,
    --callbacks' registered ones, the task's own, and `extra` (a command's)."""
    chosen: list[Callback] = [CsvLogger(), *tensorboard]
    if config.early_stop_patience:
        chosen.append(EarlyStopping(config.early_stop_patience, task.best.metric,
                                    task.best.higher_is_better, config.early_stop_min_delta))
    chosen += [_REGISTRY[name]() for name in parse_names(config.callbacks)]
    return Callbacks(chosen + list(task.callbacks()) + list(extra))
