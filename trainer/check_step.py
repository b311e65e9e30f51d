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
   a step are reported;
5. on 2 replicas in the run's own precision (mixed_bfloat16 for --precision=auto,
   a TPU's and this CPU's): a collective that refuses the dtype (all_gather of
   bfloat16) FAILs here, naming the op, where float64 and 1 replica cannot see it;
6. what the steps changed, per model; with a task's schedule of steps (Task.
   train_steps), a whole cycle by default, each phase from its first step, and
   step by step what a part declares frozen (step.Steps.frozen): a change FAILs.

An exception in the task's step is one FAIL line with the task's file and line.
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
import fnmatch
import os
import re
import sys
import traceback
from typing import Callable

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402
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
    counts_differ: tuple[str, ...] = ()  # integer variables 1 vs 2 replicas
    stateful_ops: tuple[str, ...] = ()   # stateful random ops in the traced step
    batch_norm_passes: dict[str, float] = dataclasses.field(default_factory=dict)
    state_summary: str = ""
    heading: str = ""  # what was checked: the run and the comparison
    step_error: str = ""  # the step raised (float64 on 1 or 2 replicas): what, where
    precision: str = ""   # the run's own precision, also trained on 2 replicas
    precision_error: str = ""  # ... and what it raised there
    moved: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    frozen_moved: tuple[str, ...] = ()  # "part: variable" declared frozen, changed
    outside_state: tuple[str, ...] = ()  # variables the step uses, not in the state

    def differences(self) -> dict[str, float]:
        """Every compared quantity's relative difference; a finding that has no
        size (a raised step, a stateful op) is infinite (the report says which)."""
        found = lambda failed: float("inf") if failed else 0.0  # noqa: E731
        return {"1 vs 2 replicas: the state": self.weight_difference,
                **{name: rel for name, (_, _, rel) in self.metrics.items()},
                "the replicas' copies": self.replica_difference[1],
                "the step repeated": self.repeat_difference[1],
                "integer variables 1 vs 2 replicas": found(self.counts_differ),
                "stateful random ops": found(self.stateful_ops),
                "the step raised an exception": found(self.step_error),
                f"the step in {self.precision or 'the run precision'} on 2 replicas":
                    found(self.precision_error),
                "a variable declared frozen moved": found(self.frozen_moved)}

    @property
    def deciding(self) -> tuple[str, float]:
        """The quantity that decided the verdict: the largest difference (NaN first)."""
        return max(self.differences().items(),
                   key=lambda item: float("inf") if np.isnan(item[1]) else item[1])

    @property
    def passed(self) -> bool:
        return all(d <= self.tolerance for d in self.differences().values())  # NaN fails


def step_error(err: BaseException) -> str:
    """One line for an exception raised in a task's step: its type, its message's
    last line (TensorFlow's staging errors put the cause last), the TensorFlow op
    it failed in (an all_gather that refuses bfloat16), and the last place in the
    task's own code it went through (not TensorFlow's, Keras' or the framework's).
    Reads the tracebacks of the exception and of those it was raised from (a
    replica's, re-raised by MirroredStrategy) and autograph's map back to the
    source; run_check turns TensorFlow's traceback filtering off to keep them."""
    chain, seen = [], err
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    places, ops = [], []
    for raised in reversed(chain):
        frames = traceback.extract_tb(raised.__traceback__)
        for frame in frames:
            places.append((frame.filename, frame.lineno))
        # The op it failed in: where the innermost frames are TensorFlow's making
        # of an op (e.g. collective_ops.all_gather_v2 -> gen_collective_ops...).
        making = [frame.filename.replace(os.sep, "/") for frame in frames[-4:]]
        if raised is chain[-1] and any("/tensorflow/python/framework/op_def" in path
                                       for path in making):
            ops = [frame.name for frame in frames
                   if "/tensorflow/python/ops/" in frame.filename.replace(os.sep, "/")]
        metadata = getattr(raised, "ag_error_metadata", None)
        places += [(f.filename, f.lineno) for f in getattr(metadata, "translated_stack", ())]
    places += [(path, int(line)) for path, line in
               re.findall(r'File "([^"]+)", line (\d+)', str(err))]
    own = [f"{path}:{line}" for path, line in places if _task_code(path)]
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"[A-Za-z_.]*(Error|Exception): ", line)]
    message = (causes[-1] if causes else f"{type(err).__name__}: "
               f"{lines[0] if lines else ''}")
    api = [name for name in ops if not name.startswith("_")][-2:]  # (the op's own)
    where = f" in {' -> '.join(dict.fromkeys(api))}" if api else ""
    return (files.shorter(message, 200) + where
            + (f" (at {own[-1]})" if own else ""))


