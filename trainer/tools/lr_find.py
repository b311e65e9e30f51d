"""The learning-rate range test (Smith 2017; fastai's lr_find): train the run's
model from its initial weights while the learning rate climbs exponentially from
--lr_min to --lr_max, one step each, and plot the loss against it:

    python -m trainer.tools.lr_find --model=cifar_cnn --dataset=cifar10 [run flags]

It is the run itself (trainer.main's flags, task, state, step, replicas and
pipeline: loop.train_and_evaluate with --lr_schedule=range_test) with a callback,
`RangeTest`, that reads the loss of every step and stops the run once the loss
has diverged (4x its smoothed minimum). Writes lr_find.png and lr_find.json
(learning rates, losses, the suggestion) to --output_dir (default:
runs/<model>_<dataset>..._lr_find) and prints the suggested learning rate: where
the smoothed loss falls fastest (fastai's "steep"), and the minimum's rate / 10,
a common and more careful choice. Pick a peak --learning_rate near it.
"""
import math
import os
import sys

from trainer import cli

# (a stop signal while TensorFlow loads: one line, 75: trainer/__init__.py)
cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags, logging  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402
from trainer import callbacks, faults, locks, loop, run_flags, schedules  # noqa: E402
from trainer.output import figures  # noqa: E402
from trainer.settings import message_of  # noqa: E402

FLAGS = flags.FLAGS
SMOOTHING = 0.9      # of the loss's exponential moving average (bias-corrected)
DIVERGED = 4.0       # stop once the smoothed loss is this many times its minimum


class RangeTest(callbacks.Callback):
    """Records (learning rate, loss) at every step of a range_test run and stops it
    once the loss has diverged."""
    name = "range_test"

    def __init__(self, lr_min: float, lr_max: float, steps: int):
        # The run's own schedule (trainer/schedules.py, range_test), read again here.
        self.schedule = schedules.WarmupSchedule("range_test", lr_max, steps, 1,
                                                 floor=lr_min)
        self.rates: list[float] = []
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self._average, self._finite = 0.0, 0  # the EMA of the finite losses so far

    def on_train_begin(self, context: callbacks.Context) -> None:
        self.context = context

    def rate_of_step(self, step: int) -> float:
        """The learning rate step `step` (1-based) trained with: the schedule's at
        the step counter before it."""
        return float(self.schedule(step - 1))

    def on_log(self, step: int, metrics: dict) -> None:
        loss = float(metrics.get("train_loss", math.nan))
        self.rates.append(self.rate_of_step(step))
        self.losses.append(loss)
        if not math.isfinite(loss):  # (a skipped step: no loss to average)
            self.context.request_stop(f"the loss is not finite at learning rate "
                                      f"{self.rates[-1]:.3g}")
            return
        self._average = SMOOTHING * self._average + (1 - SMOOTHING) * loss
        self._finite += 1  # bias-corrected, as fastai's
        self.smoothed.append(self._average / (1 - SMOOTHING ** self._finite))
        if len(self.smoothed) > 5 and self.smoothed[-1] > DIVERGED * min(self.smoothed):
            self.context.request_stop(f"the loss diverged at learning rate "
                                      f"{self.rates[-1]:.3g}")

    def suggestion(self) -> dict:
        """{"steepest": the rate where the smoothed loss falls fastest against
        log(rate), "minimum": the rate of the smallest smoothed loss,
        "minimum_over_10": that / 10}."""
        rates, smoothed = np.array(self.rates[:len(self.smoothed)]), np.array(self.smoothed)
        if len(smoothed) < 3:
            raise ValueError(f"the range test ran {len(smoothed)} steps with a finite "
                             f"loss; lower --lr_min or raise --lr_find_steps")
        lowest = int(np.argmin(smoothed))
        slopes = np.gradient(smoothed[:lowest + 1], np.log(rates[:lowest + 1])) \
            if lowest >= 2 else np.gradient(smoothed, np.log(rates))
        steepest = int(np.argmin(slopes))
        return {"steepest": float(rates[steepest]), "minimum": float(rates[lowest]),
                "minimum_over_10": float(rates[lowest] / 10)}


