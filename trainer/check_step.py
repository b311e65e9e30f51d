"""Is a (changed) training step right on N replicas, and does it keep everything a
run trains in step?

    python -m trainer.check_step --model=cifar_cnn [the flags of the run] [--check_steps=3]

Builds the run exactly as training does (trainer/build.py: the task and the whole
state it creates: every model, optimizer and extra variable), takes `check_steps`
global batches from the run's own training pipeline, and trains them from one
initial state, in float64 with batch-norm synchronized across replicas and
dropout off, so that a correct step agrees up to float64 rounding (below 1e-13
here, against 1e-3 and more for the bugs below):

1. on 1 replica and on 2 (two logical CPU devices, MirroredStrategy, each global
   batch split between them): EVERYTHING in the state and every metric compared;
2. on 2 replicas, each replica's copy of every variable against the other's;
3. on 1 replica again: bitwise the same, or exact resume cannot hold;
4. the traced step searched for stateful random ops (named), and batch-norm
   layers counted: statistics updated by more than one training-mode forward pass
   a step are reported.

Prints every difference, the one that decided the verdict, and PASS or FAIL; exit
status 0 on PASS, 1 on FAIL, 2 on bad flags.

It catches the classic distributed-step bugs before a TPU hour is spent: a loss
divided by the per-replica batch instead of the global one (the summed gradient,
and so `grad_norm`, doubles), clipping before the cross-replica sum, a metric
averaged per replica and then summed, a second pass (SAM) that uses this
replica's gradient instead of the summed one, a teacher run in training mode,
contrastive negatives from this replica only, a state (an EMA teacher) updated on
one replica, noise drawn per replica or by a stateful op.

What it cannot decide: a bug that gives the same wrong result however the batch
is split, e.g. an EMA teacher updated before the optimizer step instead of after
it, a wrong loss formula, a learning rate too high. Test those against a hand
computation (tests/test_step.py does, for the built-in step).
"""
import dataclasses
import sys
from typing import Callable

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer import build, config as config_lib, distributed, inputs  # noqa: E402
from trainer import randomness, run_flags, step as step_lib  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
from trainer.settings import message_of  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.import_user_code(FLAGS, sys.argv)
    run_flags.define_flags(FLAGS)
    if "check_steps" in FLAGS:
        return
    flags.DEFINE_integer("check_steps", 0, "Training steps to compare (0: 3, or the "
                         "task's schedule of steps: one whole cycle, at least 3).",
                         lower_bound=0)
    flags.DEFINE_float("tolerance", TOLERANCE, "Largest relative difference that passes, "
                       "of the weights' updates and of each metric.")


# A correct step differs by float64 rounding only: at most 4.8e-14 measured over
# the built-in models, tasks and step settings (docs/changing-the-step.md); the
# smallest difference a planted bug made is 2.3e-3. The tolerance sits between them.
TOLERANCE = 1e-7


@dataclasses.dataclass(frozen=True)
class CheckResult:
    weight_difference: float            # ||s1 - s2|| / ||s1 - s0|| over the whole state
    worst_variable: tuple[str, float]   # the same per variable: the largest
    metrics: dict[str, tuple[float, float, float]]  # name: (1 replica, 2, relative)
    tolerance: float
    replica_difference: tuple[str, float] = ("", 0.0)  # worst copy of 2 vs the other's
    repeat_difference: tuple[str, float] = ("", 0.0)   # 1 replica twice: worst variable
    repeat_bitwise: bool = True
    counts_differ: tuple[str, ...] = ()  # integer variables (steps) 1 vs 2 replicas
    stateful_ops: tuple[str, ...] = ()   # stateful random ops in the traced step
    batch_norm_passes: dict[str, float] = dataclasses.field(default_factory=dict)
    state_summary: str = ""
    heading: str = ""  # what was checked: the run and the comparison

    def differences(self) -> dict[str, float]:
        """Every compared quantity's relative difference (infinite: a finding that
        has no size)."""
        return {"1 vs 2 replicas: the state": self.weight_difference,
                **{name: rel for name, (_, _, rel) in self.metrics.items()},
                "the replicas' copies": self.replica_difference[1],
                "the step repeated": self.repeat_difference[1],
                "step counts": float("inf") if self.counts_differ else 0.0,
                "stateful random ops": float("inf") if self.stateful_ops else 0.0}

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