def _task_code(path: str) -> bool:
    """Whether `path` is a task's code (a researcher's file, or trainer/tasks/),
    not TensorFlow's, Keras' or the framework's."""
    path = path.replace(os.sep, "/")
    if ("site-packages" in path or path.startswith("<") or "__autograph_generated" in path
            or "/python3." in path):
        return False
    framework = os.path.dirname(os.path.abspath(__file__)).replace(os.sep, "/") + "/"
    return not path.startswith(framework) or path.startswith(framework + "tasks/")


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


def global_batches(data: inputs.RunData, task, num_steps: int) -> dict:
    """The first `num_steps` global batches of the run's training stream (the
    task's own batches: two views, ...), stacked into one dict of
    [num_steps * batch, ...] tensors, floats in float64."""
    train_examples = data.load(data.spec.train_split)[1]
    make = inputs.train_input_fn(data, train_examples,
                                 task_input=build.task_input(task))
    whole = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                       num_replicas_in_sync=1)
    batches = list(make(whole).take(num_steps))
    stacked = tf.nest.map_structure(lambda *steps: tf.concat(steps, 0), *batches)
    return tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float64) if t.dtype.is_floating else t, stacked)


def _batched(data: dict, batch_size: int, task) -> tf.data.Dataset:
    """The stacked global batches again as batches: one dict, or with a task's
    streams one batch of each stream a step (at its own batch size)."""
    streams = build.task_input(task)
    if not isinstance(streams, dict):
        return tf.data.Dataset.from_tensor_slices(data).batch(batch_size)
    return tf.data.Dataset.zip({
        name: tf.data.Dataset.from_tensor_slices(data[name]).batch(
            batch_size * stream.batch_factor) for name, stream in streams.items()})


