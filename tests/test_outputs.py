"""What a run shows and leaves: the progress bar or plain lines, TensorBoard
summaries, summary.png, metrics.json's curves, the schedule plot, predict, export."""
import io
import json
import logging
import os
import re
import shutil
import time

from absl import logging as absl_logging
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf

from conftest import small_tfrecord_dataset
from data import sources
import models
from trainer import loop
from trainer.output import progress as reporting, progress_bar, startup
from trainer.serving import export, predict

pytestmark = pytest.mark.figures  # (conftest: other tests get blank PNGs)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")


def test_live_terminal_detection(monkeypatch):
    assert progress_bar.is_live_terminal(FakeTerminal())
    assert not progress_bar.is_live_terminal(io.StringIO())  # a file or a pipe
    monkeypatch.setenv("CI", "true")
    assert not progress_bar.is_live_terminal(FakeTerminal())


def _progress(bars=None):
    progress = reporting.Progress(total_steps=20, steps_per_epoch=10,
                                  global_batch_size=8, start_step=0, bars=bars)
    for step in (5, 10, 15, 20):
        progress.add({"loss": (8.0, 40.0), "accuracy": (4.0, 40.0)}, 5, 0.5)
        progress.show(step, 0.1)
        if step % 10 == 0:
            progress.log(step, 0.1)
    return progress


def test_terminal_gets_a_live_bar_per_epoch_and_no_log_lines(caplog):
    terminal = FakeTerminal()
    bars = progress_bar.EpochBars(total_steps=20, steps_per_epoch=10, stream=terminal,
                                  width=230)
    with caplog.at_level(logging.INFO, logger="absl"):
        _progress(bars)
        absl_logging.info("capture works")  # so the absence below means something
    bars.close()
    shown = terminal.getvalue()
    assert "\r" in shown  # redrawn in place
    for text in ("epoch 1/2", "epoch 2/2", "10/10", "loss 0.2000", "accuracy 0.1000",
                 "lr 0.1", "80 img/s"):
        assert text in shown, text
    # After step 5: 5 steps of 8 images left in the epoch, 15 in the run, at 80 img/s.
    assert "ETA epoch 0:00:00 run 0:00:01" in shown
    assert "ETA epoch 0:00:00 run 0:00:00" in shown
    assert "capture works" in caplog.text and "step 10/20" not in caplog.text


def test_the_bar_is_drawn_at_most_every_show_every_and_at_each_epoch_end(monkeypatch):
    """At --steps_per_loop=1 the loop shows every step: fitting the bar's fields to
    the width, and the schedule's rate (a dozen eager ops), cost more than a small
    model's step. Drawn at most every SHOW_EVERY seconds, and at every epoch's end."""
    terminal = FakeTerminal()
    bars = progress_bar.EpochBars(total_steps=20, steps_per_epoch=10, stream=terminal,
                                  width=120)
    progress = reporting.Progress(20, 10, 8, start_step=0, bars=bars)
    clock = [100.0]
    monkeypatch.setattr(reporting, "_clock", lambda: clock[0])
    asked = []

    def learning_rate() -> float:
        asked.append(clock[0])
        return 0.1

    for step in range(1, 21):
        progress.add({"loss": (8.0, 8.0)}, 1, 0.01)
        progress.show(step, learning_rate)
        if step in (3, 13):
            clock[0] += reporting.SHOW_EVERY  # time passes: the next step is drawn
    bars.close()
    # The first step, the one after each pause, and the epochs' ends (10, 20).
    assert len(asked) == 5
    shown = terminal.getvalue()
    assert "10/10" in shown and "epoch 2/2" in shown and "lr 0.1" in shown


def test_a_start_up_phase_is_timed_and_never_silent_longer_than_the_heartbeat(caplog):
    start_up = startup.StartUp(heartbeat=0.05)
    with caplog.at_level(logging.INFO, logger="absl"):
        with start_up.phase("tracing the step"):
            time.sleep(0.4)
        with pytest.raises(ValueError), start_up.phase("restoring"):
            raise ValueError("a damaged checkpoint")
        beats = [r.getMessage() for r in caplog.records]
        time.sleep(0.2)  # each phase's heartbeat ends with it
        assert len(caplog.records) == len(beats)
    assert len(beats) >= 3 and all(b.startswith("... tracing the step (") and
                                   b.endswith(" s so far)") for b in beats), beats
    seconds = start_up.seconds()
    assert list(seconds) == ["tracing the step", "restoring"]
    assert seconds["tracing the step"] >= 0.4  # (lower bounds only: a loaded machine)
    text = start_up.describe()
    assert re.search(r"tracing the step \d+\.\d s, restoring \d+\.\d s, the rest \d+\.\d s$",
                     text), text
    assert start_up.since_command() >= 0.4  # (from the command's start)


