"""Pictures of a run, drawn with matplotlib (headless): the learning-rate schedule,
a grid of test predictions, a confusion matrix, and summary.png. Each function
returns a Figure; `png_bytes` encodes one (for files and TensorBoard images)."""
import io

import matplotlib

matplotlib.use("Agg")  # no display: files only, also on servers and in CI
from matplotlib import figure as mpl_figure  # noqa: E402
import numpy as np  # noqa: E402

RIGHT, WRONG = "#1a7f37", "#cf222e"  # green, red


def png_bytes(fig: mpl_figure.Figure, dpi: int = 100) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def schedule(points: list[tuple[int, float]], steps_per_epoch: int,
             title: str = "learning rate") -> mpl_figure.Figure:
    """The learning rate over epochs, from (step, lr) points."""
    fig = mpl_figure.Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    steps, rates = zip(*points)
    ax.plot(np.array(steps) / steps_per_epoch, rates)
    ax.set(xlabel="epoch", ylabel="learning rate", title=title)
    ax.grid(alpha=0.3)
    return fig


def _draw_predictions(subfig, samples: dict, class_names, columns: int) -> None:
    """Tiles of images titled 'predicted (p%)', green if right, red if wrong, with
    the true class under the wrong ones."""
    count = len(samples["labels"])
    rows = -(-count // columns)
    axes = np.atleast_1d(subfig.subplots(rows, columns)).ravel()
    for ax in axes:
        ax.axis("off")
    for i in range(count):
        label, predicted = int(samples["labels"][i]), int(samples["predictions"][i])
        right = label == predicted
        axes[i].imshow(np.asarray(samples["images"][i], np.uint8),
                       interpolation="nearest")
        title = f"{_name(class_names, predicted)} ({100 * samples['confidence'][i]:.0f}%)"
        if not right:
            title += f"\ntrue: {_name(class_names, label)}"
        axes[i].set_title(title, fontsize=7, color=RIGHT if right else WRONG)


def _name(class_names, index: int) -> str:
    return class_names[index] if index < len(class_names) else str(index)


def predictions(samples: dict, class_names, columns: int = 5,
                title: str = "") -> mpl_figure.Figure:
    """samples: images (uint8 [N, H, W, 3]), labels, predictions, confidence."""
    rows = -(-len(samples["labels"]) // columns)
    fig = mpl_figure.Figure(figsize=(1.6 * columns, 1.8 * rows), layout="constrained")
    _draw_predictions(fig, samples, class_names, columns)
    if title:
        fig.suptitle(title)
    return fig


def confusion(matrix: np.ndarray, class_names, title: str = "") -> mpl_figure.Figure:
    """Rows: true class; columns: predicted; cells: counts, shaded by row share."""
    matrix = np.asarray(matrix, np.float64)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    size = max(4.0, 0.45 * len(matrix) + 2)
    fig = mpl_figure.Figure(figsize=(size, size), layout="constrained")
    ax = fig.subplots()
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    names = [_name(class_names, i) for i in range(len(matrix))]
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true", title=title or "confusion matrix")
    if len(matrix) <= 20:
        for (row, col), count in np.ndenumerate(matrix):
            ax.text(col, row, f"{count:.0f}", ha="center", va="center", fontsize=7,
                    color="white" if shares[row, col] > 0.5 else "black")
    return fig


def summary(train_history: list[dict], eval_history: list[dict],
            schedule_points: list[tuple[int, float]], steps_per_epoch: int,
            samples: dict | None, class_names, title: str) -> mpl_figure.Figure:
    """summary.png: loss and accuracy (train and eval) over epochs, the learning
    rate, and a grid of sample test predictions."""
    fig = mpl_figure.Figure(figsize=(14, 9), layout="constrained")
    fig.suptitle(title)
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.25])
    loss_ax, accuracy_ax, lr_ax = top.subplots(1, 3)
    curves = [(loss_ax, "loss", "train_loss", "test_loss"),
              (accuracy_ax, "accuracy", "train_accuracy", "test_accuracy")]
    for ax, name, train_key, eval_key in curves:
        for history, key, label in ((train_history, train_key, "train"),
                                    (eval_history, eval_key, "eval")):
            points = [(r["epoch"], r[key]) for r in history if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if label == "eval" else None,
                        label=label)
        ax.set(xlabel="epoch", title=name)
        ax.grid(alpha=0.3)
        ax.legend()
    if eval_history:
        best = max(eval_history, key=lambda r: r["test_accuracy"])
        accuracy_ax.annotate(f"best {100 * best['test_accuracy']:.2f}%",
                             (best["epoch"], best["test_accuracy"]), fontsize=8,
                             textcoords="offset points", xytext=(-40, -15))
    steps, rates = zip(*schedule_points)
    lr_ax.plot(np.array(steps) / steps_per_epoch, rates)
    lr_ax.set(xlabel="epoch", title="learning rate")
    lr_ax.grid(alpha=0.3)
    if samples is not None:
        bottom.suptitle("sample test predictions (green right, red wrong)", fontsize=10)
        _draw_predictions(bottom, samples, class_names, columns=min(
            10, len(samples["labels"])))
    return fig