class _Trial:
    """A run built on `strategy` as training builds it (float64, checkable models;
    or, given another `precision`, the run's own models in it), that trains
    `num_steps` global batches of `data` from a given state, from the step
    `start_step` of the task's schedule."""

    def __init__(self, strategy, config, spec, plan, data: dict, num_steps: int,
                 precision: str = "float64", start_step: int = 0):
        self.strategy, self.config, self.num_steps = strategy, config, num_steps
        keras.utils.set_random_seed(config.seed)
        checked = precision == "float64"
        self.run = build.build_run(
            config, spec, plan, strategy, precision=precision,
            adapt_model=(lambda model: checkable(model, config.grad_accum_steps > 1))
            if checked else None, adapt_fixed_model=in_float64 if checked else None)
        state = self.run.state
        state.step.assign(start_step)
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
        if not checked:  # (the pipeline's own dtypes: float32 images)
            data = tf.nest.map_structure(
                lambda t: tf.cast(t, tf.float32) if t.dtype == tf.float64 else t, data)
        dataset = _batched(data, config.batch_size, self.run.task)
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

    def train_one_by_one(self) -> list[list[np.ndarray]]:
        """Trains the steps one loop each from the state as it is; the compared
        variables' values before the first step and after each."""
        iterator = iter(self.dataset)
        values = [self.values()]
        for _ in range(self.num_steps):
            self.loop(iterator, tf.constant(1), tf.constant(0.0))
            values.append(self.values())
        return values

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

    def _graph(self) -> tf.Graph:
        return self.loop.get_concrete_function(
            self._iterator, tf.constant(self.num_steps), tf.constant(0.0)).graph

    def stateful_random_ops(self) -> list[str]:
        return randomness.stateful_random_ops(self._graph())

    def outside_state(self) -> list[str]:
        """The variables the traced step reads or writes that the run's state does
        not hold (a task's own counter): not saved, restored or compared."""
        state = self.run.state
        held = set()
        for variable in [*(v for _, v in state.compared_variables()),
                         *state.random_variables(),
                         *(v for o in state.optimizers.values() for v in o.variables)]:
            inner = variable.value if isinstance(variable, keras.Variable) else variable
            for copy in self.strategy.experimental_local_results(inner):
                held.add(id(copy))
                held.add(id(getattr(copy, "value", copy)))
        found = []
        for variable in self._graph().variables:
            if id(variable) not in held and id(getattr(variable, "value", variable)) \
                    not in held:
                found.append(getattr(variable, "path", variable.name))
        return found


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
              tolerance: float = TOLERANCE, devices: list[str] | None = None,
              start_step: int = 0) -> CheckResult:
    """Trains `num_steps` steps (0: default_steps) on 1 replica, on 2, and on 1
    again, from the same state at the schedule's step `start_step`; compares; then
    trains them on 2 replicas in the run's own precision. devices: two CPU device
    names (default: the host CPU split in two, before TF starts)."""
    devices = devices or strategy_lib.split_cpu(2)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    spec = build.run_data(config).spec
    plan = build.plan(config, spec, num_replicas=2)
    task = build.make_task(config, spec)
    schedule = task.train_steps(plan)
    num_steps = num_steps or default_steps(schedule)
    data = global_batches(build.run_data(config, spec), task, num_steps)
    batch_norm = "frozen" if config.grad_accum_steps > 1 else "synchronized"
    steps = (f"steps {start_step + 1}-{start_step + num_steps}" if start_step
             else f"{num_steps} steps")
    heading = (f"check_step: {config.model} ({config.model_size}) on {config.dataset}, "
               f"task {config.task}, {steps} of global batch {config.batch_size}"
               + (f" (its steps: {schedule.describe()})" if len(schedule.parts) > 1
                  else "") + f": 1 replica vs 2 (MirroredStrategy on 2 CPU devices), "
               f"float64, {batch_norm} batch-norm, dropout off")
    precision = run_precision(config.precision)
    trial = lambda strategy, **more: _Trial(  # noqa: E731
        strategy, config, spec, plan, data, num_steps, start_step=start_step, **more)
    filtering = tf.debugging.is_traceback_filtering_enabled()
    tf.debugging.disable_traceback_filtering()  # (step_error reads the whole trace)
    try:
        try:
            one = trial(tf.distribute.OneDeviceStrategy(devices[0]))
            start = one.snapshot()  # THE initial state, of both runs
            one_metrics = one.train()
            after_one, names = one.values(), [name for name, _ in one.compared]
            initial = [start[i] for i in range(len(one.compared))]
            passes = {layer: float(v.numpy()) / num_steps for layer, v in one.counters}
            stateful = one.stateful_random_ops()
            one.restore(start)  # the same steps again: bitwise the same?
            one.train()
            repeat = one.values()
            repeat_bitwise = all(np.array_equal(a, b) for a, b in zip(after_one, repeat))
            outside = () if repeat_bitwise else tuple(one.outside_state())
            frozen_moved = ()
            if schedule.frozen:  # step by step: what each part of the schedule moved
                one.restore(start)
                frozen_moved = _frozen_moved(schedule, start_step, names,
                                             one.train_one_by_one())
            two = trial(strategy_lib.mirrored(tuple(devices[:2])))
            two.restore(start)
            two_metrics = two.train()
            after_two, copies = two.values(), two.copies()
        except Exception as err:  # noqa: BLE001 (the user's step: a verdict, not a trace)
            if isinstance(err, config_lib.ConfigError):
                raise
            return CheckResult(0.0, ("", 0.0), {}, tolerance, heading=heading,
                               step_error=step_error(err))
        precision_error = ""
        if precision not in ("float32", "float64"):
            try:  # a collective that refuses the run's dtype fails only on N replicas
                trial(strategy_lib.mirrored(tuple(devices[:2])), precision=precision).train()
            except Exception as err:  # noqa: BLE001
                if isinstance(err, config_lib.ConfigError):
                    raise
                precision_error = step_error(err)
    finally:
        keras.mixed_precision.set_global_policy(policy)  # (build_run set float64)
        if filtering:
            tf.debugging.enable_traceback_filtering()
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
    state = one.run.state
    models = ", ".join(f"{name} {m.count_params():,}" for name, m in state.models.items())
    summary = (f"state: models {models}; optimizers "
               f"{', '.join(state.optimizers) or 'none'}; extras "
               f"{', '.join(state.extras) or 'none'}; {len(names)} variables compared")
    return CheckResult(
        weight_difference=difference, worst_variable=worst,
        metrics={key: (one_metrics[key], two_metrics.get(key, float("nan")),
                       _relative(one_metrics[key], two_metrics.get(key, float("nan"))))
                 for key in one_metrics},
        tolerance=tolerance, replica_difference=replica_worst,
        repeat_difference=repeat_worst, repeat_bitwise=repeat_bitwise,
        counts_differ=counts, stateful_ops=tuple(stateful),
        batch_norm_passes=passes, state_summary=summary, heading=heading,
        precision=precision, precision_error=precision_error,
        moved=_moved(state, names, initial, after_one), frozen_moved=frozen_moved,
        outside_state=outside)


