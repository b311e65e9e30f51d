"""Does a (changed) training step give the same result on 1 and on 2 replicas?

    python -m trainer.check_step --model=cifar_cnn [the flags of the run] [--check_steps=3]

Builds the run exactly as training does (trainer/build.py: the task, a teacher,
the optimizer, the schedule and the step), takes `check_steps` global batches from
the run's own training pipeline, and trains them twice from the same initial
weights: on 1 replica, and on 2 replicas (two logical CPU devices,
MirroredStrategy) that split each global batch. In float64, with batch-norm
synchronized across replicas and dropout off, so a correct step gives the same
weights, optimizer state and metrics both ways up to float64 rounding (below
1e-13 here, against differences of 0.1 and more that the bugs below make). Prints
every difference, the one that decided the verdict, and PASS or FAIL; exit status
0 on PASS, 1 on FAIL, 2 on bad flags.

It catches the classic distributed-step bugs before a TPU hour is spent: a loss
divided by the per-replica batch instead of the global one (the summed gradient,
and so `grad_norm`, doubles), clipping before the cross-replica sum, a metric
averaged per replica and then summed, a second pass (SAM) that uses this
replica's gradient instead of the summed one, a teacher run in training mode (its
dropout masks then differ with the split of the batch).
"""
import dataclasses
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import sources  # noqa: E402
from trainer import build, config as config_lib, distributed, inputs  # noqa: E402
from trainer import main as main_lib  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
from trainer.settings import message_of  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    main_lib.define_flags()
    if "check_steps" in FLAGS:
        return
    flags.DEFINE_integer("check_steps", 3, "Training steps to compare.")
    flags.DEFINE_float("tolerance", TOLERANCE, "Largest relative difference that passes, "
                       "of the weights' updates and of each metric.")


# A correct step differs by float64 rounding only: at most 4.8e-14 measured over
# the built-in models, tasks and step settings (docs/changing-the-step.md); the
# smallest difference a planted bug made is 0.133. The tolerance sits between
# them, a million times from each.
TOLERANCE = 1e-7


@dataclasses.dataclass(frozen=True)
class CheckResult:
    weight_difference: float            # ||w1 - w2|| / ||w1 - w0|| over all weights
    worst_variable: tuple[str, float]   # the same per variable: the largest
    metrics: dict[str, tuple[float, float, float]]  # name: (1 replica, 2, relative)
    tolerance: float

    def differences(self) -> dict[str, float]:
        """Every compared quantity's relative difference."""
        return {"weights and optimizer state": self.weight_difference,
                **{name: rel for name, (_, _, rel) in self.metrics.items()}}

    @property
    def deciding(self) -> tuple[str, float]:
        """The quantity that decided the verdict: the largest difference (NaN first)."""
        return max(self.differences().items(),
                   key=lambda item: float("inf") if np.isnan(item[1]) else item[1])

    @property
    def passed(self) -> bool:
        return all(d <= self.tolerance for d in self.differences().values())  # NaN fails


def _in_float64(layer_config: dict) -> dict:
    """A layer's config with its dtype float64; an operation without a dtype (one
    made by `x + y` in a functional model) computes in its inputs' dtype anyway."""
    return {**layer_config, "dtype": "float64"} if "dtype" in layer_config else layer_config


def checkable(model: keras.Model, freeze_batch_norm: bool = False) -> keras.Model:
    """A copy of `model` in float64 with batch-norm synchronized across replicas
    (statistics of the global batch) and dropout off: then 1 and N replicas must
    agree up to float64 rounding. (Its weights are new: set them.)

    freeze_batch_norm: batch-norm uses its moving statistics instead (and its scale
    and offset stay fixed). Needed with gradient accumulation: a synchronized
    batch-norm inside the micro-batch loop is a cross-replica sync in a graph loop,
    which TensorFlow does not support."""
    def clone(layer):
        layer_config = _in_float64(layer.get_config())
        if isinstance(layer, keras.layers.BatchNormalization):
            layer_config["synchronized"] = not freeze_batch_norm
            if freeze_batch_norm:
                layer_config["trainable"] = False
        if isinstance(layer, keras.layers.Dropout):
            layer_config["rate"] = 0.0
        return layer.__class__.from_config(layer_config)
    return keras.models.clone_model(model, clone_function=clone, recursive=True)


def in_float64(model: keras.Model) -> keras.Model:
    """A float64 copy of a model the task does not train (a teacher), weights and
    all, otherwise as it is: it runs as the task calls it."""
    def clone(layer):
        return layer.__class__.from_config(_in_float64(layer.get_config()))
    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    copy.set_weights(model.get_weights())
    return copy


def _global_batches(config: config_lib.Config, spec, num_steps: int) -> dict:
    """The first `num_steps` global batches of the run's training stream, stacked
    into one dict of [num_steps * batch, ...] tensors, floats in float64."""
    train_examples = sources.load(spec, spec.train_split, config.data_dir,
                                  config.download_data)[1]
    make = inputs.train_input_fn(config, spec, train_examples)
    whole = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                       num_replicas_in_sync=1)
    batches = list(make(whole).take(num_steps))
    stacked = {key: tf.concat([b[key] for b in batches], 0) for key in batches[0]}
    return {key: tf.cast(t, tf.float64) if t.dtype.is_floating else t
            for key, t in stacked.items()}


