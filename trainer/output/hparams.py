"""The run's settings and final metrics for TensorBoard's HParams and Text tabs: a
built-in callback (trainer/callbacks.py), on the chief.

It writes the run directory's `hparams/` events: the settings as one HParams
session (every Config field but model_dir, and the task's settings; an unset one,
'' or None, as "(default)", not an empty cell), the settings as a Markdown table
(Text tab, tag `settings`: those that differ from the recipe first), and at the end
the final metrics as scalars `eval/<name>` (test metrics, and `eval/best_<metric>`)
and `train/<name>` (the last log line's). `tensorboard --logdir` over a sweep's runs
then gets the HParams table and parallel-coordinates views, one row per run (named
after its directory).

Why a directory of its own: TensorBoard reads a session's metrics from the
session's own run (group "") or its subdirectories, by run name; with the session
in the run's root, `--logdir=the_run` names it "." and its "eval" subdirectory
"eval", not "./eval", and finds no metric. In `hparams/`, with the metrics beside
it, both `--logdir=the_run` and `--logdir=runs` (the sweep) find them, and
TensorBoard infers the metrics and the settings' types and ranges from all the
runs it sees (no hparams_config, whose first run found would decide for all).

The recipe's row (`hparams/recipe/`, when the run differs from its recipe): the
HParams tab orders the settings' columns by whether their values differ between
the rows it shows, then by name (tensorboard/plugins/hparams/backend_context.py,
`_sort_and_reduce_to_hparams_limit`; the page keeps that order), shows the first
five and the metrics after them. The values of one run differ from nothing: its
columns came alphabetically (alternating_flip, async_checkpoints, augment, ...).
Beside a row of the recipe's values (named "recipe: <model>, <dataset>", no
metrics) the settings that differ from the recipe differ between the rows, and
come first; over a sweep, so do those that differ between its runs (the recipe
rows of one model and dataset are one row). An hparams_config could only set the
same `differs` flags, and the first run's would decide for the whole sweep.
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
RECIPE = "recipe"  # hparams/recipe: the session of the recipe's values
UNSET = "(default)"  # '' or None: the model's, the data's or TensorFlow's own
_NOT_METRICS = ("train_seconds", "wall_seconds", "test_examples")


def shown(value: Any) -> bool | int | float | str:
    """A setting's value as the HParams table and the settings' Markdown show it:
    an unset one ('' or None) as "(default)" (--augment='' is the dataset's own
    augmentation, not none), anything but a bool, number or text as its text."""
    if value is None or (isinstance(value, str) and not value):
        return UNSET
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def hparams_of(settings: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The settings (`Config.settings()`) as HParams values: all but model_dir (the
    session is named after the run), each visible (`shown`)."""
    return {name: shown(value) for name, value in settings.items() if name != "model_dir"}


def recipe_hparams(settings: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The recipe's row: the run's HParams values, but the recipe's for each
    setting that differs from it (run_settings.changed_from_recipe); {} if none
    does."""
    changed = run_settings.changed_from_recipe(settings)
    if not changed:
        return {}
    baseline = run_settings.recipe_values(settings["model"], settings["dataset"],
                                          settings["task"])
    return hparams_of({**settings, **{name: baseline.get(name) for name in changed}})


def recipe_trial_id(settings: dict[str, Any]) -> str:
    """The recipe row's name, 'recipe: cifar_cnn, cifar10' (its start shows in the
    table's narrow first column), the same for every run of a model, dataset and
    task (TensorBoard shows the sessions of one name as one row)."""
    task = "" if settings["task"] == "classification" else f", {settings['task']}"
    return f"recipe: {settings['model']}, {settings['dataset']}{task}"


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
    it is; a '|' escaped; an unset one as in the HParams table."""
    return "`" + str(shown(value)).replace("|", "\\|") + "`"


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
        started, recipe = int(time.time()), recipe_hparams(settings)
        with summaries.write_errors_explained(context.model_dir):
            self.writer = tf.summary.create_file_writer(self.directory)
            with self.writer.as_default(step=context.start_step):
                hp.hparams(hparams_of(settings), trial_id=trial_id(context.model_dir),
                           start_time_secs=started)
                tf.summary.text("settings", settings_markdown(settings))
            self.writer.flush()
            if recipe:  # (see the module docstring)
                writer = tf.summary.create_file_writer(os.path.join(self.directory, RECIPE))
                with writer.as_default(step=context.start_step):
                    hp.hparams(recipe, trial_id=recipe_trial_id(settings),
                               start_time_secs=started)
                writer.close()

    def on_train_end(self, metrics: dict) -> None:
        if self.writer is None:
            return
        with summaries.write_errors_explained(os.path.dirname(self.directory)):
            with self.writer.as_default(step=int(metrics.get("step", 0))):
                for tag, value in final_metrics(metrics).items():
                    tf.summary.scalar(tag, value)
            self.writer.close()
        self.writer = None
