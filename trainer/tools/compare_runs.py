"""Seeds and ablations side by side, from the runs' metrics.json files:

    python -m trainer.tools.compare_runs --runs=runs/airbench_s0,runs/airbench_s1 \\
        [--groups=all_on=runs/a_s*,no_lookahead=runs/b_s*] [--target=0.92] [--plot=curves.png]

Prints a Markdown table, one row per run (the settings that differ between the
runs, from each run's metrics.json, else its run_config.json; the final value of
--metric, default the metric that picked the runs' best weights, e.g.
test_accuracy or an autoencoder's test_loss; training seconds, img/s, GFLOP/s,
the first evaluation reaching --target and its training seconds), and with
--groups one row per group (mean and spread over its runs, and the difference to
the first group): an ablation table. --plot draws every run's metric, every
evaluation of it, against --x: epoch (default), step, or training seconds (which
vary with the machine's load: identical work took 101-162 s on a busy machine).
Paths may be on any TF filesystem. Accuracies are shown in %.
"""
import functools
import json
import os
import statistics
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402
from trainer import checkpoints, run_settings  # noqa: E402
from trainer.output import figures  # noqa: E402


FLAGS = flags.FLAGS
X_AXES = {"epoch": ("epoch", "epoch"), "step": ("step", "step"),
          "seconds": ("train_seconds", "training seconds")}  # --x: (key, label)
NOT_COMPARED = ("model_dir", "data_dir")  # where a run is, not what it is


def load(run_dir: str) -> dict:
    """A run's metrics.json, with its "settings" flat (the task's own too; a
    running run's, which has none yet, from its run_config.json)."""
    with tf.io.gfile.GFile(os.path.join(run_dir, "metrics.json")) as f:
        metrics = json.load(f)
    settings = metrics.get("settings")
    config_path = os.path.join(run_dir, checkpoints.RUN_CONFIG)
    if not settings and tf.io.gfile.exists(config_path):
        with tf.io.gfile.GFile(config_path) as f:
            settings = json.load(f)
    metrics["settings"] = run_settings.comparable_settings(settings) if settings else {}
    return metrics


def differing_settings(runs: dict[str, dict]) -> list[str]:
    """The settings whose values are not the same in all the runs (one unknown
    to a run counts as a difference), in the first run's order."""
    names = dict.fromkeys(name for m in runs.values() for name in m.get("settings", {}))
    return [name for name in names if name not in NOT_COMPARED and len(
        {json.dumps(m.get("settings", {}).get(name)) for m in runs.values()}) > 1]


def metric_of(runs: list[dict], metric: str) -> tuple[str, bool]:
    """(the metric to compare, whether higher is better): --metric, else the one
    that picked the first run's best weights (runs before tasks: test_accuracy)."""
    first = runs[0] if runs else {}
    metric = metric or first.get("best_metric", "test_accuracy")
    higher = first.get("higher_is_better", True) if metric == first.get(
        "best_metric", "test_accuracy") else "loss" not in metric
    return metric, higher


def _shown(metric: str, value: float) -> float:
    return 100 * value if "accuracy" in metric else value


def _text(metric: str, value: float) -> str:
    """An accuracy as 84.06%, anything else to 4 significant digits."""
    return f"{100 * value:.2f}%" if "accuracy" in metric else f"{value:.4g}"


def first_at(metrics: dict, target: float, metric: str = "test_accuracy",
             higher: bool = True) -> dict | None:
    """The first evaluation whose `metric` reaches `target`."""
    return next((r for r in metrics["eval_history"] if metric in r and (
        r[metric] >= target if higher else r[metric] <= target)), None)


def run_rows(runs: dict[str, dict], target: float, metric: str = "test_accuracy",
             higher: bool = True) -> list[str]:
    """One row per run: its settings that differ between the runs, then how it did."""
    settings = differing_settings(runs)
    rows = [f"| run | {''.join(f'{name} | ' for name in settings)}"
            f"{metric.replace('_', ' ')} | train s | img/s | GFLOP/s | first eval "
            f"{'>=' if higher else '<='} {_text(metric, target)} (epoch, train s) |",
            f"| --- | {'--- | ' * len(settings)}---: | ---: | ---: | ---: | --- |"]
    for name, m in runs.items():
        hit = first_at(m, target, metric, higher)
        values = "".join(f"{m.get('settings', {}).get(setting, '')} | "
                         for setting in settings)
        rows.append(f"| {name} | {values}{_text(metric, m[metric])} | "
                    f"{m['train_seconds']:.0f} | {m['images_per_second']:.0f} | "
                    f"{m.get('gflops_per_second', 0):.0f} | "
                    + (f"epoch {hit['epoch']:.1f}, {hit['train_seconds']:.0f} s |" if hit
                       else "not reached |"))
    return rows


