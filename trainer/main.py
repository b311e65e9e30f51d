"""Command line: `python -m trainer.main --model=cifar_cnn --dataset=cifar10`.

Parses the flags (one per trainer.config.Config field, plus --plot_schedule) into
one frozen Config, validates it before any heavy work, and calls
`loop.train_and_evaluate`. Exit status: 0 done; 2 bad settings or input (a one-line
error on stderr, before training); 3 the loss diverged (last good checkpoint kept);
4 a multi-worker run lost a worker (restart all to resume); 5 a checkpoint could not
be saved (disk full, no permission; the last good one is named and kept); 75
preempted by SIGTERM
(a checkpoint of the current step was saved: run the same command to resume).
"""
import logging as std_logging
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import app, flags, logging  # noqa: E402

from data import sources  # noqa: E402
import models  # noqa: E402
from trainer import checkpoints, config as config_lib, faults, loop  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402

FLAGS = flags.FLAGS

# Errors that mean "the user asked for something impossible": one line, status 2.
USER_ERRORS = (config_lib.ConfigError, sources.DatasetError, strategy_lib.DeviceError,
               checkpoints.CheckpointError)


def define_flags() -> None:
    """The run's flags (also called by tests; defining twice is a no-op)."""
    config_lib.define_flags(FLAGS)
    if "plot_schedule" in FLAGS:
        return
    flags.DEFINE_bool("plot_schedule", False, "Write the learning-rate schedule of "
                      "these settings to <model_dir>/lr_schedule.png and exit without "
                      "training.")


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> config_lib.Config:
    """The validated Config: the model's recipe, the flags given over it."""
    config, origin = config_lib.from_flags(flag_values)
    if origin:
        logging.info("Recipe for %s: %s", config.model, ", ".join(
            f"{name}={getattr(config, name)} ({source})" for name, source in origin.items()))
    return config_lib.validate(config, models.names(), sources.names())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value",
              file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(max(logging.INFO, FLAGS.verbosity))
    cli.quiet_library_logs(FLAGS.verbosity)
    # TF's own stderr handler would print its records a second time (absl's prints
    # them; cli.parse_flags clears it too, but main may be called in-process).
    std_logging.getLogger("tensorflow").handlers.clear()
    try:
        config = config_from_flags()
        if FLAGS.plot_schedule:
            print(f"wrote {loop.plot_schedule(config)}")
            return
        loop.train_and_evaluate(config)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except faults.Preempted as err:
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(faults.PREEMPTED_EXIT_CODE)
    except faults.TrainingDivergedError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
    except checkpoints.CheckpointSaveError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)
    except faults.PEER_FAILURES as err:
        if FLAGS.strategy != "multi_worker":
            raise
        print(f"error: lost another worker ({type(err).__name__}: "
              f"{str(err).splitlines()[0][:200]}); restart all workers with the same "
              f"command to resume from the last checkpoint", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