class CountingBatchNormalization(keras.layers.BatchNormalization):
    """Keras' batch-norm that counts its training-mode forward passes in a float
    statistic of its own (so a second pass that puts the statistics back, as
    step.gradient_at_offset does, puts the count back too)."""

    def build(self, input_shape):
        super().build(input_shape)
        self.forward_passes = self.add_weight(shape=(), initializer="zeros",
                                              trainable=False, name="forward_passes",
                                              dtype="float64", autocast=False)

    def call(self, inputs, training=None, mask=None):
        if training and self.trainable:
            self.forward_passes.assign_add(tf.constant(1.0, tf.float64))
        return super().call(inputs, training=training, mask=mask)


def pass_counters(model: keras.Model) -> dict[int, str]:
    """id(variable) -> layer name of the pass counters of `model`'s counting
    batch-norm layers (nested models' too): check_step's own variables, found by
    their layer, not by their name."""
    found = {}
    for layer in getattr(model, "layers", []):
        if isinstance(layer, CountingBatchNormalization):
            found[id(layer.forward_passes)] = layer.name
        found.update(pass_counters(layer))
    return found


def _copy_weights(source: keras.Model, target: keras.Model) -> None:
    """`source`'s weights into its clone `target` (whose counters stay 0)."""
    counters = pass_counters(target)
    weights = [w for w in target.weights if id(w) not in counters]
    for variable, value in zip(weights, source.get_weights()):
        variable.assign(tf.cast(value, variable.dtype))


def checkable(model: keras.Model, freeze_batch_norm: bool = False) -> keras.Model:
    """A copy of `model`, weights and all, in float64 with batch-norm synchronized
    across replicas (statistics of the global batch; its training-mode passes
    counted) and dropout off: then 1 and N replicas must agree up to float64
    rounding.

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
            return CountingBatchNormalization.from_config(layer_config)
        if isinstance(layer, keras.layers.Dropout):
            layer_config["rate"] = 0.0
        return layer.__class__.from_config(layer_config)
    copy = _clone(model, clone)
    _copy_weights(model, copy)
    return copy


def _clone(model: keras.Model, clone: Callable) -> keras.Model:
    """keras.models.clone_model, layer by layer; a layer Keras cannot rebuild from
    its config (a subclassed model without get_config) is one ConfigError line."""
    try:
        return keras.models.clone_model(model, clone_function=clone, recursive=True)
    except NotImplementedError as err:
        raise config_lib.ConfigError(
            f"check_step copies {model.name} layer by layer (float64, synchronized "
            f"batch-norm, no dropout), and Keras cannot rebuild a part of it from its "
            f"config ({' '.join(str(err).split())[:160]}); give that layer or "
            f"subclassed model a get_config(), or build it from layers "
            f"(functional or Sequential)") from err


def in_float64(model: keras.Model) -> keras.Model:
    """A float64 copy of a model the task does not train (a teacher), weights and
    all, otherwise as it is: it runs as the task calls it."""
    def clone(layer):
        return layer.__class__.from_config(_in_float64(layer.get_config()))
    copy = _clone(model, clone)
    copy.set_weights(model.get_weights())
    return copy


def _global_batches(data: inputs.RunData, task, num_steps: int) -> dict:
    """The first `num_steps` global batches of the run's training stream (the
    task's own batches: two views, ...), stacked into one dict of
    [num_steps * batch, ...] tensors, floats in float64."""
    train_examples = data.load(data.spec.train_split)[1]
    make = inputs.train_input_fn(data, train_examples,
                                 own_batch=build.own_training_batch(task))
    whole = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                       num_replicas_in_sync=1)
    batches = list(make(whole).take(num_steps))
    stacked = {key: tf.concat([b[key] for b in batches], 0) for key in batches[0]}
    return {key: tf.cast(t, tf.float64) if t.dtype.is_floating else t
            for key, t in stacked.items()}


class _Trial:
    """A run built on `strategy` as training builds it (float64, checkable models),
    that trains `num_steps` global batches of `data` from a given state."""

    def __init__(self, strategy, config, spec, plan, data: dict, num_steps: int):
        self.strategy, self.config, self.num_steps = strategy, config, num_steps
        keras.utils.set_random_seed(config.seed)
        self.run = build.build_run(
            config, spec, plan, strategy, precision="float64",
            adapt_model=lambda model: checkable(model, config.grad_accum_steps > 1),
            adapt_fixed_model=in_float64)
        state = self.run.state
        # Everything the state holds (with the random generators' state), and of it
        # what is compared (the batch-norm pass counters are check_step's own).
        counters = {key: name for model in state.models.values()
                    for key, name in pass_counters(model).items()}
        self.compared = [(name, v) for name, v in state.compared_variables()
                         if id(v) not in counters]
        self.counters = [(counters[id(v)], v) for _, v in state.compared_variables()
                         if id(v) in counters]
        self.variables = ([v for _, v in self.compared] + [v for _, v in self.counters]
                          + state.random_variables())  # (the compared ones first)
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(config.batch_size)
        self.dataset = strategy.experimental_distribute_dataset(
            dataset.with_options(_no_autoshard()))
        self.loop = distributed.make_train_loop(strategy, self.run.train_steps,
                                                state=state)

    def snapshot(self) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self.variables]

    def restore(self, values: list[np.ndarray]) -> None:
        with self.strategy.scope():
            for variable, value in zip(self.variables, values):
                variable.assign(value)

    def train(self) -> dict[str, float]:
        """Trains the steps from the state as it is; the metric means."""
        iterator = iter(self.dataset)
        sums, _ = self.loop(iterator, tf.constant(self.num_steps), tf.constant(0.0))
        self._iterator = iterator
        return distributed.means(tf.nest.map_structure(lambda t: t.numpy(), sums))

    def values(self) -> list[np.ndarray]:
        """The compared variables' values (replica 0's copy)."""
        return [np.asarray(v.numpy()) for _, v in self.compared]

    def copies(self) -> list[list[np.ndarray]]:
        """Each compared variable's value on every replica."""
        result = []
        for _, variable in self.compared:
            inner = variable.value if isinstance(variable, keras.Variable) else variable
            result.append([np.asarray(c.numpy()) for c in
                           self.strategy.experimental_local_results(inner)])
        return result

    def stateful_random_ops(self) -> list[str]:
        graph = self.loop.get_concrete_function(
            self._iterator, tf.constant(self.num_steps), tf.constant(0.0)).graph
        return randomness.stateful_random_ops(graph)


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