def test_the_first_call_is_traced_then_timed_as_start_up():
    start_up = startup.StartUp()
    traced = []
    with start_up.first_call(True, lambda: traced.append(1), 0, 100, xla=True):
        pass
    with start_up.first_call(False, lambda: traced.append(2), 100, 200, xla=True):
        pass
    assert traced == [1]
    assert list(start_up.seconds()) == [
        "tracing the step", "the first call (compiling with XLA, steps 1-100)"]


def _bar_lines(width: int | None) -> list[str]:
    """The lines an airbench-like run's bar draws (4 metrics, FLOP/s of a measured
    peak, 10 epochs of 490 steps) on a terminal `width` columns wide."""
    terminal = FakeTerminal()
    bars = progress_bar.EpochBars(total_steps=4900, steps_per_epoch=490, stream=terminal,
                                  width=width)
    progress = reporting.Progress(4900, 490, 1024, start_step=0, bars=bars,
                                  flops_per_image=119e6, peak_flops=9e11)
    progress.add({"loss": (2.0923, 1.0), "accuracy": (0.3101, 1.0),
                  "grad_norm": (0.2715, 1.0), "skipped": (0.0, 1.0)}, 10, 6.0)
    progress.show(10, 0.736)
    bars.close()
    return [line for line in re.split("[\r\n]", terminal.getvalue()) if line]


@pytest.mark.parametrize("width", [80, 120, 230])
def test_the_bar_fits_the_terminal_and_keeps_the_etas(width):
    lines = _bar_lines(width)
    assert max(len(line) for line in lines) < width  # (the last column would wrap)
    last = lines[-1].rstrip()
    assert last.endswith("ETA epoch 0:04:48 run 0:48:54"), last  # whole (1,707 img/s)
    fields = ["loss 2.0923", "accuracy 0.3101", "grad_norm 0.2715", "skipped 0.0000",
              "lr 0.736", "1,707 img/s", "203 GFLOP/s (23% of peak)"]
    shown = [field for field in fields if field in last]
    if width == 230:
        assert shown == fields
    else:  # the least important first to go: the skipped count, then FLOP/s, ...
        assert "loss 2.0923" in shown and "skipped 0.0000" not in shown
        assert len(shown) < (4 if width == 80 else len(fields))


def test_the_bar_follows_the_terminals_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # (a stream without a terminal of its own)
    lines = _bar_lines(width=None)
    assert max(len(line) for line in lines) < 100 and "ETA epoch" in lines[-1]
    monkeypatch.setenv("COLUMNS", "230")
    assert "skipped 0.0000" in _bar_lines(width=None)[-1]