def run_precision(precision: str) -> str:
    """The precision a run of --precision=`precision` trains in where it matters
    most: it, or for auto mixed_bfloat16 (a TPU's, and this CPU's default when it
    has bf16)."""
    return "mixed_bfloat16" if precision == "auto" else precision


def _moved(state, names: list[str], initial: list, after: list) -> dict[str, tuple]:
    """{model or "extras": (variables changed over the steps, variables)}."""
    groups = {f"{name}/": name for name in state.models} | {"extras/": "extras"}
    moved: dict[str, list[int]] = {}
    for name, before, now in zip(names, initial, after):
        group = next((label for prefix, label in groups.items()
                      if name.startswith(prefix)), None)
        if group is not None:
            counted = moved.setdefault(group, [0, 0])
            counted[0] += not np.array_equal(before, now)
            counted[1] += 1
    return {group: tuple(counted) for group, counted in moved.items()}


def _frozen_moved(schedule: step_lib.Steps, start_step: int, names: list[str],
                  values: list[list[np.ndarray]]) -> tuple[str, ...]:
    """'part: variable' for each variable a part of the schedule declares frozen
    (Steps.frozen: globs on the compared names) that a step of that part changed."""
    def frozen(name: str, patterns: tuple[str, ...]) -> bool:  # ("!glob": except)
        return (any(fnmatch.fnmatchcase(name, p) for p in patterns if p[:1] != "!")
                and not any(fnmatch.fnmatchcase(name, p[1:]) for p in patterns
                            if p[:1] == "!"))

    for part, patterns in schedule.frozen.items():
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern.lstrip("!")) for name in names):
                raise config_lib.ConfigError(
                    f"Steps.frozen[{part!r}]: {pattern!r} matches no variable of the "
                    f"state; names look like {names[0]!r}")
    found = []
    for t in range(len(values) - 1):
        part = schedule.name_at(start_step + t)
        for i, name in enumerate(names):
            if (frozen(name, schedule.frozen.get(part, ()))
                    and not np.array_equal(values[t][i], values[t + 1][i])):
                found.append(f"{part} (step {start_step + t + 1}): {name}")
    return tuple(dict.fromkeys(found))