def _apart(names, initial, first, second) -> tuple[float, tuple[str, float]]:
    """(||first - second|| / ||first - initial|| over the float variables, the worst
    variable and its own ratio)."""
    moved, apart, per_variable = 0.0, 0.0, []
    for name, w0, a, b in zip(names, initial, first, second):
        if not np.issubdtype(a.dtype, np.floating):
            continue
        m = float(np.linalg.norm((a - w0).ravel()))
        d = float(np.linalg.norm((a - b).ravel())) if not np.array_equal(a, b) else 0.0
        moved, apart = moved + m * m, apart + d * d
        per_variable.append((name, d / m if m > 0 else (0.0 if d == 0 else float("inf"))))
    worst = max(per_variable, key=lambda item: item[1], default=("", 0.0))
    total = np.sqrt(apart) / np.sqrt(moved) if moved else np.sqrt(apart)
    return float(total), worst


def default_steps(steps: "step_lib.Steps") -> int:
    """The steps check_step compares by default: 3, or a whole cycle of a task's
    schedule of steps (5 critic steps and a generator step: 6)."""
    return max(3, steps.cycle if steps.repeat else 0)


def run_check(config: config_lib.Config, num_steps: int = 0,
              tolerance: float = TOLERANCE,
              devices: list[str] | None = None) -> CheckResult:
    """Trains `num_steps` steps (0: default_steps) on 1 replica, on 2, and on 1
    again, from the same state; compares. devices: two CPU device names (default:
    the host CPU split in two, before TF starts)."""
    devices = devices or strategy_lib.split_cpu(2)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    spec = build.run_data(config).spec
    plan = build.plan(config, spec, num_replicas=2)
    task = build.make_task(config, spec)
    schedule = task.train_steps(plan)
    num_steps = num_steps or default_steps(schedule)
    data = _global_batches(build.run_data(config, spec), task, num_steps)
    try:
        one = _Trial(tf.distribute.OneDeviceStrategy(devices[0]), config, spec, plan,
                     data, num_steps)
        start = one.snapshot()  # THE initial state, of both runs
        one_metrics = one.train()
        after_one, names = one.values(), [name for name, _ in one.compared]
        initial = [start[i] for i in range(len(one.compared))]
        passes = {layer: float(v.numpy()) / num_steps for layer, v in one.counters}
        stateful = one.stateful_random_ops()
        one.restore(start)  # the same steps again: bitwise the same?
        one.train()
        repeat = one.values()
        two = _Trial(strategy_lib.mirrored(tuple(devices[:2])), config, spec, plan, data,
                     num_steps)
        two.restore(start)
        two_metrics = two.train()
        after_two, copies = two.values(), two.copies()
    finally:
        keras.mixed_precision.set_global_policy(policy)  # (build_run set float64)
    difference, worst = _apart(names, initial, after_one, after_two)
    replica_worst = ("", 0.0)
    for name, w0, per_replica in zip(names, initial, copies):
        first = per_replica[0]
        for other in per_replica[1:]:
            _, candidate = _apart([name], [w0], [first], [other])
            if candidate[1] > replica_worst[1] or np.isnan(candidate[1]):
                replica_worst = candidate
    _, repeat_worst = _apart(names, initial, after_one, repeat)
    counts = tuple(name for name, a, b in zip(names, after_one, after_two)
                   if not np.issubdtype(a.dtype, np.floating) and not np.array_equal(a, b))
    models = ", ".join(f"{name} {m.count_params():,}"
                       for name, m in one.run.state.models.items())
    summary = (f"state: models {models}; optimizers "
               f"{', '.join(one.run.state.optimizers) or 'none'}; extras "
               f"{', '.join(one.run.state.extras) or 'none'}; {len(names)} variables "
               f"compared")
    batch_norm = "frozen" if config.grad_accum_steps > 1 else "synchronized"
    return CheckResult(
        weight_difference=difference, worst_variable=worst,
        metrics={key: (one_metrics[key], two_metrics.get(key, float("nan")),
                       _relative(one_metrics[key], two_metrics.get(key, float("nan"))))
                 for key in one_metrics},
        tolerance=tolerance, replica_difference=replica_worst,
        repeat_difference=repeat_worst,
        repeat_bitwise=all(np.array_equal(a, b) for a, b in zip(after_one, repeat)),
        counts_differ=counts, stateful_ops=tuple(stateful),
        batch_norm_passes=passes, state_summary=summary,
        heading=(f"check_step: {config.model} ({config.model_size}) on {config.dataset}, "
                 f"task {config.task}, {num_steps} steps of global batch "
                 f"{config.batch_size}" + (
                     f" (its steps: {schedule.describe()})" if len(schedule.parts) > 1
                     else "") + f": 1 replica vs 2 (MirroredStrategy on 2 CPU "
                 f"devices), float64, {batch_norm} batch-norm, dropout off"))