def test_plain_lines_off_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="absl"):
        _progress(bars=None)
    lines = [r.getMessage() for r in caplog.records if "step " in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("step 10/20  epoch 1.00")
    for text in ("loss 0.2000", "accuracy 0.1000", "lr 0.1", "80 img/s", "ETA 0:00:01"):
        assert text in lines[0]  # 10 steps x 8 images left at 80 img/s: 1 s
    assert lines[1].endswith("ETA 0:00:00")
    assert not any("\r" in line or "\x1b" in line for line in lines)


@pytest.fixture(scope="session")  # (a module fixture is rebuilt each time xdist returns)
def finished_run(tmp_path_factory):
    """One tiny run (2 evaluations) shown on a fake terminal."""
    from trainer.config import Config
    config = Config(model="cifar_cnn", model_size="tiny", dataset="synthetic",
                    model_dir=str(tmp_path_factory.mktemp("run")), batch_size=16,
                    eval_batch_size=256, train_steps=8, steps_per_loop=2, log_every=2, eval_every=4,
                    precision="float32", shuffle_buffer=64, histograms=True)
    terminal = FakeTerminal()
    with pytest.MonkeyPatch.context() as patch:  # session scope: before _no_ci applies
        patch.delenv("CI", raising=False)
        patch.setenv("TERM", "xterm")
        patch.setenv("COLUMNS", "230")  # the width of a fake terminal: all fields show
        metrics = loop.train_and_evaluate(config, display=terminal)
    return config, metrics, terminal.getvalue()


@pytest.mark.long(10)  # seconds, with -n 2
def test_run_on_a_terminal_shows_the_bar(finished_run):
    _, _, shown = finished_run
    assert "epoch 1/1" in shown and "8/8" in shown and "img/s" in shown


def _events(directory) -> dict[str, list]:
    tags = {}
    for name in os.listdir(directory):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append((event.step, value))
    return tags


def test_tensorboard_summaries_have_the_expected_tags(finished_run):
    config, metrics, _ = finished_run
    train = _events(os.path.join(config.model_dir, "train"))
    evals = _events(os.path.join(config.model_dir, "eval"))
    assert {"loss", "accuracy", "learning_rate", "images_per_second"} <= set(train)
    assert [step for step, _ in train["loss"]] == [2, 4, 6, 8]
    assert {"loss", "accuracy", "predictions", "confusion_matrix"} <= set(evals)
    last_accuracy = tf.make_ndarray(evals["accuracy"][-1][1].tensor)
    assert last_accuracy == pytest.approx(metrics["test_accuracy"])
    step, image = evals["confusion_matrix"][-1]
    assert step == 8
    # An image summary is [width, height, PNG bytes...].
    width, height, png = tf.make_ndarray(image.tensor)[:3]
    assert png.startswith(PNG_SIGNATURE) and int(width) > 100 and int(height) > 100
    # The whole prediction grid shows: its bottom row ends above the strip that
    # TensorBoard's scroll bar covers (about 12 of the ~320 pixels it shows it wide).
    grid = tf.io.decode_png(tf.make_ndarray(evals["predictions"][-1][1].tensor)[2],
                            channels=3).numpy()
    drawn = np.flatnonzero((grid < 250).any(axis=(1, 2)))
    assert drawn[-1] < grid.shape[0] - 0.05 * grid.shape[1]


def _hparams_backend(logdir: str):
    """TensorBoard's HParams plugin's view of `logdir`."""
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context
    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(logdir)
    runs.Reload()
    provider = data_provider.MultiplexerDataProvider(runs, logdir)
    return backend_context.Context(base_plugin.TBContext(
        logdir=logdir, multiplexer=runs, data_provider=provider))


def _session_groups(logdir: str) -> list:
    """TensorBoard's HParams table of `logdir`, as its plugin builds it."""
    from tensorboard import context
    from tensorboard.plugins.hparams import api_pb2, list_session_groups
    request = api_pb2.ListSessionGroupsRequest(
        allowed_statuses=[api_pb2.STATUS_UNKNOWN], start_index=0, slice_size=10)
    return list(list_session_groups.Handler(
        context.RequestContext(), _hparams_backend(logdir), "", request).run().session_groups)


def _hparams_columns(logdir: str) -> tuple[list[str], list[str]]:
    """The HParams table's settings and metrics, in the order its page shows them
    (the experiment's; the page moves those whose values differ to the front, as
    the experiment has them already)."""
    from tensorboard import context
    from tensorboard.plugins.hparams import api_pb2, get_experiment
    experiment = get_experiment.Handler(
        context.RequestContext(), _hparams_backend(logdir), "",
        api_pb2.GetExperimentRequest(hparams_limit=1000)).run()
    return ([info.name for info in experiment.hparam_infos],
            [info.name.tag for info in experiment.metric_infos])


def test_tensorboard_hparams_text_and_histograms(finished_run):
    """Read back as TensorBoard reads them, with --logdir=the run itself: its
    settings and final metrics in the HParams table, the settings as Text, weight
    and gradient histograms at each evaluation."""
    from tensorboard.backend.event_processing import event_accumulator
    from trainer import run_settings
    from trainer.output import hparams
    config, metrics, _ = finished_run
    groups = {group.name: group for group in _session_groups(config.model_dir)}
    group = groups.pop(hparams.trial_id(config.model_dir))
    assert group.hparams["train_steps"].number_value == 8
    assert group.hparams["model"].string_value == "cifar_cnn"
    assert "model_dir" not in group.hparams
    # Every setting has a visible value: an unset one is "(default)", not an empty
    # cell (--augment='' is the dataset's own augmentation).
    assert group.hparams["augment"].string_value == "(default)"
    assert group.hparams["data_dir"].string_value == "(default)"
    assert all(value.string_value for value in group.hparams.values()
               if value.WhichOneof("kind") == "string_value")
    # Beside it the recipe's row (no metrics): its values but the recipe's where the
    # run differs from it ...
    [recipe] = groups.values()
    assert recipe.name == "recipe: cifar_cnn, synthetic" and not recipe.metric_values
    assert recipe.hparams["train_steps"].number_value == 0
    assert recipe.hparams["seed"] == group.hparams["seed"]
    # ... so that those settings come first, then the rest by name; the metrics
    # follow the settings, the test metrics first.
    settings, metric_tags = _hparams_columns(config.model_dir)
    changed = sorted(run_settings.changed_from_recipe(config.settings()))
    assert "train_steps" in changed and "seed" not in changed
    assert settings[:len(changed)] == changed
    assert settings[len(changed):] == sorted(settings[len(changed):])
    assert metric_tags[0] == "eval/accuracy"
    values = {m.name.tag: m.value for m in group.metric_values}
    assert values["eval/accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert values["eval/loss"] == pytest.approx(metrics["test_loss"])
    assert values["train/loss"] == pytest.approx(metrics["train_loss"])

    settings = event_accumulator.EventAccumulator(
        os.path.join(config.model_dir, "hparams"), size_guidance={"tensors": 0})
    settings.Reload()
    text = tf.make_ndarray(settings.Tensors("settings")[0].tensor_proto).item().decode()
    changed, others = text.split("The other settings:")
    assert "| train_steps | `8` | `0` |" in changed and "| seed |" in others

    histograms = event_accumulator.EventAccumulator(
        os.path.join(config.model_dir, "histograms"), size_guidance={"tensors": 0})
    histograms.Reload()
    tags = histograms.Tags()["tensors"]
    assert "weights/logits/kernel" in tags and "gradients/logits/kernel" in tags
    assert len([t for t in tags if t.startswith("gradients/")]) == len(
        [t for t in tags if t.startswith("weights/")])
    assert [e.step for e in histograms.Tensors("gradients/logits/kernel")] == [4, 8]


def test_sample_gradients_are_the_training_gradient_and_change_nothing():
    """--histograms' gradient: the task's loss in training mode (batch-norm on the
    batch's statistics), as a tape over the model gives it, with the batch-norm
    statistics and the weights untouched."""
    import keras
    from conftest import classification
    from trainer import state as state_lib
    from trainer.output import histograms
    from trainer.tasks import base
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(x)))
    state = state_lib.single(model, keras.optimizers.SGD())
    task = classification()
    rng = np.random.default_rng(0)
    samples = {"image": rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8),
               "label": np.arange(6) % 10, "class_index": np.zeros(6)}
    before = [w.copy() for w in model.get_weights()]
    gradients = histograms.sample_gradients(task, state, samples)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # (the moving mean and variance too)
    with tf.GradientTape() as tape:
        loss, _ = task.loss({"label": tf.constant(samples["label"])},
                            model(base.normalize(task.spec, samples["image"]), training=True))
        loss = tf.reduce_mean(loss)
    for ours, theirs in zip(gradients, tape.gradient(loss, model.trainable_variables)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.long(15)  # seconds, with -n 2
def test_summary_png_and_metrics_curves(finished_run):
    config, metrics, _ = finished_run
    path = os.path.join(config.model_dir, "summary.png")
    data = open(path, "rb").read()
    assert data.startswith(PNG_SIGNATURE)
    image = tf.io.decode_png(data)
    assert image.shape[0] >= 500 and image.shape[1] >= 800 and image.shape[2] in (3, 4)
    written = json.load(open(os.path.join(config.model_dir, "metrics.json")))
    assert written["status"] == "done"
    assert [e["step"] for e in written["eval_history"]] == [4, 8]
    for record in written["eval_history"]:
        assert {"epoch", "wall_seconds", "train_seconds", "test_accuracy"} <= set(record)
    assert [r["step"] for r in written["train_history"]] == [2, 4, 6, 8]
    confusion = np.array(written["confusion_matrix"])
    assert confusion.shape == (10, 10) and confusion.sum() == metrics["test_examples"]
    assert np.trace(confusion) == round(metrics["test_accuracy"] * confusion.sum())


CIFAR10 = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
           "ship", "truck")
