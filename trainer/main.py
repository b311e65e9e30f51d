"""Command line: `python -m trainer.main --model=cifar_cnn --dataset=cifar10`.

Parses the flags (one per trainer.config.Config field, plus --plot_schedule) into
one frozen Config, validates it before any heavy work, and calls
`loop.train_and_evaluate`. Exit status: 0 done; 2 bad settings or input (a one-line
error on stderr, before training); 6 another process took the run directory over
(this one stopped before writing again); 3 the loss diverged or a weight became
non-finite (nothing saved after it; the last good checkpoint kept);
4 a multi-worker run lost a worker (restart all to resume); 5 a checkpoint or a
final output could not be written (disk full, no permission; the file is named, the
last good checkpoint and the previous complete file are kept); 75 stopped by
SIGTERM, SIGINT (Ctrl-C) or SIGHUP (a checkpoint of the current step was saved, also
during an evaluation: run the same command to resume; a second signal stops at once
with 128 + its number, the last checkpoint kept); 75 also when another live
process holds the run directory (try again later).
"""
import logging as std_logging
import os
import sys

from trainer import cli

# (a stop signal while TensorFlow loads: one line, 75: trainer/__init__.py)
cli.set_deterministic_kernels(sys.argv)  # before TensorFlow starts
cli.set_native_log_level(sys.argv)

from absl import flags, logging  # noqa: E402

from data import files  # noqa: E402
from trainer import build, checkpoints, faults, locks, loop, run_flags  # noqa: E402
from trainer import schedules  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
from trainer.output import console  # noqa: E402
from trainer.settings import message_of  # noqa: E402

FLAGS = flags.FLAGS
USER_ERRORS = run_flags.USER_ERRORS


def define_flags() -> None:
    """This command's flags: the run's (trainer/run_flags.py), and --plot_schedule."""
    cli.import_user_code(FLAGS, sys.argv)
    run_flags.define_flags(FLAGS)
    cli.define_flag(FLAGS, flags.DEFINE_bool, "plot_schedule", False, "Write the "
                    "learning-rate schedule of these settings to <model_dir>/lr_schedule.png "
                    "and exit without training.")


# Set when this module runs as the program (not when a test calls main).
LEAVE_WHEN_DONE = False


def _leave(status: int = 0, now: bool = False) -> None:
    """Ends the program with `status` once its last line is printed, its files
    written whole and its lock released: at once when this module is the program
    (LEAVE_WHEN_DONE) or `now`, else sys.exit (a test calling main). TensorFlow's own
    shutdown can wait minutes in the destructor of the training input's iterator,
    whose thread finishes the element it is making first (issue 31: 107 s after
    `Done:`; issue 46: 12 s after a Ctrl-C's `stopped:` line here, in the first
    epoch's shuffle, ~100 s under load), and a non-chief worker's would wait on the
    chief's coordination service, which the chief takes down as it exits (6 s here,
    ending in an UNAVAILABLE error line)."""
    if not (LEAVE_WHEN_DONE or now):
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    std_logging.shutdown()
    console.stop()  # its last lines to the terminal and the log file
    os._exit(status)


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    if LEAVE_WHEN_DONE:  # (the program: short lines, the native noise to the log file)
        console.start(verbose=FLAGS.verbosity >= 1)
    logging.set_verbosity(max(logging.INFO, FLAGS.verbosity))
    cli.quiet_library_logs(FLAGS.verbosity)
    # TF's own stderr handler would print its records a second time (absl's prints
    # them; cli.parse_absl_flags clears it too, but main may be called in-process).
    std_logging.getLogger("tensorflow").handlers.clear()
    try:
        with faults.StopSignals() as stop:  # from here a stop signal: one line, 75
            config = run_flags.config_from_flags(FLAGS)
            # One trainer per run directory (the chief holds it for a multi-worker
            # job), from before anything is written to it until any exit.
            with locks.held(config.model_dir, "trainer.main",
                            strategy_lib.is_chief_process(config.strategy)):
                if FLAGS.plot_schedule:
                    plan = build.plan(config, build.run_data(config).spec,
                                      config.cpu_replicas)
                    path = loop.plot_schedule(config.group(schedules.ScheduleSettings),
                                              plan, config.model_dir,
                                              f"{config.model} on {config.dataset}")
                    print(f"wrote {path}")
                    return
                loop.train_and_evaluate(config, stop_signals=stop)
            if stop.requested:
                raise faults.Preempted(f"{stop.signal} while the final outputs were "
                                       f"written (they are complete) in "
                                       f"{config.model_dir}")
            if LEAVE_WHEN_DONE or not strategy_lib.is_chief_process(config.strategy):
                _leave(0, now=True)
    except locks.DirectoryInUse as err:  # (a scheduler retries 75)
        print(f"error: {message_of(err)}", file=sys.stderr)
        _leave(locks.IN_USE_EXIT_CODE)
    except locks.LockLost as err:
        print(f"error: {err}", file=sys.stderr)
        _leave(locks.LOCK_LOST_EXIT_CODE)
    except USER_ERRORS as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        _leave(2)
    except (faults.Preempted, faults.StoppedAtStartUp) as err:
        print(f"stopped: {err}", file=sys.stderr)
        _leave(faults.STOPPED_EXIT_CODE)
    except (faults.TrainingDivergedError, checkpoints.NonFiniteError) as err:
        print(f"error: {err}", file=sys.stderr)
        _leave(3)
    except files.WriteError as err:  # a checkpoint or a final output (disk full, ...)
        print(f"error: {err}", file=sys.stderr)
        _leave(5)
    except faults.PEER_FAILURES as err:
        if FLAGS.strategy != "multi_worker":
            raise
        print(f"error: {faults.lost_peer(err)}; restart all workers with the same "
              f"command to resume from the last checkpoint", file=sys.stderr)
        _leave(4)


if __name__ == "__main__":
    LEAVE_WHEN_DONE = True
    define_flags()
    cli.run(main)
