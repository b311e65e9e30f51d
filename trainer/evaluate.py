"""Evaluate a run's checkpoints apart from training:

    python -m trainer.evaluate --model_dir=DIR                 # the latest checkpoint
    python -m trainer.evaluate --model_dir=DIR --checkpoint=DIR/ckpt-40
    python -m trainer.evaluate --model_dir=DIR --watch         # each new one, as written

Rebuilds the run's state (its task's models and optimizers: the average of
--ema_decay lives in an optimizer) and evaluation from its run_config.json,
restores a checkpoint and evaluates it exactly as training does (every test
example once, the task's own evaluation step). With --watch it follows a training job, evaluating
each checkpoint it writes (Model Garden's continuous evaluation; the seed's "train
on the TPU, evaluate on the CPU"), until the run is done or no new checkpoint comes
for --timeout seconds. It writes only to --output_dir (default DIR/evaluator):
TensorBoard `eval` events and evaluations.json; the trainer's files are never
touched, and a directory that a trainer or another evaluator holds is refused.
Exit status 0, or 2 with a one-line error.
"""
import os
import sys
import time

from trainer import cli

# (a stop signal while TensorFlow loads: one line, 75: trainer/__init__.py)
cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags, logging  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402
from trainer import averaging, build, checkpoints, distributed, evaluation  # noqa: E402
from trainer import inputs, locks, run_flags  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
from trainer.settings import message_of  # noqa: E402
from trainer.output import progress as progress_lib, summaries  # noqa: E402
from trainer.output import recorder as recorder_lib  # noqa: E402

FLAGS = flags.FLAGS
EVALUATIONS_FILE = "evaluations.json"


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    cli.import_user_code(flag_values, sys.argv)
    cli.define_flag(flag_values, flags.DEFINE_string, "model_dir", None,
                    "The training run's directory (its run_config.json and checkpoints).")
    cli.define_flag(flag_values, flags.DEFINE_string, "checkpoint", None,
                    "A checkpoint path (DIR/ckpt-N); default: the latest in --model_dir.")
    cli.define_flag(flag_values, flags.DEFINE_bool, "watch", False,
                    "Evaluate every new checkpoint as the training job writes it.")
    cli.define_flag(flag_values, flags.DEFINE_integer, "timeout", 600,
                    "--watch: stop after this many seconds without a new checkpoint.")
    cli.define_flag(flag_values, flags.DEFINE_string, "output_dir", None,
                    "Where the evaluator writes (default: <model_dir>/evaluator).")
    cli.define_flag(flag_values, flags.DEFINE_string, "data_dir", None,
                    "TFDS data dir, if not the training run's.")


class CheckpointGone(Exception):
    """The checkpoint was deleted before the evaluator could read it."""


class Evaluator:
    """The run's model and evaluation, built once (trainer/build.py, as training
    builds them); evaluate(path) per checkpoint."""

    def __init__(self, model_dir: str, data_dir: str | None = None):
        config = build.config_of_run(model_dir)
        self.config = config = config.replace(data_dir=data_dir or config.data_dir)
        runtime = strategy_lib.create("one_device")  # the evaluator's own device
        self.strategy = strategy = runtime.strategy
        precision = strategy_lib.resolve_precision(config.precision, runtime.device_kind,
                                                   config.deterministic)
        data = build.run_data(config)
        self.spec = spec = data.spec
        self.plan = build.plan(config, spec, 1)
        # The weights come from the checkpoints; what the task's evaluation reads is
        # built (not, e.g., a distillation's teacher).
        self.run = run = build.build_run(config, spec, self.plan, strategy, precision,
                                         purpose=build.EVALUATE)
        with strategy.scope():
            self.checkpoint = checkpoints.training_checkpoint(run.state)
        self.eval_loop = distributed.make_eval_loop(strategy, run.eval_step)
        cache = inputs.choose_mode(data, self.plan.train_examples)[0] == inputs.MEMORY_MODE
        self.eval_dataset = strategy.distribute_datasets_from_function(
            inputs.eval_input_fn(data, cache=cache))
        self.splits = evaluation.SplitMapper(strategy, data, run.state, cache)

    def evaluate(self, checkpoint_path: str) -> dict:
        """The metrics of one checkpoint (ckpt-N: the step N). CheckpointGone if
        it was deleted (a trainer's --keep_checkpoints) before it could be read."""
        try:
            self.checkpoint.restore(checkpoint_path).expect_partial(
                ).assert_existing_objects_matched()
        except (AssertionError, ValueError, *checkpoints.UNREADABLE) as err:
            # A failed restore leaves the checkpoint object half bound: a new one.
            with self.strategy.scope():
                self.checkpoint = checkpoints.training_checkpoint(self.run.state)
            if not tf.io.gfile.exists(checkpoint_path + ".index"):
                raise CheckpointGone(f"{os.path.basename(checkpoint_path)} was deleted "
                                     f"before it could be read") from err
            if not isinstance(err, (AssertionError, ValueError)):
                raise
            raise checkpoints.CheckpointError(
                f"{checkpoint_path} does not fit the run's model "
                f"({str(err).splitlines()[0][:160]})") from err
        evaluate = lambda: evaluation.evaluate(  # noqa: E731
            self.eval_loop, self.eval_dataset, self.plan, self.spec, self.run.task,
            state=self.run.state, splits=self.splits)
        result = averaging.evaluate_raw_and_averaged(evaluate, self.run.state)
        step_number = checkpoints.step_of(checkpoint_path)
        return {"step": step_number, "epoch": step_number / self.plan.steps_per_epoch,
                "checkpoint": os.path.basename(checkpoint_path),
                **{k: v for k, v in result.items() if isinstance(v, (int, float))}}


