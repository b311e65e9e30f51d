"""The run's settings and final metrics for TensorBoard's HParams and Text tabs: a
built-in callback (trainer/callbacks.py), on the chief.

It writes the run directory's `hparams/` events: the settings as one HParams
session (every Config field but model_dir, and the task's settings), the settings
as a Markdown table (Text tab, tag `settings`: those that differ from the recipe
first), and at the end the final metrics as scalars `eval/<name>` (test metrics,
and `eval/best_<metric>`) and `train/<name>` (the last log line's). `tensorboard
--logdir` over a sweep's runs then gets the HParams table and parallel-coordinates
views, one row per run (named after its directory).

Why a directory of its own: TensorBoard reads a session's metrics from the
session's own run (group "") or its subdirectories, by run name; with the session
in the run's root, `--logdir=the_run` names it "." and its "eval" subdirectory
"eval", not "./eval", and finds no metric. In `hparams/`, with the metrics beside
it, both `--logdir=the_run` and `--logdir=runs` (the sweep) find them, and
TensorBoard infers the metrics and the settings' types and ranges from all the
runs it sees (no hparams_config, whose first run found would decide for all).
"""
import hashlib
import os
import time
from typing import Any

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

from trainer import callbacks, run_settings
from trainer.output import summaries

DIRECTORY = "hparams"
_NOT_METRICS = ("train_seconds", "wall_seconds", "test_examples")


def hparams_of(settings: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The settings (`Config.settings()`) as HParams values: all but model_dir (the
    session is named after the run) and those unset (None)."""
    return {name: value for name, value in settings.items()
            if name != "model_dir" and isinstance(value, (bool, int, float, str))}


def final_metrics(metrics: dict) -> dict[str, float]:
    """{tag: value} of a run's final metrics: test_<m> -> eval/<m>,
    best_test_<m> -> eval/best_<m>, train_<m> -> train/<m>."""
    tags = {}
    for key, value in metrics.items():
        if key in _NOT_METRICS or isinstance(value, bool) or not isinstance(
                value, (int, float)):
            continue
        for prefix, group in (("best_test_", "eval/best_"), ("test_", "eval/"),
                              ("train_", "train/")):
            if key.startswith(prefix):
                tags[group + key[len(prefix):]] = float(value)
                break
    return tags


def trial_id(model_dir: str) -> str:
    """The run's row name in the HParams table: its directory's name, and a hash of
    its whole path (TensorBoard merges the rows of equal names into one: runs/a/s0
    and runs/b/s0 must not be), e.g. 'run_seed0 (3f09c2)'."""
    path = os.path.abspath(model_dir) if "://" not in model_dir else model_dir
    digest = hashlib.sha256(path.rstrip("/").encode()).hexdigest()[:6]
    return f"{os.path.basename(path.rstrip('/'))} ({digest})"


def _cell(value: Any) -> str:
    """A setting's value in a Markdown cell: code, so that '*/beta=64' stays as
    it is; a '|' escaped."""
    text = repr(value) if isinstance(value, str) and not value else str(value)
    return "`" + text.replace("|", "\\|") + "`"


def settings_markdown(values: dict[str, Any]) -> str:
    """The settings (`Config.settings()`) as Markdown: those that differ from what
    the model, dataset and task train with by default (the recipe) first, beside
    the recipe's value, then the others."""
    changed = run_settings.changed_from_recipe(values)
    model = values["model"]
    baseline = run_settings.recipe_values(model, values["dataset"], values["task"])
    lines = [f"**{model}** on **{values['dataset']}**, task {values['task']}, "
             f"seed {values['seed']}, in `{values['model_dir']}`", ""]
    if changed:
        lines += [f"Settings that differ from the recipe ({model}'s, with "
                  f"the defaults):", "", "| setting | this run | recipe |",
                  "| --- | --- | --- |"]
        lines += [f"| {name} | {_cell(value)} | {_cell(baseline.get(name))} |"
                  for name, value in changed.items()]
    else:
        lines.append(f"Every setting is the recipe's ({model}'s, with the "
                     f"defaults).")
    lines += ["", "The other settings:" if changed else "The settings:", "",
              "| setting | value |", "| --- | --- |"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in values.items()
              if name not in changed]
    return "\n".join(lines)


class HParams(callbacks.Callback):
    """Writes the run's settings (HParams, Text) when training begins and its final
    metrics when it ends; see the module docstring."""
    name = "tensorboard_hparams"

    def __init__(self):
        self.writer: tf.summary.SummaryWriter | None = None
        self.directory = ""

    def on_train_begin(self, context: callbacks.Context) -> None:
        if not context.is_chief:
            return
        settings = context.config.settings()
        self.directory = os.path.join(context.model_dir, DIRECTORY)
        with summaries.write_errors_explained(context.model_dir):
            self.writer = tf.summary.create_file_writer(self.directory)
            with self.writer.as_default(step=context.start_step):
                hp.hparams(hparams_of(settings), trial_id=trial_id(context.model_dir),
                           start_time_secs=int(time.time()))
                tf.summary.text("settings", settings_markdown(settings))
            self.writer.flush()

    def on_train_end(self, metrics: dict) -> None:
        if self.writer is None:
            return
        with summaries.write_errors_explained(os.path.dirname(self.directory)):
            with self.writer.as_default(step=int(metrics.get("step", 0))):
                for tag, value in final_metrics(metrics).items():
                    tf.summary.scalar(tag, value)
            self.writer.close()
        self.writer = None
