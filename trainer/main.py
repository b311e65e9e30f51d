"""Command line: `python -m trainer.main --model=cifar_cnn --dataset=cifar10`.

The only module that reads absl flags. It turns them into one frozen `Config`,
validates it before any heavy work, and calls `loop.train_and_evaluate`.
Exit status: 0 done; 2 bad settings or input (a one-line error on stderr, before
training); 3 the loss diverged (last good checkpoint kept); 4 a multi-worker run
lost a worker (restart all to resume); 75 preempted by SIGTERM
(a checkpoint of the current step was saved: run the same command to resume).
"""
import dataclasses
import logging as std_logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # hide TF's C++ start-up chatter

from absl import app, flags, logging  # noqa: E402

from data import augment as augment_lib, sources  # noqa: E402
import models  # noqa: E402
from trainer import checkpoints, config as config_lib, faults, loop, recipes  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402

_D = config_lib.Config()  # flag defaults come from the Config dataclass
_CHOICES = lambda names: "|".join(names)  # noqa: E731

flags.DEFINE_string("model", _D.model, f"Model name: {_CHOICES(models.names())}.")
flags.DEFINE_string("model_size", _D.model_size, "full|tiny (tiny: test variant).")
flags.DEFINE_string("dataset", _D.dataset, f"Dataset: {_CHOICES(sources.names())}.")
flags.DEFINE_integer("image_size", _D.image_size,
                     "Train and evaluate at this square size (0: the dataset's own).")
flags.DEFINE_string("weights", _D.weights, "Initial weights: none | imagenet (xception, "
                    "downloads) | PATH (a .weights.h5 of the same model, or for xception "
                    "Keras' notop backbone file).")
flags.DEFINE_string("data_dir", _D.data_dir,
                    "TFDS data dir; default: $TFDS_DATA_DIR, else the TFDS default.")
flags.DEFINE_bool("download_data", _D.download_data,
                  "Let TFDS download and prepare a missing dataset (needs network).")
flags.DEFINE_string("model_dir", _D.model_dir,
                    "Checkpoints, run_config.json, model.weights.h5, metrics.json "
                    "(default: runs/<model>_<dataset>). A run on a directory with a "
                    "checkpoint resumes from it.")
flags.DEFINE_integer("batch_size", _D.batch_size,
                     "GLOBAL batch size, split evenly across all replicas.")
flags.DEFINE_integer("epochs", _D.epochs, "Epochs to train (see --train_steps).")
flags.DEFINE_integer("train_steps", _D.train_steps, "If > 0: steps to train, "
                     "overriding --epochs.")
flags.DEFINE_string("optimizer", _D.optimizer,
                    f"{_CHOICES(config_lib.OPTIMIZERS)} (sgd uses Nesterov momentum).")
flags.DEFINE_float("learning_rate", _D.learning_rate, "Peak learning rate.")
flags.DEFINE_float("momentum", _D.momentum, "Momentum for sgd.")
flags.DEFINE_string("lr_schedule", _D.lr_schedule,
                    f"{_CHOICES(config_lib.SCHEDULES)}, each after a linear warmup "
                    "(rampup: the flowers codelab's ramp-up/sustain/exponential decay).")
flags.DEFINE_float("warmup_epochs", _D.warmup_epochs,
                   "Linear warmup from --min_learning_rate to the peak (epochs).")
flags.DEFINE_float("lr_decay_rate", _D.lr_decay_rate,
                   "Per-epoch factor for the exponential and rampup schedules.")
flags.DEFINE_float("sustain_epochs", _D.sustain_epochs,
                   "rampup: epochs to hold the peak after warmup.")
flags.DEFINE_float("min_learning_rate", _D.min_learning_rate,
                   "Warmup start and floor of the decaying schedules.")
flags.DEFINE_float("weight_decay", _D.weight_decay,
                   "Decoupled weight decay (not applied to biases and norm layers).")
flags.DEFINE_string("tpu", _D.tpu, "TPU name, grpc:// address, or 'local' (TPU VM). "
                    "If none is found the run falls back to GPU/CPU with a warning.")
flags.DEFINE_bool("require_tpu", _D.require_tpu, "Fail instead of falling back when "
                  "no TPU is found.")
flags.DEFINE_string("strategy", _D.strategy, f"{_CHOICES(config_lib.STRATEGIES)}; "
                    "auto: a TPU if reachable, else all GPUs (Mirrored), else the CPU.")