def plot(test: RangeTest, suggestion: dict, title: str):
    """The loss (raw and smoothed) against the learning rate, log scale."""
    fig = figures.mpl_figure.Figure(figsize=(7, 4))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.11, bottom=0.14, right=0.97, top=0.9)
    ax.plot(test.rates, test.losses, color="0.75", lw=1, label="loss of the step")
    ax.plot(test.rates[:len(test.smoothed)], test.smoothed, lw=2, label="smoothed")
    for key, style in (("steepest", "--"), ("minimum_over_10", ":")):
        ax.axvline(suggestion[key], color="k", ls=style, lw=1,
                   label=f"{key.replace('_', ' ')}: {suggestion[key]:.2g}")
    finite = [v for v in test.smoothed if math.isfinite(v)]
    if finite:  # the interesting part: up to a little above the start
        ax.set_ylim(min(finite) * 0.9, max(finite[0], min(finite)) * 1.6)
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def define_flags() -> None:
    cli.import_user_code(FLAGS, sys.argv)
    run_flags.define_flags(FLAGS)
    define = cli.define_flag
    define(FLAGS, flags.DEFINE_float, "lr_min", 1e-6, "The range test's first learning "
           "rate.")
    define(FLAGS, flags.DEFINE_float, "lr_max", 10.0, "Its last (it stops earlier once "
           "the loss diverges).")
    define(FLAGS, flags.DEFINE_integer, "lr_find_steps", 100, "Steps from --lr_min to "
           "--lr_max (one learning rate each).")
    define(FLAGS, flags.DEFINE_string, "output_dir", "", "Where the test's run, "
           "lr_find.png and lr_find.json go (default: the run's --model_dir + _lr_find); "
           "a new directory.")


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    logging.set_verbosity(max(logging.INFO, FLAGS.verbosity))
    cli.quiet_library_logs(FLAGS.verbosity)
    try:
        with faults.StopSignals() as stop:
            config = run_flags.config_from_flags(FLAGS)
            if not 0 < FLAGS.lr_min < FLAGS.lr_max or FLAGS.lr_find_steps < 3:
                raise run_flags.config_lib.ConfigError(
                    f"--lr_min={FLAGS.lr_min}, --lr_max={FLAGS.lr_max}, --lr_find_steps="
                    f"{FLAGS.lr_find_steps}: give 0 < lr_min < lr_max and 3 steps or more")
            output_dir = FLAGS.output_dir or config.model_dir.rstrip("/") + "_lr_find"
            if tf.io.gfile.exists(os.path.join(output_dir, "run_config.json")):
                raise run_flags.config_lib.ConfigError(
                    f"{output_dir} holds an earlier range test; remove it or give "
                    f"another --output_dir")
            steps = FLAGS.lr_find_steps
            config = config.replace(
                lr_schedule="range_test", min_learning_rate=FLAGS.lr_min,
                learning_rate=FLAGS.lr_max, warmup_epochs=0.0, epochs=1,
                train_steps=steps, log_every=1, steps_per_loop=1, eval_every=steps,
                checkpoint_every=steps, keep_checkpoints=1, on_nan="skip_step",
                early_stop_patience=0, model_dir=output_dir)
            test = RangeTest(FLAGS.lr_min, FLAGS.lr_max, steps)
            with locks.held(output_dir, "trainer.tools.lr_find", flag="--output_dir"):
                loop.train_and_evaluate(config, stop_signals=stop,
                                        extra_callbacks=(test,))
                suggestion = test.suggestion()
                title = (f"range test: {config.model} on {config.dataset}, batch "
                         f"{config.batch_size}, {config.optimizer}")
                files.write_atomically(os.path.join(output_dir, "lr_find.png"),
                                       figures.png_bytes(plot(test, suggestion, title)))
                files.write_json(os.path.join(output_dir, "lr_find.json"), {
                    **suggestion, "learning_rates": test.rates, "losses": test.losses,
                    "smoothed_losses": test.smoothed, "settings": config.as_dict()})
    except run_flags.USER_ERRORS + (ValueError,) as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)
    except (faults.Preempted, faults.StoppedAtStartUp) as err:
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(faults.STOPPED_EXIT_CODE)
    except files.WriteError as err:  # (a full disk, a read-only place: the cause)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)
    print(f"suggested learning rate: {suggestion['steepest']:.3g} (steepest descent of "
          f"the loss); {suggestion['minimum_over_10']:.3g} (the minimum's / 10); "
          f"{len(test.rates)} steps from {FLAGS.lr_min:g}; "
          f"{os.path.join(output_dir, 'lr_find.png')}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