def _train(strategy, config, spec, plan, initial_weights, data: dict, num_steps: int):
    """(names, values before and after the steps of the weights and the optimizer's
    state, metric means) of `num_steps` steps of the run, built as training builds
    it, on `strategy`."""
    run = build.build_run(
        config, spec, plan, strategy, precision="float64",
        initial_weights=initial_weights,
        adapt_model=lambda model: checkable(model, config.grad_accum_steps > 1),
        adapt_fixed_model=in_float64)
    # The optimizer's state too: Adam's update hides a gradient summed twice (it is
    # scale-invariant), its second moment does not. Its start (zeros; the weights'
    # copies for an EMA or Lookahead's slow weights) is the baseline of its moves.
    state = [v for v in run.optimizer.variables if "iteration" not in v.path]
    variables = run.model.weights + state
    before = [np.asarray(v.numpy(), np.float64) for v in variables]
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(config.batch_size)
    dataset = dataset.with_options(_no_autoshard())
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    train_loop = distributed.make_train_loop(strategy, run.train_step)
    sums, _ = train_loop(iterator, tf.constant(num_steps), tf.constant(0.0))
    return ([v.path for v in variables], before,
            [np.asarray(v.numpy(), np.float64) for v in variables],
            distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums)))


def _no_autoshard() -> tf.data.Options:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return options


def _relative(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    if np.isnan(scale):
        return float("nan")
    return abs(a - b) / scale if scale > 1e-12 else 0.0


def run_check(config: config_lib.Config, num_steps: int = 3,
              tolerance: float = TOLERANCE,
              devices: list[str] | None = None) -> CheckResult:
    """Trains `num_steps` steps on 1 and on 2 replicas; compares. devices: two CPU
    device names (default: the host CPU split in two, before TF starts)."""
    devices = devices or strategy_lib.split_cpu(2)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(config.seed)
    spec = build.dataset_spec(config)
    plan = build.plan(config, spec, num_replicas=2)
    data = _global_batches(config, spec, num_steps)
    task = build.make_task(config, spec)
    model = build.build_model(config, spec, task)  # the run's initial weights
    build.init_from_data(model, config, spec)
    try:
        names, initial, one, one_metrics = _train(
            tf.distribute.OneDeviceStrategy(devices[0]), config, spec, plan,
            model.get_weights(), data, num_steps)
        _, _, two, two_metrics = _train(strategy_lib.mirrored(tuple(devices[:2])), config,
                                        spec, plan, model.get_weights(), data, num_steps)
    finally:
        keras.mixed_precision.set_global_policy(policy)  # (build_run set float64)
    moved = [np.linalg.norm(a - w0) for a, w0 in zip(one, initial)]
    apart = [np.linalg.norm(a - b) for a, b in zip(one, two)]
    per_variable = [(name, d / m if m > 0 else (0.0 if d == 0 else float("inf")))
                    for name, d, m in zip(names, apart, moved)]
    total_moved = float(np.sqrt(sum(m * m for m in moved)))
    total_apart = float(np.sqrt(sum(d * d for d in apart)))
    return CheckResult(
        weight_difference=total_apart / total_moved if total_moved else total_apart,
        worst_variable=max(per_variable, key=lambda item: item[1]),
        metrics={key: (one_metrics[key], two_metrics.get(key, float("nan")),
                       _relative(one_metrics[key], two_metrics.get(key, float("nan"))))
                 for key in one_metrics},
        tolerance=tolerance)


def report(result: CheckResult, config: config_lib.Config, num_steps: int) -> str:
    lines = [f"check_step: {config.model} ({config.model_size}) on {config.dataset}, "
             f"task {config.task}, {num_steps} steps of global batch {config.batch_size}: "
             f"1 replica vs 2 (MirroredStrategy on 2 CPU devices), float64, "
             f"{'frozen' if config.grad_accum_steps > 1 else 'synchronized'} batch-norm, "
             f"dropout off",
             f"  weights and optimizer state: relative difference {result.weight_difference:.2e} "
             f"(||w1 - w2|| / ||w1 - w0||; worst variable {result.worst_variable[0]}: "
             f"{result.worst_variable[1]:.2e})"]
    for key, (one, two, rel) in result.metrics.items():
        lines.append(f"  {key}: {one:.6g} (1 replica) vs {two:.6g} (2 replicas), "
                     f"relative difference {rel:.2e}")
    name, difference = result.deciding
    verdict = "PASS" if result.passed else "FAIL"
    lines.append(f"{verdict}: decided by {name}: relative difference {difference:.2e}, "
                 f"tolerance {result.tolerance:.0e}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    try:
        devices = strategy_lib.split_cpu(2)  # before anything starts TensorFlow
        config = main_lib.config_from_flags(FLAGS)
        result = run_check(config, FLAGS.check_steps, FLAGS.tolerance, devices=devices)
    except main_lib.USER_ERRORS as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)
    print(report(result, config, FLAGS.check_steps))
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    define_flags()
    cli.run(main, parse=main_lib.parse_flags)
