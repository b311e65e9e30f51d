"""Pictures of a run, drawn with matplotlib (headless): the learning-rate schedule,
grids of images (a task draws its predictions with them), a confusion matrix, and
summary.png. Each function returns a Figure or draws into one; `png_bytes` encodes
one (for files and TensorBoard images)."""
import functools
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


def new_figure(tiles: int, columns: int | None = None) -> mpl_figure.Figure:
    """An empty figure sized for a grid of `tiles` image tiles (and a title line:
    `titled`): 5 columns up to 25 tiles (TensorBoard shows a picture about 320
    pixels wide: a squarer grid has tiles twice the size of 10 columns'), else 10."""
    columns = min(columns or (5 if tiles <= 25 else 10), tiles)
    rows = -(-tiles // columns)
    return mpl_figure.Figure(figsize=(1.6 * columns, 1.8 * rows + 0.5))


def _fitting_columns(count: int, tile: tuple[float, float], box: tuple[float, float]
                     ) -> int:
    """The number of columns that shows `count` tiles of `tile` (width, height)
    largest in `box` (width, height); of equals, the one with fewer rows."""
    def scale(columns: int) -> float:
        return min(box[0] / (columns * tile[0]), box[1] / (-(-count // columns) * tile[1]))
    return max(range(count, 0, -1), key=scale)


def image_grid(figure, images, titles, colors=None, columns: int | None = None) -> None:
    """Tiles of uint8 images [N, H, W, C] in a (sub)figure, each with its title (in
    its color, default black), `columns` wide (default: as many as show the tiles
    largest in the figure), at the figure's top. One canvas in one Axes, not an
    Axes per tile: a 20-tile grid draws in 0.15 s instead of 0.46 (every run draws
    two)."""
    images = np.asarray(images, np.uint8)
    if images.shape[-1] == 1:  # grayscale: imshow wants RGB
        images = np.repeat(images, 3, axis=-1)
    count, height, width, channels = images.shape
    gap_x, gap_y = max(1, width // 8), max(8, height // 2)  # room for two title lines
    margins = _margins(figure, 0.02, 0.02, 0.02, 0.02)
    if columns is None:
        inches = _inches(figure)
        columns = _fitting_columns(count, (width + gap_x, height + gap_y), (
            inches[0] * (margins["right"] - margins["left"]),
            inches[1] * (margins["top"] - margins["bottom"])))
    columns = min(columns, count)
    rows = -(-count // columns)
    canvas = np.full((rows * (height + gap_y), columns * (width + gap_x), channels),
                     255, np.uint8)
    ax = figure.subplots(gridspec_kw=margins)
    ax.axis("off")
    ax.set_anchor("N")  # spare room below the grid, not between it and its title
    for i in range(count):
        row, column = divmod(i, columns)
        top, left = row * (height + gap_y) + gap_y, column * (width + gap_x)
        canvas[top:top + height, left:left + width] = images[i]
        ax.text(left + width / 2, top - 1, titles[i], ha="center", va="bottom",
                fontsize=7, color=colors[i] if colors is not None else "black")
    ax.imshow(canvas, interpolation="antialiased")  # nearest when enlarging 3x+


def write_png(path: str, image) -> None:
    """Writes a uint8 [H, W, C] image as a PNG file (and its folder), atomically;
    files.WriteError naming the file if either cannot be written."""
    import os
    import tensorflow as tf  # (only here: the figures need no TensorFlow)
    from data import files
    try:
        tf.io.gfile.makedirs(os.path.dirname(path) or ".")
    except tf.errors.OpError as err:  # (a full disk, no permission): the file's failure
        raise files.WriteError(f"could not write {path} ({files.reason_of(err)}; its "
                               f"folder could not be made)") from err
    files.write_atomically(path, tf.io.encode_png(np.asarray(image, np.uint8)).numpy())


def name_of(class_names, index: int) -> str:
    """Class `index`'s name, or the number if there are fewer names."""
    index = int(index)
    return class_names[index] if index < len(class_names) else str(index)


# TensorBoard's image cards (measured in chromium, TensorBoard 2.21): the Time
# Series tab fits a picture into a box 215 screen pixels high and as wide as its
# card (about 340 at the default card width), the Images tab draws it 350 wide. A
# picture to be read there is laid out in those screen pixels, at twice as many
# image pixels (crisp on a HiDPI screen) at the 80 dpi of TensorBoard's pictures
# (trainer/output/summaries.py), which add a white strip 6% of their width high.
CARD = (340, 195)  # screen pixels: 215 high, less the strip
CARD_PIXEL = 2 / 80  # inches: one screen pixel of a card
CARD_FONT = 9  # screen pixels: the smallest text that reads on a card


@functools.lru_cache(maxsize=1)
def _default_font():
    """matplotlib's default font (DejaVu Sans), at 100 pixels, to measure texts."""
    from matplotlib import font_manager, ft2font
    face = ft2font.FT2Font(font_manager.findfont(font_manager.FontProperties()))
    face.set_size(100, 72)
    return face


def _card_text_width(text: str, font: float = CARD_FONT) -> float:
    """`text`'s width in screen pixels at `font` pixels, as Agg lays it out (a
    millisecond; a drawn text's extent costs five)."""
    face = _default_font()
    face.set_text(text, 0.0)
    return face.get_width_height()[0] / 64 / 100 * font


def _cut_to(name: str, width: float) -> str:
    """`name`, or its longest start with a "." that is `width` screen pixels wide."""
    if _card_text_width(name) <= width:
        return name
    cut = len(name) - 1
    while cut > 1 and _card_text_width(name[:cut] + ".") > width:
        cut -= 1
    return name[:cut] + "."


def confusion(matrix: np.ndarray, class_names, title: str = "") -> mpl_figure.Figure:
    """Rows: true class; columns: predicted; cells: counts (up to 20 classes),
    shaded by row share. Laid out for a TensorBoard card (CARD): 9-pixel text
    there, cells at least as wide as their counts and a text line high, the
    columns' names cut to fit (the rows' are whole, in the same order); more
    classes than fit make a larger picture (the card's actual-size button shows
    it)."""
    matrix = np.asarray(matrix, np.float64)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    names = [name_of(class_names, i) for i in range(len(matrix))]
    count, font, line = len(matrix), CARD_FONT, 1.3 * CARD_FONT
    counts = count <= 20
    names_width = max(_card_text_width(name) for name in names)
    digits = len(f"{matrix.max():.0f}") if matrix.size else 1
    left, right = 4 + line + names_width + 4, 6  # "true", the names, the ticks
    top = 4 + 1.2 * (CARD_FONT + 1) * ((title or "x").count("\n") + 1) + 4
    width = max(_card_text_width("0" * digits) + 6 if counts else 0, 10,
                (CARD[0] - left - right) / count)
    # The columns' names upright, cut to fit, if that leaves 4 characters of each
    # and tells them apart; else (and beyond 20 classes) turned, whole.
    columns = [_cut_to(name, width - 2) for name in names] if counts else names
    upright = counts and len(set(columns)) == count and all(
        cut == name or len(cut) - 1 >= 4 for cut, name in zip(columns, names))
    bottom = 3 + (line if upright else names_width + 4) + line + 3
    height = max(font + 5 if counts else 1.2 * font, (CARD[1] - top - bottom) / count)
    fig = mpl_figure.Figure(figsize=((left + count * width + right) * CARD_PIXEL,
                                     (top + count * height + bottom) * CARD_PIXEL))
    ax = fig.subplots(gridspec_kw=_margins(
        fig, left=left * CARD_PIXEL, right=right * CARD_PIXEL,
        bottom=bottom * CARD_PIXEL, top=top * CARD_PIXEL))
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    pt = CARD_PIXEL * 72  # points a screen pixel of a card is
    ax.set_xticks(range(count), columns if upright else names, rotation=0 if upright else 90,
                  fontsize=font * pt)
    ax.set_yticks(range(count), names, fontsize=font * pt)
    ax.tick_params(length=2 * pt, pad=1.5 * pt)
    ax.set_xlabel("predicted", fontsize=font * pt, labelpad=1 * pt)
    ax.set_ylabel("true", fontsize=font * pt, labelpad=1 * pt)
    ax.set_title(title or "confusion matrix", fontsize=(font + 1) * pt, pad=3 * pt)
    if counts:
        for (row, col), value in np.ndenumerate(matrix):
            ax.text(col, row, f"{value:.0f}", ha="center", va="center", fontsize=font * pt,
                    color="white" if shares[row, col] > 0.5 else "black")
    return fig


FEW_POINTS = 25  # a curve with up to this many points shows them as markers


def _marker(count: int, few: str = "o") -> dict:
    """Markers on a curve of few points (a --log_every=50 run's 3, a 30-step run's
    one: a line of one point draws nothing), none on a long run's."""
    return dict(marker=few, markersize=4) if count <= FEW_POINTS else {}


def summary(train_history: list[dict], eval_history: list[dict],
            schedule_points: list[tuple[int, float]], steps_per_epoch: int,
            curves: tuple[str, ...], best: tuple[str, bool], draw_samples, title: str
            ) -> mpl_figure.Figure:
    """summary.png: each metric of `curves` (train and eval) over epochs (over steps
    for a run shorter than an epoch), the learning rate, and the task's sample
    predictions (draw_samples(subfigure), or None). best: (metric, higher is
    better), marked on its curve and named in the legend (placed where it hides
    no curve). `title` may hold several lines."""
    fig = mpl_figure.Figure(figsize=(14, 9))
    top, bottom = titled(fig, title).subfigures(2, 1, height_ratios=[1, 1.25])
    axes = top.subplots(1, len(curves) + 1, gridspec_kw=_margins(
        top, left=0.6, right=0.15, bottom=0.55, top=0.35, wspace=0.2))
    last_epoch = max((r["epoch"] for r in train_history + eval_history), default=0)
    by_step = last_epoch < 1
    unit = "step" if by_step else "epoch"

    def x_of(record: dict) -> float:
        return record["step"] if by_step else record["epoch"]

    metric, higher = best
    for ax, name in zip(axes, curves):
        for history, key, label in ((train_history, f"train_{name}", "train"),
                                    (eval_history, f"test_{name}", "eval")):
            points = [(x_of(r), r[key]) for r in history if key in r]
            if points:
                ax.plot(*zip(*points), label=label,
                        **_marker(len(points), "o" if label == "train" else "s"))
        scored = [r for r in eval_history if f"test_{name}" in r]
        if name == metric and scored:
            pick = (max if higher else min)(scored, key=lambda r: r[f"test_{name}"])
            ax.plot([x_of(pick)], [pick[f"test_{name}"]], linestyle="none", marker="*",
                    markersize=13, color="gold", markeredgecolor="black",
                    label=f"best {pick[f'test_{name}']:.4g} ({unit} "
                          f"{x_of(pick):.{0 if by_step else 2}f})", zorder=3)
        ax.set(xlabel=unit, title=name)
        ax.margins(y=0.1)
        ax.grid(alpha=0.3)
    steps, rates = zip(*schedule_points)
    axes[-1].plot(np.array(steps) / (1 if by_step else steps_per_epoch), rates)
    axes[-1].set(xlabel=unit, title="learning rate")
    axes[-1].set_ylim(bottom=0)
    axes[-1].grid(alpha=0.3)
    # Every panel from the start to the end of the run (the schedule's span): a
    # run's few points read as where in the run they were, not as a lone dot in
    # the middle of an axis of its own.
    end = max(steps[-1] / (1 if by_step else steps_per_epoch),
              max((x_of(r) for r in train_history + eval_history), default=0))
    for ax in axes:
        ax.set_xlim(-0.03 * end, 1.03 * end)
    for ax in axes[:-1]:
        ax.legend(loc="best", fontsize=9)  # (placed once the limits are final)
    if draw_samples is not None:
        draw_samples(titled(bottom, "sample test predictions", fontsize=10))
    return fig