TF_FLOWERS = ("dandelion", "daisy", "tulips", "sunflowers", "roses")


@pytest.mark.parametrize("names, per_class", [(CIFAR10, 1000), (TF_FLOWERS, 110)])
def test_the_confusion_matrix_reads_on_a_tensorboard_card(names, per_class):
    """TensorBoard shows a picture in a card about 340 x 215 screen pixels
    (figures.CARD): the confusion matrix's picture, as the summaries write it, fits
    there at half its size (2 pixels a screen pixel, for HiDPI screens) with its
    text at least 9 screen pixels high; every count drawn, inside its cell; the
    rows' class names whole, the columns' upright, each a start of its name and
    none touching the next."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from trainer.output import figures, summaries
    rng = np.random.default_rng(0)
    count = len(names)
    matrix = rng.integers(0, per_class // (2 * count), (count, count))
    np.fill_diagonal(matrix, 0)
    matrix[np.diag_indices(count)] = per_class - matrix.sum(axis=1)
    fig = figures.confusion(matrix, list(names), "epoch 50.00, test accuracy 0.8412")
    height, width = summaries._png_image(fig).shape[1:3]
    assert width / 2 <= figures.CARD[0] + 1
    assert height / 2 <= 215 + 1  # the Time Series card's box, the strip below included
    [ax] = fig.axes
    texts = [*ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels(), ax.title]
    on_card = 80 / 72 / 2  # screen pixels a point is, at 80 dpi and half size
    assert min(text.get_fontsize() * on_card for text in texts) >= 9 - 1e-6
    assert sorted(int(t.get_text()) for t in ax.texts) == sorted(matrix.ravel())
    FigureCanvasAgg(fig).draw()
    cell = ax.get_window_extent().width / count
    assert max(t.get_window_extent().width for t in ax.texts) < cell - 2
    assert [t.get_text() for t in ax.get_yticklabels()] == list(names)
    columns = ax.get_xticklabels()
    assert all(t.get_rotation() == 0 and name.startswith(t.get_text().rstrip("."))
               for t, name in zip(columns, names))
    boxes = [t.get_window_extent() for t in columns]
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))


def test_summary_png_shows_a_short_run_and_its_settings():
    """A 30-step run's one log line and one evaluation, a --log_every=50 run's
    three: markers (a line of one point draws nothing), every panel from the
    start of the run to its end, the best in the legend (which hides no curve);
    the title's seed and the settings that differ from the recipe."""
    from trainer.config import Config
    from trainer.output import figures, recorder
    train = [{"step": 30, "epoch": 0.6, "train_loss": 2.1, "train_accuracy": 0.2}]
    evals = [{"step": 30, "epoch": 0.6, "test_loss": 2.2, "test_accuracy": 0.19}]
    fig = figures.summary(train, evals, [(0, 1e-3), (30, 1e-3)], 50,
                          ("loss", "accuracy"), ("accuracy", True), None, "t")
    loss, accuracy, rate = fig.axes
    assert [line.get_marker() for line in loss.get_lines()] == ["o", "s"]
    assert loss.get_xlabel() == "step" and loss.get_xlim()[0] < 0 < 30 < loss.get_xlim()[1]
    assert "best 0.19 (step 30)" in [t.get_text() for t in accuracy.get_legend().texts]
    long = [{"step": s, "epoch": s / 50, "train_loss": 1.0} for s in range(50, 5001, 50)]
    fig = figures.summary(long, [], [(0, 1e-3), (5000, 1e-3)], 50, ("loss",),
                          ("accuracy", True), None, "t")
    assert fig.axes[0].get_lines()[0].get_marker() == "None"  # 100 points: a line
    assert fig.axes[0].get_xlabel() == "epoch"

    config = Config(model="cifar_cnn", dataset="cifar10", image_size=32, seed=3,
                    learning_rate=0.01, model_dir="runs/x")
    assert recorder.settings_line(config.settings()
                                  ) == "seed 3; not the recipe's: learning_rate=0.01"
    assert recorder.settings_line(config.replace(seed=0, learning_rate=1e-3).settings()
                                  ) == "seed 0; cifar_cnn's recipe"