def report(result: CheckResult) -> str:
    lines = [result.heading,
             f"  {result.state_summary}",
             f"  1 vs 2 replicas, the whole state: relative difference "
             f"{result.weight_difference:.2e} (||s1 - s2|| / ||s1 - s0||; worst variable "
             f"{result.worst_variable[0]}: {result.worst_variable[1]:.2e})"]
    name, value = result.replica_difference
    lines.append(f"  the 2 replicas' copies of each variable: relative difference "
                 f"{value:.2e}" + (f" (worst {name})" if value else " (identical)"))
    name, value = result.repeat_difference
    lines.append("  the steps repeated on 1 replica from the same state: " + (
        "bitwise the same" if result.repeat_bitwise else
        f"NOT bitwise the same (worst {name}: {value:.2e}): a non-deterministic op "
        f"(e.g. tf.vectorized_map's); an exact resume cannot hold"))
    if result.counts_differ:
        lines.append(f"  step counts differ between 1 and 2 replicas: "
                     f"{', '.join(result.counts_differ)}")
    lines.append("  stateful random ops in the step: " + (
        "; ".join(result.stateful_ops) + " (other numbers on each replica and after a "
        "resume: draw from trainer.randomness)" if result.stateful_ops else "none"))
    several = {layer: n for layer, n in result.batch_norm_passes.items() if n > 1}
    if several:
        lines.append(f"  note: batch-norm statistics updated by {max(several.values()):g} "
                     f"training-mode forward passes a step in {len(several)} layer(s) "
                     f"(e.g. {next(iter(several))}): an attack or a second pass in "
                     f"training mode moves them more than once; if not meant, call the "
                     f"model with training=False there, or use step.gradient_at_offset")
    elif result.batch_norm_passes:
        lines.append(f"  batch-norm: at most one training-mode pass a step in each of "
                     f"{len(result.batch_norm_passes)} layer(s)")
    for key, (one, two, rel) in result.metrics.items():
        lines.append(f"  {key}: {one:.6g} (1 replica) vs {two:.6g} (2 replicas), "
                     f"relative difference {rel:.2e}")
    name, difference = result.deciding
    verdict = "PASS" if result.passed else "FAIL"
    lines.append(f"{verdict}: decided by {name}: relative difference {difference:.2e}, "
                 f"tolerance {result.tolerance:.0e}")
    lines.append("  (not decided here: a bug that gives the same result however the batch "
                 "is split, e.g. an EMA updated before the optimizer step, a wrong loss)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    try:
        devices = strategy_lib.split_cpu(2)  # before anything starts TensorFlow
        config = run_flags.config_from_flags(FLAGS)
        result = run_check(config, FLAGS.check_steps, FLAGS.tolerance, devices=devices)
    except run_flags.USER_ERRORS as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)
    print(report(result))
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