def report(result: CheckResult) -> str:
    lines = [result.heading]
    if result.step_error:
        lines += [f"  the step raised {result.step_error}",
                  "FAIL: decided by the step raising an exception (fix the line named "
                  "above; a traceback: python -m trainer.main with the same flags)"]
        return "\n".join(lines)
    lines += [f"  {result.state_summary}",
              f"  1 vs 2 replicas, the whole state: relative difference "
              f"{_size(result.weight_difference)} (||s1 - s2|| / ||s1 - s0||; worst "
              f"variable {result.worst_variable[0]}: {_size(result.worst_variable[1])})"]
    if result.moved:
        lines.append(f"  what the steps changed: " + ", ".join(
            f"{group} {changed} of {total} variables" for group, (changed, total)
            in result.moved.items()))
    name, value = result.replica_difference
    lines.append(f"  the 2 replicas' copies of each variable: " + (
        "identical" if not value else f"relative difference {_size(value)} (worst {name})"))
    name, value = result.repeat_difference
    if result.repeat_bitwise:
        lines.append("  the steps repeated on 1 replica from the same state: bitwise the "
                     "same")
    elif result.outside_state:
        lines.append(f"  the steps repeated on 1 replica from the same state: NOT bitwise "
                     f"the same (worst {name}: {_size(value)}): the step uses variable(s) "
                     f"outside the run's state ({', '.join(result.outside_state[:3])}), "
                     f"which are not restored (here, or by a resume): put them in "
                     f"build.state(..., extras=...) (build.variable)")
    else:
        lines.append(f"  the steps repeated on 1 replica from the same state: NOT bitwise "
                     f"the same (worst {name}: {_size(value)}): state kept outside the "
                     f"run's state (a Python counter, a variable of the task's own), or a "
                     f"non-deterministic op (e.g. tf.vectorized_map's); an exact resume "
                     f"cannot hold")
    if result.counts_differ:
        lines.append(f"  integer variables differ between 1 and 2 replicas: "
                     f"{', '.join(result.counts_differ)}")
    lines.append("  stateful random ops in the step: " + (
        "; ".join(result.stateful_ops) + " (other numbers on each replica and after a "
        "resume: draw from trainer.randomness)" if result.stateful_ops else "none"))
    several = {layer: n for layer, n in result.batch_norm_passes.items() if n > 1 + 1e-9}
    if several:
        lines.append(f"  note: batch-norm statistics updated by {max(several.values()):.3g} "
                     f"training-mode forward passes a step (on average) in {len(several)} "
                     f"layer(s) (e.g. {next(iter(several))}): an attack or a second pass "
                     f"in training mode moves them more than once; if not meant, call the "
                     f"model with training=False there, or use step.gradient_at_offset")
    elif result.batch_norm_passes:
        lines.append(f"  batch-norm: at most one training-mode pass a step in each of "
                     f"{len(result.batch_norm_passes)} layer(s)")
    by_part: dict[str, dict[str, list[str]]] = {}  # part: variable: its steps
    for frozen in result.frozen_moved:  # ("head (step 1): main/...")
        part, _, name = frozen.partition(": ")
        label, _, at = part.partition(" (step ")
        by_part.setdefault(label, {}).setdefault(name, []).append(at.rstrip(")"))
    for part, changed in by_part.items():
        steps = sorted({int(t) for ts in changed.values() for t in ts})
        names = list(changed)
        lines.append(f"  declared frozen in {part} steps, but changed (steps "
                     f"{', '.join(map(str, steps))}): {', '.join(names[:4])}"
                     + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    if result.precision:
        lines.append(f"  the steps on 2 replicas in {result.precision} (the run's "
                     f"precision): " + (f"raised {result.precision_error}" if
                                        result.precision_error else "ran"))
    for key, (one, two, rel) in result.metrics.items():
        lines.append(f"  {key}: {one:.6g} (1 replica) vs {two:.6g} (2 replicas), "
                     f"relative difference {_size(rel)}")
    name, difference = result.deciding
    verdict = "PASS" if result.passed else "FAIL"
    lines.append(f"{verdict}: decided by {name}" + (
        f": relative difference {difference:.2e}, tolerance {result.tolerance:.0e}"
        if np.isfinite(difference) else " (a finding, not a difference: see above)"))
    lines.append("  (not decided here: a bug that gives the same result however the batch "
                 "is split, e.g. an EMA updated before the optimizer step, a wrong loss)")
    return "\n".join(lines)


def _size(relative: float) -> str:
    """A relative difference as a number; where there is no scale to divide by
    (a value that was 0), what happened."""
    return f"{relative:.2e}" if np.isfinite(relative) or np.isnan(relative) else (
        "from zero to nonzero")


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    try:
        devices = strategy_lib.split_cpu(2)  # before anything starts TensorFlow
        config = run_flags.config_from_flags(FLAGS)
        # Where the checks start: step 0, and for a task whose steps are phases (a
        # head, then the whole network) the first step of every later phase too.
        spec = build.run_data(config).spec
        schedule = build.make_task(config, spec).train_steps(
            build.plan(config, spec, num_replicas=2))
        results = []
        for start in [0] if schedule.repeat else schedule.starts():
            results.append(run_check(config, FLAGS.check_steps, FLAGS.tolerance,
                                     devices=devices, start_step=start))
            print(report(results[-1]), flush=True)
    except run_flags.USER_ERRORS as err:
        print(f"error: {message_of(err)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if all(result.passed for result in results) else 1)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