@pytest.mark.long(14)  # seconds, with -n 2
def test_resumed_run_keeps_the_earlier_curve(finished_run, tmp_path):
    config, _, _ = finished_run
    config = config.replace(model_dir=str(tmp_path / "copy"))
    shutil.copytree(finished_run[0].model_dir, config.model_dir)
    metrics = loop.train_and_evaluate(config.replace(train_steps=12))
    assert [e["step"] for e in metrics["eval_history"]] == [4, 8, 12]
    seconds = [e["train_seconds"] for e in metrics["eval_history"]]
    assert seconds == sorted(seconds)  # time continues across the resume
    assert [r["step"] for r in metrics["train_history"]] == [2, 4, 6, 8, 10, 12]
    # Run again when finished: evaluated again, the step's record replaced.
    again = loop.train_and_evaluate(config.replace(train_steps=12))
    assert [e["step"] for e in again["eval_history"]] == [4, 8, 12]


def test_log_handlers_come_back_after_an_error():
    import logging as std_logging
    root = std_logging.getLogger()
    before = list(root.handlers)
    bars = progress_bar.EpochBars(10, 5, FakeTerminal())
    with pytest.raises(RuntimeError):
        with bars.above_the_bar():
            assert all(isinstance(h, progress_bar._AboveTheBar) for h in root.handlers)
            raise RuntimeError("boom")
    assert root.handlers == before


def test_plot_schedule_writes_a_png(tiny_config):
    from trainer import build, schedules
    config = tiny_config.replace(lr_schedule="cosine", warmup_epochs=0.001)
    plan = build.plan(config, build.run_data(config).spec, 1)
    path = loop.plot_schedule(config.group(schedules.ScheduleSettings), plan,
                              config.model_dir, "cifar_cnn on cifar10")
    assert open(path, "rb").read().startswith(PNG_SIGNATURE)
    assert not os.path.exists(os.path.join(tiny_config.model_dir, "metrics.json"))


def _saved_tiny_model(model_dir, precision: str = "float32", **settings) -> tf.keras.Model:
    """A model_dir as a finished run leaves it: run_config.json + model.weights.h5."""
    from trainer.config import Config
    os.makedirs(model_dir, exist_ok=True)
    tf.keras.utils.set_random_seed(4)
    model = models.build("cifar_cnn", 10, (32, 32, 3), tiny=True)
    model.save_weights(os.path.join(model_dir, "model.weights.h5"))
    config = Config(model="cifar_cnn", model_size="tiny", dataset="cifar10",
                    precision=precision)
    config = config.with_settings(**settings) if settings else config
    with open(os.path.join(model_dir, "run_config.json"), "w") as f:
        json.dump(config.as_dict(), f)
    return model


def _expected_probabilities(model, images_uint8):
    spec = sources.get_spec("cifar10")
    normalized = (images_uint8.astype(np.float32) - np.array(spec.mean) * 255) / (
        np.array(spec.std) * 255)
    return tf.nn.softmax(model(normalized.astype(np.float32), training=False)).numpy()


def _images(count=3, size=32):
    return np.random.default_rng(1).integers(0, 256, (count, size, size, 3), np.uint8)


