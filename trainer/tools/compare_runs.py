"""Seeds and ablations side by side, from the runs' metrics.json files:

    python -m trainer.tools.compare_runs --runs=runs/airbench_s0,runs/airbench_s1 \\
        [--groups=all_on=runs/a_s*,no_lookahead=runs/b_s*] [--target=0.92] [--plot=curves.png]

Prints a Markdown table, one row per run (the final value of --metric, default
the metric that picked the runs' best weights, e.g. test_accuracy or an
autoencoder's test_loss; training seconds, img/s, GFLOP/s, the first evaluation
reaching --target and its training seconds), and with --groups one row per group
(mean and spread over its runs, and the difference to the first group): an
ablation table. --plot draws every run's metric against training seconds. Paths
may be on any TF filesystem. Accuracies are shown in %.
"""
import json
import os
import statistics
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402


FLAGS = flags.FLAGS


def load(run_dir: str) -> dict:
    with tf.io.gfile.GFile(os.path.join(run_dir, "metrics.json")) as f:
        return json.load(f)


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
    rows = [f"| run | {metric.replace('_', ' ')} | train s | img/s | GFLOP/s | first eval "
            f"{'>=' if higher else '<='} {_text(metric, target)} (epoch, train s) |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, m in runs.items():
        hit = first_at(m, target, metric, higher)
        rows.append(f"| {name} | {_text(metric, m[metric])} | "
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


def plot(runs: dict[str, dict], path: str, target: float,
         metric: str = "test_accuracy") -> None:
    from data import files
    from trainer.output import figures
    fig = figures.mpl_figure.Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for name, m in runs.items():
        history = [r for r in m["eval_history"] if metric in r]
        ax.plot([r["train_seconds"] for r in history],
                [_shown(metric, r[metric]) for r in history], marker="o", label=name)
    ax.axhline(_shown(metric, target), color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="training seconds", ylabel=metric.replace("_", " ")
           + (" %" if "accuracy" in metric else ""))
    if "accuracy" in metric:
        ax.set(ylim=(max(0, 100 * target - 30), 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.write_atomically(path, figures.png_bytes(fig))


def main(argv: list[str]) -> None:
    del argv
    try:
        paths = list(filter(None, FLAGS.runs.split(",")))
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
    except (FileNotFoundError, tf.errors.NotFoundError, KeyError) as err:
        sys.exit(f"error: {err}")
    if FLAGS.plot and runs:
        plot(runs, FLAGS.plot, FLAGS.target, metric)


if __name__ == "__main__":
    flags.DEFINE_string("runs", "", "Comma-separated run directories (model_dir).")
    flags.DEFINE_string("groups", "", "Comma-separated NAME=GLOB of run directories, "
                        "e.g. no_lookahead=runs/nolookahead_s*: an ablation table.")
    flags.DEFINE_float("target", 0.92, "Value of --metric whose first reaching is "
                       "reported (an accuracy as a fraction).")
    flags.DEFINE_string("metric", "", "The eval metric to compare, e.g. test_accuracy "
                        "(default: the one that picked the runs' best weights).")
    flags.DEFINE_string("plot", "", "Write the runs' accuracy-vs-seconds curves here.")
    cli.run(main)
