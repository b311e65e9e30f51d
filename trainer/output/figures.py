"""Pictures of a run, drawn with matplotlib (headless): the learning-rate schedule,
grids of images (a task draws its predictions with them), a confusion matrix, and
summary.png. Each function returns a Figure or draws into one; `png_bytes` encodes
one (for files and TensorBoard images)."""
import io

import matplotlib

matplotlib.use("Agg")  # no display: files only, also on servers and in CI
from matplotlib import figure as mpl_figure  # noqa: E402
import numpy as np  # noqa: E402

RIGHT, WRONG = "#1a7f37", "#cf222e"  # green, red


def png_bytes(fig: mpl_figure.Figure, dpi: int = 100) -> bytes:
    """The figure as PNG. Every figure here is laid out by hand, in inches: no
    bbox_inches="tight" (it draws the figure twice) and no layout engine
    ("constrained" measures every text and draws again: summary.png 0.44 s instead
    of 0.2, each evaluation's two TensorBoard pictures 0.41 s instead of 0.2)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def schedule(points: list[tuple[int, float]], steps_per_epoch: int,
             title: str = "learning rate") -> mpl_figure.Figure:
    """The learning rate over epochs, from (step, lr) points."""
    fig = mpl_figure.Figure(figsize=(6, 3.5))
    ax = fig.subplots(gridspec_kw=_margins(fig, left=0.8, bottom=0.6, top=0.4))
    steps, rates = zip(*points)
    ax.plot(np.array(steps) / steps_per_epoch, rates)
    ax.set(xlabel="epoch", ylabel="learning rate", title=title)
    ax.grid(alpha=0.3)
    return fig


def _margins(figure, left: float = 0.1, right: float = 0.1, bottom: float = 0.1,
             top: float = 0.1, **gridspec) -> dict:
    """gridspec_kw placing a (sub)figure's axes these many inches from its edges."""
    width, height = _inches(figure)
    return dict(left=left / width, right=1 - right / width, bottom=bottom / height,
                top=1 - top / height, **gridspec)


def _inches(figure) -> tuple[float, float]:
    """A figure's or subfigure's width and height in inches."""
    box = figure.bbox  # in display pixels, at the root figure's dpi
    return box.width / figure.dpi, box.height / figure.dpi


def titled(figure, title: str, fontsize: float = 12) -> "mpl_figure.SubFigure":
    """`title` in a strip across the top of a (sub)figure; returns the rest, for
    drawing in (what suptitle does, without a layout engine to make room for it)."""
    height = _inches(figure)[1]
    strip = 0.3 + fontsize / 72 * (title.count("\n") + 1)
    head, body = figure.subfigures(2, 1, height_ratios=[strip, max(height - strip, 0.1)])
    head.text(0.5, 0.5, title, ha="center", va="center", fontsize=fontsize)
    return body


def new_figure(tiles: int, columns: int = 10) -> mpl_figure.Figure:
    """An empty figure sized for a grid of `tiles` image tiles (and a title line:
    `titled`)."""
    columns = min(columns, tiles)
    rows = -(-tiles // columns)
    return mpl_figure.Figure(figsize=(1.6 * columns, 1.8 * rows + 0.5))


def image_grid(figure, images, titles, colors=None, columns: int = 10) -> None:
    """Tiles of uint8 images [N, H, W, C] in a (sub)figure, each with its title (in
    its color, default black). One canvas in one Axes, not an Axes per tile: a
    20-tile grid draws in 0.15 s instead of 0.46 (every run draws two)."""
    images = np.asarray(images, np.uint8)
    if images.shape[-1] == 1:  # grayscale: imshow wants RGB
        images = np.repeat(images, 3, axis=-1)
    count, height, width, channels = images.shape
    columns = min(columns, count)
    rows = -(-count // columns)
    gap_x, gap_y = max(1, width // 8), max(8, height // 2)  # room for two title lines
    canvas = np.full((rows * (height + gap_y), columns * (width + gap_x), channels),
                     255, np.uint8)
    ax = figure.subplots(gridspec_kw=_margins(figure, 0.02, 0.02, 0.02, 0.02))
    ax.axis("off")
    for i in range(count):
        row, column = divmod(i, columns)
        top, left = row * (height + gap_y) + gap_y, column * (width + gap_x)
        canvas[top:top + height, left:left + width] = images[i]
        ax.text(left + width / 2, top - 1, titles[i], ha="center", va="bottom",
                fontsize=7, color=colors[i] if colors is not None else "black")
    ax.imshow(canvas, interpolation="antialiased")  # nearest when enlarging 3x+


def write_png(path: str, image) -> None:
    """Writes a uint8 [H, W, C] image as a PNG file (and its folder), atomically."""
    import os
    import tensorflow as tf  # (only here: the figures need no TensorFlow)
    from data import files
    tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    files.write_atomically(path, tf.io.encode_png(np.asarray(image, np.uint8)).numpy())


def name_of(class_names, index: int) -> str:
    """Class `index`'s name, or the number if there are fewer names."""
    index = int(index)
    return class_names[index] if index < len(class_names) else str(index)


def confusion(matrix: np.ndarray, class_names, title: str = "") -> mpl_figure.Figure:
    """Rows: true class; columns: predicted; cells: counts, shaded by row share."""
    matrix = np.asarray(matrix, np.float64)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    names = [name_of(class_names, i) for i in range(len(matrix))]
    size = max(4.0, 0.45 * len(matrix) + 2)
    labels = 0.45 + 0.075 * max(len(name) for name in names)  # tick labels + axis label
    fig = mpl_figure.Figure(figsize=(size + labels, size + labels))
    ax = fig.subplots(gridspec_kw=_margins(fig, left=labels, bottom=labels, top=0.45))
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
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
            curves: tuple[str, ...], best: tuple[str, bool], draw_samples, title: str
            ) -> mpl_figure.Figure:
    """summary.png: each metric of `curves` (train and eval) over epochs, the
    learning rate, and the task's sample predictions (draw_samples(subfigure), or
    None). best: (metric, higher is better), marked on its curve."""
    fig = mpl_figure.Figure(figsize=(14, 9))
    top, bottom = titled(fig, title).subfigures(2, 1, height_ratios=[1, 1.25])
    axes = top.subplots(1, len(curves) + 1, gridspec_kw=_margins(
        top, left=0.6, right=0.15, bottom=0.55, top=0.35, wspace=0.2))
    for ax, name in zip(axes, curves):
        for history, key, label in ((train_history, f"train_{name}", "train"),
                                    (eval_history, f"test_{name}", "eval")):
            points = [(r["epoch"], r[key]) for r in history if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if label == "eval" else None,
                        label=label)
        ax.set(xlabel="epoch", title=name)
        ax.grid(alpha=0.3)
        ax.legend()
        metric, higher = best
        key = f"test_{metric}"
        scored = [r for r in eval_history if key in r]
        if name == metric and scored:
            pick = (max if higher else min)(scored, key=lambda r: r[key])
            ax.annotate(f"best {pick[key]:.4g}", (pick["epoch"], pick[key]), fontsize=8,
                        textcoords="offset points", xytext=(-40, -15))
    steps, rates = zip(*schedule_points)
    axes[-1].plot(np.array(steps) / steps_per_epoch, rates)
    axes[-1].set(xlabel="epoch", title="learning rate")
    axes[-1].grid(alpha=0.3)
    if draw_samples is not None:
        draw_samples(titled(bottom, "sample test predictions", fontsize=10))
    return fig