def test_predict_gives_the_in_memory_models_classes(tmp_path):
    model = _saved_tiny_model(tmp_path / "run")
    images = _images()
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"image{i}.png"))
        tf.io.write_file(paths[-1], tf.io.encode_png(image))
    big = tmp_path / "big.jpg"  # another size and format: resized as in evaluation
    tf.io.write_file(str(big), tf.io.encode_jpeg(np.repeat(np.repeat(images[0], 3, 0),
                                                           2, 1)))
    lines = predict.run(predict.parse([*paths, str(big), f"--model_dir={tmp_path}/run",
                                       "--top=1"]))
    names = sources.CIFAR10_CLASSES
    decoded_big = tf.io.decode_jpeg(tf.io.read_file(str(big)))
    resized = tf.image.resize(decoded_big, (32, 32), antialias=True)
    resized = tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)
    expected = _expected_probabilities(model, np.concatenate([images, resized[None]]))
    tops = [line.split()[1] for line in lines if line.startswith("  1. ")]
    assert tops == [names[i] for i in expected.argmax(-1)]
    assert "big.jpg (64x96)" in "\n".join(lines)


def test_predict_bad_model_dir_is_a_one_line_error(tmp_path, capsys):
    with flagsaver.flagsaver():  # predict's own flags, gone again afterwards
        predict.define_flags()
        argv = predict.FLAGS(["predict", "--model_dir", str(tmp_path), "x.png"])
        with pytest.raises(SystemExit) as exit_info:
            predict.main(argv)
    assert exit_info.value.code == 2
    assert "run_config.json not found" in capsys.readouterr().err


def _oversized(kind: str, width: int, height: int) -> bytes:
    """A small PNG or JPEG whose header declares width x height (a decompression
    bomb, as far as any decoder can tell before decoding)."""
    import struct
    import zlib
    if kind == "png":
        def chunk(name, data):
            return (struct.pack(">I", len(data)) + name + data
                    + struct.pack(">I", zlib.crc32(name + data)))
        return (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height,
                                                           8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(bytes(1000))) + chunk(b"IEND", b""))
    data = bytearray(tf.io.encode_jpeg(np.zeros((8, 8, 3), np.uint8)).numpy())
    at = 2
    while data[at + 1] not in (0xC0, 0xC2):  # to the frame header (SOF)
        at += 2 + struct.unpack(">H", data[at + 2:at + 4])[0]
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("kind, width, height, says", [
    ("png", 30000, 20000, "a 30000x20000 PNG (600,000,000 pixels); TensorFlow decodes a "
                          "PNG of under 536,870,912 pixels (2^29) and at most 1,000,000 "
                          "a side"),
    ("png", 1_000_001, 1, "a 1000001x1 PNG (1,000,001 pixels)"),
    ("jpeg", 20000, 10000, "a 20000x10000 JPEG of 3 component(s) (600,000,000 bytes "
                           "decoded); TensorFlow decodes a JPEG of under 536,870,912 "
                           "bytes (2^29)"),
])
def test_an_image_refused_for_its_size_is_called_too_large_with_its_size_and_the_limit(
        tmp_path, kind, width, height, says):
    """Issue 43: decompression bombs, rightly refused, were 'not a JPEG, PNG, GIF or
    BMP image'."""
    from trainer.serving import inference
    path = tmp_path / f"big.{kind}"
    path.write_bytes(_oversized(kind, width, height))
    with pytest.raises(inference.InferenceError) as error:
        inference.decode_file(str(path))
    assert str(error.value).startswith(f"cannot read image {path}: too large to "
                                       f"decode: {says}"), error.value
    path.write_bytes(_oversized(kind, width, height)[:3] + bytes(40))  # no header
    with pytest.raises(inference.InferenceError, match="not a JPEG, PNG, GIF or BMP"):
        inference.decode_file(str(path))


def test_export_round_trip_matches_the_keras_model(tmp_path):
    model = _saved_tiny_model(tmp_path / "run")
    export.export(str(tmp_path / "run"), str(tmp_path / "export"))
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    images = _images()
    expected = _expected_probabilities(model, images)
    from_pixels = loaded.signatures["predict_images"](images=tf.constant(images))
    np.testing.assert_allclose(from_pixels["probabilities"], expected, atol=1e-6)
    encoded = tf.stack([tf.io.encode_png(image) for image in images])
    from_bytes = loaded.signatures["serving_default"](image_bytes=encoded)
    np.testing.assert_allclose(from_bytes["probabilities"], expected, atol=1e-6)
    names = [n.decode() for n in from_bytes["class_name"].numpy()]
    assert names == [sources.CIFAR10_CLASSES[i] for i in expected.argmax(-1)]
    with pytest.raises(Exception, match="not empty"):
        export.export(str(tmp_path / "run"), str(tmp_path / "export"))
    # A new place, its parents missing (the docs' `--export_dir=export/cnn` in a
    # fresh checkout): made, as mkdir -p. One that cannot be: one line, the cause.
    nested = tmp_path / "exports" / "of" / "cnn"
    assert export.export(str(tmp_path / "run"), str(nested)) == str(nested)
    assert tf.saved_model.load(str(nested)).signatures["predict_images"]
    (tmp_path / "a_file").write_text("not a directory")  # (root passes a chmod)
    from data import files
    with pytest.raises(files.WriteError, match=r"--export_dir=.*a_file/new/cnn: cannot "
                       r"create .*a_file/new \(") as error:
        export.export(str(tmp_path / "run"), str(tmp_path / "a_file" / "new" / "cnn"))
    assert "\n" not in str(error.value)