def _run_done(model_dir: str) -> bool:
    """The training run has finished (its metrics.json says so)."""
    path = os.path.join(model_dir, recorder_lib.METRICS_FILE)
    try:
        return files.read_json(path).get("status") == "done"
    except files.BadFileError:  # not yet written, or being replaced
        return False


def evaluate_checkpoints(model_dir: str, output_dir: str, checkpoint: str | None = None,
                         watch: bool = False, timeout: int = 600,
                         data_dir: str | None = None) -> list[dict]:
    """Evaluates one checkpoint, or (watch) each new one; returns the records, also
    written to output_dir/evaluations.json and as TensorBoard events."""
    evaluator = Evaluator(model_dir, data_dir)
    tf.io.gfile.makedirs(output_dir)
    writer = summaries.Writer(output_dir)
    records: list[dict] = []
    missed: list[dict] = []  # the run's checkpoints not evaluated, and why

    def write() -> None:
        files.write_json(os.path.join(output_dir, EVALUATIONS_FILE),
                         {"model_dir": model_dir, "evaluations": records,
                          "missed": missed})

    def miss(name: str, why: str) -> None:
        logging.warning("missed %s: %s", name, why)
        missed.append({"checkpoint": name, "why": why})
        write()

    def record(path: str, skip_unreadable: bool) -> bool:
        """Evaluates `path`; one it cannot read (deleted meanwhile by the trainer's
        --keep_checkpoints, or damaged) is a missed one if `skip_unreadable`, else
        a one-line CheckpointError. Whether it was evaluated."""
        try:
            result = evaluator.evaluate(path)
        except (CheckpointGone, *checkpoints.UNREADABLE) as err:
            why = (f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err)
                   else type(err).__name__)
            if not skip_unreadable:
                raise checkpoints.CheckpointError(f"cannot read {path} ({why})") from err
            miss(os.path.basename(path), why)
            return False
        logging.info("%s (step %d, epoch %.2f): %s  (%d examples)", result["checkpoint"],
                     result["step"], result["epoch"],
                     progress_lib.format_test_metrics(result), result["test_examples"])
        records.append(result)
        writer.eval(result)
        write()
        return True

    if not watch:
        # The one named; else the newest readable (a damaged newest one is missed,
        # with a line, and the one before it evaluated).
        paths = [checkpoint] if checkpoint else checkpoints.candidates(model_dir)
        if not paths:
            raise checkpoints.CheckpointError(f"no checkpoint in {model_dir} yet; train "
                                              f"first, or pass --watch to wait for one")
        for index, path in enumerate(paths):
            if record(path, skip_unreadable=index < len(paths) - 1):
                break
    else:
        logging.info("Watching %s for new checkpoints (stop: the run is done, or %d s "
                     "without a new one)", model_dir, timeout)
        last_new, last_step = time.time(), -1

        def stop_waiting() -> bool:  # asked after 2 s without a new checkpoint
            if time.time() - last_new > timeout:
                return True
            # Done, and its last checkpoint evaluated (it may have come just now).
            latest = tf.train.latest_checkpoint(model_dir)
            return _run_done(model_dir) and (
                latest is None or checkpoints.step_of(latest) <= last_step)

        for newest in tf.train.checkpoints_iterator(model_dir, min_interval_secs=1,
                                                    timeout=2, timeout_fn=stop_waiting):
            # Every checkpoint written since the last one evaluated, oldest first,
            # not only the newest (evaluating can be slower than checkpointing).
            state = tf.train.get_checkpoint_state(model_dir)
            listed = list(state.all_model_checkpoint_paths) if state else [newest]
            paths = sorted({*listed, newest}, key=checkpoints.step_of)
            # The run saves at every multiple of its interval: those between the
            # last one evaluated and the oldest listed were rotated away unseen.
            every = evaluator.config.checkpoint_every or evaluator.plan.steps_per_epoch
            oldest = checkpoints.step_of(paths[0])
            for step in range((last_step // every + 1) * every, oldest, every):
                if last_step >= 0 or step > 0:
                    miss(f"ckpt-{step}", "deleted by the trainer's --keep_checkpoints "
                         "before the evaluator saw it")
            for path in paths:
                if checkpoints.step_of(path) > last_step:
                    record(path, skip_unreadable=True)
                    last_step = checkpoints.step_of(path)
            last_new = time.time()
    writer.close()
    if missed:
        logging.warning("missed %d checkpoint(s): %s (in %s)", len(missed),
                        ", ".join(m["checkpoint"] for m in missed), EVALUATIONS_FILE)
    return records


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    logging.set_verbosity(max(logging.INFO, FLAGS.verbosity))
    cli.quiet_library_logs(FLAGS.verbosity)
    if not FLAGS.model_dir:
        print("error: --model_dir is required: the training run's directory",
              file=sys.stderr)
        sys.exit(2)
    output_dir = FLAGS.output_dir or os.path.join(FLAGS.model_dir, "evaluator")
    try:
        # (no link on the way from the run to output_dir, nor in it; one writer)
        with locks.held(output_dir, "trainer.evaluate", run_dir=FLAGS.model_dir,
                        flag="--output_dir"):
            records = evaluate_checkpoints(FLAGS.model_dir, output_dir, FLAGS.checkpoint,
                                           FLAGS.watch, FLAGS.timeout, FLAGS.data_dir)
    except locks.DirectoryInUse as err:  # as trainer.main: try again later
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(locks.IN_USE_EXIT_CODE)
    except run_flags.USER_ERRORS as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)
    except files.WriteError as err:  # as trainer.main: the file named, status 5
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)
    print(f"evaluated {len(records)} checkpoint(s); wrote {output_dir}")
    if not records:
        print("error: no checkpoint could be evaluated (see the warnings)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