flags.DEFINE_integer("cpu_replicas", _D.cpu_replicas,
                     "Split the host CPU into N logical devices and run N replicas "
                     "with MirroredStrategy (debug distribution on a laptop).")
flags.DEFINE_string("jit_compile", _D.jit_compile,
                    "auto|true|false: XLA-compile the step. auto: on TPU and GPU, not on "
                    "CPU (measured 4-5x slower there).")
flags.DEFINE_string("precision", _D.precision,
                    f"{_CHOICES(config_lib.PRECISIONS)}. auto: bf16 on TPU, bf16/fp16 "
                    "on GPU by generation, bf16 on CPUs with native bf16, else float32.")
flags.DEFINE_integer("steps_per_loop", _D.steps_per_loop,
                     "Steps per tf.function call (an in-graph loop).")
flags.DEFINE_integer("log_every", _D.log_every, "Steps between log lines (0: per epoch).")
flags.DEFINE_integer("eval_every", _D.eval_every,
                     "Steps between evaluations (0: at the end of every epoch).")
flags.DEFINE_integer("checkpoint_every", _D.checkpoint_every,
                     "Steps between checkpoints (0: at the end of every epoch).")
flags.DEFINE_integer("keep_checkpoints", _D.keep_checkpoints, "Checkpoints kept.")
flags.DEFINE_integer("shuffle_buffer", _D.shuffle_buffer, "Training shuffle: blocks of "
                     "this many examples, visited in a random order, each permuted; the "
                     "order depends only on --seed and the epoch (0: no shuffle).")
flags.DEFINE_string("augment", _D.augment, "Training augmentation: "
                    f"{_CHOICES(augment_lib.TRAIN_AUGMENTATIONS)} (default: the "
                    "dataset's own: pad_crop_flip for CIFAR, flip_saturation for flowers).")
flags.DEFINE_bool("deterministic", _D.deterministic,
                  "Deterministic ops: the same command gives bitwise the same weights on "
                  "the same machine, also across a kill and resume (slower on GPU).")
flags.DEFINE_string("on_nan", _D.on_nan, "On a non-finite loss: stop (error naming the "
                    "step; checkpoints kept) or skip_step (drop that update, count it).")
flags.DEFINE_float("label_smoothing", _D.label_smoothing,
                   "Mix the one-hot target with uniform by this weight (0: off).")
flags.DEFINE_bool("tta_flip", _D.tta_flip, "Evaluate on each test image and its "
                  "mirror image, averaging the logits.")
flags.DEFINE_float("ema_decay", _D.ema_decay, "Weight averaging: keep an exponential "
                   "moving average of the weights with this per-step decay (e.g. 0.99) "
                   "and evaluate and save it; metrics also show the raw weights' "
                   "accuracy (0: off).")
flags.DEFINE_integer("seed", _D.seed, "Seed for weights, shuffling and augmentation.")
flags.DEFINE_bool("plot_schedule", False, "Write the learning-rate schedule of these "
                  "settings to <model_dir>/lr_schedule.png and exit without training.")

FLAGS = flags.FLAGS

# Errors that mean "the user asked for something impossible": one line, status 2.
USER_ERRORS = (config_lib.ConfigError, sources.DatasetError, strategy_lib.DeviceError,
               checkpoints.CheckpointError)


def config_from_flags(flag_values=FLAGS) -> config_lib.Config:
    """Builds and validates the frozen Config: the model's recipe, then the flags
    given on the command line over it."""
    values = {f.name: flag_values[f.name].value
              for f in dataclasses.fields(config_lib.Config)}
    explicit = {name for name in values if flag_values[name].present}
    values, origin = recipes.resolve(values, explicit)
    if origin:
        logging.info("Recipe for %s: %s", values["model"], ", ".join(
            f"{name}={values[name]} ({source})" for name, source in origin.items()))
    values["model_dir"] = values["model_dir"] or os.path.join(
        "runs", f"{values['model']}_{values['dataset']}")
    return config_lib.validate(config_lib.Config(**values), models.names(),
                               sources.names())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value",
              file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.INFO)
    # TF adds its own stderr handler when imported before absl's: every TF record
    # would print twice. absl's handler (on the root logger) prints them once.
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
    except faults.PEER_FAILURES as err:
        if FLAGS.strategy != "multi_worker":
            raise
        print(f"error: lost another worker ({type(err).__name__}: "
              f"{str(err).splitlines()[0][:200]}); restart all workers with the same "
              f"command to resume from the last checkpoint", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    app.run(main)