def _mean_spread(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {spread:.2f}"


def group_rows(groups: dict[str, list[dict]], metric: str = "test_accuracy") -> list[str]:
    """Mean ± standard deviation per group; the first group is the reference."""
    unit = " %" if "accuracy" in metric else ""
    rows = [f"| variant | runs | {metric.replace('_', ' ')}{unit} | vs first | train s |",
            "| --- | ---: | ---: | ---: | ---: |"]
    reference = None
    for name, members in groups.items():
        accuracies = [_shown(metric, m[metric]) for m in members]
        mean = statistics.mean(accuracies)
        reference = mean if reference is None else reference
        rows.append(f"| {name} | {len(members)} | {_mean_spread(accuracies)} | "
                    f"{mean - reference:+.2f} | "
                    f"{_mean_spread([m['train_seconds'] for m in members])} |")
    return rows


def curve(metrics: dict, metric: str, x: str = "epoch") -> list[tuple[float, float]]:
    """(x, value) of every evaluation of `metric` in a run (x: a key of X_AXES)."""
    key = X_AXES[x][0]
    return [(r[key], _shown(metric, r[metric])) for r in metrics["eval_history"]
            if metric in r and key in r]


def plot(runs: dict[str, dict], path: str, target: float,
         metric: str = "test_accuracy", x: str = "epoch"):
    """Writes every run's curve, whole (the axes fit all its evaluations), and the
    target; returns the Figure."""
    fig = figures.mpl_figure.Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for name, m in runs.items():
        points = curve(m, metric, x)
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=name)
    ax.axhline(_shown(metric, target), color="grey", linestyle="--", linewidth=1,
               label=f"target {_text(metric, target)}")
    ax.set(xlabel=X_AXES[x][1], ylabel=metric.replace("_", " ")
           + (" %" if "accuracy" in metric else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.write_atomically(path, figures.png_bytes(fig))
    return fig


def main(argv: list[str]) -> None:
    # Run directories as --runs=A,B or as arguments (`compare_runs runs/a runs/b`).
    paths = [*filter(None, FLAGS.runs.split(",")), *argv[1:]]
    if not paths and not FLAGS.groups:
        print("error: no runs to compare: give their directories, --runs=A,B (or as "
              "arguments), or --groups=NAME=GLOB,...", file=sys.stderr)
        sys.exit(2)
    try:
        names = [os.path.basename(d.rstrip("/")) for d in paths]
        if len(set(names)) < len(names):  # runs/a/s0 and runs/b/s0: the whole paths
            names = paths
        runs = {name: load(d) for name, d in zip(names, paths)}
        groups = {}
        for item in filter(None, FLAGS.groups.split(",")):
            name, _, pattern = item.partition("=")
            dirs = sorted(os.path.dirname(p) for p in
                          tf.io.gfile.glob(os.path.join(pattern, "metrics.json")))
            if not dirs:
                raise FileNotFoundError(f"--groups: no metrics.json under {pattern}")
            groups[name] = [load(d) for d in dirs]
        metric, higher = metric_of([*runs.values(), *(m for g in groups.values()
                                                        for m in g)], FLAGS.metric)
        if runs:
            print("\n".join(run_rows(runs, FLAGS.target, metric, higher)) + "\n")
        if groups:
            print("\n".join(group_rows(groups, metric)))
    except (FileNotFoundError, tf.errors.NotFoundError, KeyError,
            json.JSONDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.plot and runs:
        try:  # (in a run's folders: no link on the way; elsewhere, not the file)
            files.refuse_links(FLAGS.plot, (*paths, os.path.dirname(
                os.path.abspath(FLAGS.plot))), "--plot")
        except files.LinkError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        try:
            plot(runs, FLAGS.plot, FLAGS.target, metric, FLAGS.x)
        except files.WriteError as err:  # (a read-only place, a full disk: the cause)
            print(f"error: {err}", file=sys.stderr)
            sys.exit(5)


def define_flags() -> None:
    define = functools.partial(cli.define_flag, FLAGS)
    define(flags.DEFINE_string, "runs", "", "Comma-separated run directories (model_dir).")
    define(flags.DEFINE_string, "groups", "", "Comma-separated NAME=GLOB of run "
           "directories, e.g. no_lookahead=runs/nolookahead_s*: an ablation table.")
    define(flags.DEFINE_float, "target", 0.92, "Value of --metric whose first reaching "
           "is reported (an accuracy as a fraction).")
    define(flags.DEFINE_string, "metric", "", "The eval metric to compare, e.g. "
           "test_accuracy (default: the one that picked the runs' best weights).")
    define(flags.DEFINE_string, "plot", "", "Write the runs' curves of --metric here "
           "(a PNG).")
    define(flags.DEFINE_enum, "x", "epoch", "The plot's x-axis: epoch, step, or "
           "seconds (of training; these vary with the machine's load).",
           enum_values=list(X_AXES))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