@pytest.mark.filterwarnings("ignore:.*tf.lite.Interpreter is deprecated")
def test_export_tflite_serves_as_the_savedmodel_with_builtin_ops_alone(
        tmp_path, monkeypatch, capfd):
    """--tflite (issue 47): model.tflite, which the stock interpreter runs with
    TFLite's builtin ops alone, takes uint8 [1, 32, 32, 3] and gives the
    SavedModel's predict_images probabilities to 1e-4, normalization and the
    6-view test-time augmentation inside, in float32 (the run's config says
    mixed_bfloat16); labels.txt names the classes. A file that disagrees with the
    SavedModel is not written: one line, exit 7."""
    from trainer.serving import tflite
    model = _saved_tiny_model(tmp_path / "run", precision="mixed_bfloat16",
                              tta_flip=True, tta_translate=True)
    said = []
    out = export.export(str(tmp_path / "run"), str(tmp_path / "export"), tflite=True,
                        say=said.append)
    assert said[0] == f"wrote SavedModel {out}"
    assert said[1].startswith(f"wrote {out}/model.tflite (") and said[1].endswith(
        f"float32): uint8 [1, 32, 32, 3] (resize to 32x32 first) -> class_index, "
        f"probabilities; class names: {out}/labels.txt"), said
    assert said[2].startswith("  checked: max |TFLite - SavedModel| on 8 "), said
    data = (tmp_path / "export" / "model.tflite").read_bytes()
    capfd.readouterr()
    tf.lite.experimental.Analyzer.analyze(model_content=data)
    ops = set(re.findall(r"Op#\d+ (\w+)\(", capfd.readouterr().out))
    # Builtins are named in capitals (a custom op by its own name, Select TF ops Flex*):
    # the test-time augmentation's flip and reflect padding are in the file.
    assert {"CONV_2D", "REVERSE_V2", "MIRROR_PAD", "SOFTMAX"} <= ops, ops
    assert all(re.fullmatch(r"[A-Z0-9_]+", op) for op in ops), ops
    interpreter = tf.lite.Interpreter(model_content=data)  # (fails on a custom op)
    (given,) = interpreter.get_input_details()
    assert list(given["shape"]) == [1, 32, 32, 3] and given["dtype"] == np.uint8
    runner = interpreter.get_signature_runner()
    images = _images(4)
    served = tf.saved_model.load(out).signatures["predict_images"](
        images=tf.constant(images))
    rows = [runner(images=image[None]) for image in images]
    assert all(row["probabilities"].dtype == np.float32 for row in rows)
    probabilities = np.concatenate([row["probabilities"] for row in rows])
    np.testing.assert_allclose(probabilities, served["probabilities"], atol=1e-4, rtol=0)
    assert [int(row["class_index"][0]) for row in rows] == list(probabilities.argmax(-1))
    # What is compared differs between images, and the augmentation changes it.
    assert np.ptp(probabilities, axis=0).max() > 1e-3
    assert np.abs(_expected_probabilities(model, images) - probabilities).max() > 1e-3
    assert (tmp_path / "export" / "labels.txt").read_text().splitlines() == list(
        sources.CIFAR10_CLASSES)

    monkeypatch.setattr(tflite, "TOLERANCE", -1.0)  # no file can pass
    with flagsaver.flagsaver():  # export's own flags, gone again afterwards
        export.define_flags()
        argv = export.FLAGS(["export", f"--model_dir={tmp_path / 'run'}",
                             f"--export_dir={tmp_path / 'refused'}", "--tflite"])
        with pytest.raises(SystemExit) as exit_info:
            export.main(argv)
    assert exit_info.value.code == export.TFLITE_MISMATCH_EXIT_CODE == 7
    said = capfd.readouterr().err
    error = [line for line in said.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in said, said
    assert error[0].startswith("error: model.tflite does not give the SavedModel's "
                               "outputs: max |TFLite - SavedModel| on 8 "), error
    assert not [p for p in os.listdir(tmp_path) if p.startswith("refused")]


def test_predict_works_without_the_tfrecord_files(tmp_path, tiny_config):
    """A TFRecord run keeps its dataset.json in model_dir: class names, image size
    and normalization survive the data files being gone."""
    path = small_tfrecord_dataset(tmp_path, ("ants", "bees"), 8, (20, 24, 3))
    config = tiny_config.replace(model="convnet", dataset=f"tfrecord:{path}",
                                 batch_size=4, train_steps=2, eval_every=2)
    loop.train_and_evaluate(config)
    shutil.rmtree(tmp_path / "rec")
    lines = predict.run(predict.parse([f"--model_dir={config.model_dir}",
                                       str(tmp_path / "photos" / "ants" / "0.png")]))
    assert "input 16x16" in lines[0] and "(24x20)" in lines[1]
    assert sorted(line.split()[1] for line in lines[2:]) == ["ants", "bees"]


def test_a_run_that_has_not_finished_serves_its_best_or_newest_weights(
        tiny_config, finished_tiny, caplog):
    """predict and export (both through TrainedModel) on a stopped run: without
    model.weights.h5, best.weights.h5; without that, the newest checkpoint; each
    said in one line. (finished_tiny: checkpoints at steps 2 and 4, best at 4.)"""
    from trainer.serving import inference
    model_dir = tiny_config.model_dir
    images = _images()
    final = inference.TrainedModel(model_dir)
    assert final.weights == "model.weights.h5"
    expected = final.serve(images)["probabilities"]
    os.remove(os.path.join(model_dir, "model.weights.h5"))
    with caplog.at_level(logging.WARNING):
        best = inference.TrainedModel(model_dir)
    said = "best.weights.h5 (step 4; the run has no model.weights.h5)"
    assert best.weights == said and f"using {said}" in caplog.text
    np.testing.assert_allclose(best.serve(images)["probabilities"], expected, atol=1e-6)
    os.remove(os.path.join(model_dir, "best.weights.h5"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        newest = inference.TrainedModel(model_dir)
    assert newest.weights == ("ckpt-4 (step 4; the run has no model.weights.h5; it has "
                              "no best.weights.h5)") and newest.weights in caplog.text
    np.testing.assert_allclose(newest.serve(images)["probabilities"], expected, atol=1e-6)
    for name in os.listdir(model_dir):
        if name.startswith("ckpt-") or name == "checkpoint":
            os.remove(os.path.join(model_dir, name))
    with pytest.raises(inference.InferenceError, match="no model.weights.h5, "
                                                       "best.weights.h5 or checkpoint"):
        inference.TrainedModel(model_dir)


@pytest.mark.long(12)  # seconds, with -n 3
def test_a_resumed_run_never_serves_its_earlier_end(tiny_config, finished_tiny,
                                                    monkeypatch, caplog):
    """Issue 43: a finished run resumed with a longer --train_steps and stopped
    (metrics.json 'stopped', ckpt-6 newer than the step-4 model.weights.h5):
    predict and export serve the current training's best weights, else its newest
    checkpoint, and say which; never the step-4 file without a word."""
    from trainer import loop
    from trainer.output import progress
    from trainer.serving import inference
    model_dir = tiny_config.model_dir
    images = _images()
    earlier_end = inference.TrainedModel(model_dir).serve(images)["probabilities"]
    show = progress.Progress.show

    def stopped_at_8(self, step, learning_rate):  # (ckpt-6 saved; none at 8)
        if step == 8:
            raise KeyboardInterrupt
        show(self, step, learning_rate)

    monkeypatch.setattr(progress.Progress, "show", stopped_at_8)
    with pytest.raises(KeyboardInterrupt):
        loop.train_and_evaluate(tiny_config.replace(train_steps=20))
    metrics = json.loads(open(os.path.join(model_dir, "metrics.json")).read())
    assert (metrics["status"], metrics["steps"]) == ("stopped", 8)
    assert metrics["ended_by"].startswith("KeyboardInterrupt")
    with caplog.at_level(logging.WARNING):
        best = inference.TrainedModel(model_dir)
    assert best.weights == (
        "best.weights.h5 (step 4; the run has not finished: its metrics.json says "
        "'stopped' at step 8; its model.weights.h5 is an earlier end's)")
    assert f"using {best.weights}" in caplog.text
    os.remove(os.path.join(model_dir, "best.weights.h5"))
    newest = inference.TrainedModel(model_dir)
    assert newest.weights.startswith("ckpt-6 (step 6; the run has not finished")
    served = newest.serve(images)["probabilities"]
    assert not np.allclose(served, earlier_end, atol=1e-6)  # step 6's, not step 4's


def test_a_log_window_whose_every_update_was_skipped_shows_no_loss(monkeypatch):
    """Issue 43: with every step of a window skipped (--on_nan=skip_step) the line
    said 'loss 0.0000'; no applied update counted a loss: '-', and the history
    record has none (the range test then sees no finite loss and stops)."""
    from trainer.output import progress
    shown = progress.Progress(total_steps=4, steps_per_epoch=4, global_batch_size=16,
                              start_step=0)
    shown.add({"loss": (0.0, 0.0), "accuracy": (0.0, 0.0), "skipped": (2.0, 2.0)}, 2,
              0.5)
    lines = []  # (the line itself: absl's verbosity is another test's to set)
    monkeypatch.setattr(progress.logging, "info", lambda text, *args: lines.append(
        text % args))
    record = shown.log(2, 0.1)
    assert "loss -  accuracy -  skipped 1.0000" in lines[0], lines
    assert "train_loss" not in record and record["train_skipped"] == 1.0
