"""The distribution wrapper: run a per-replica step on every replica, N steps per call.

It runs whatever per-replica function it is given (`fn(batch) -> {name: (total,
weight)}`, see trainer/step.py) and knows nothing of what the step computes. One
`tf.function` call runs `num_steps` steps in an in-graph loop (fewer Python round
trips; on a TPU one host call per loop); `num_steps` is a tensor, so a shorter last
loop does not retrace. Given the run's state (trainer/state.py), it advances the
state's step counter after every step, whatever the step did, and checks that the
step left every weight finite (reading them, no copy): the first step that did not
is reported to the loop, which stops before anything is saved.
"""
import functools
from typing import Callable

import numpy as np
import tensorflow as tf

from trainer import strategy as strategy_lib
from trainer.settings import ConfigError

SUM = tf.distribute.ReduceOp.SUM
INPUT_WAIT = "input_wait_seconds"  # the loop's own entries in a train loop's sums
NONFINITE_AT = "_nonfinite_at_step"  # (first step leaving a non-finite weight or 0, 1)
STEPS_DONE = "_steps_done"  # (steps run: num_steps, or fewer after a stop request; 1)
STEP_COUNTER = "_step_counter"  # (the state's step counter after the call, 1), with a state
LOOP_KEYS = (INPUT_WAIT, NONFINITE_AT, STEPS_DONE, STEP_COUNTER)
Metric = tuple[tf.Tensor, tf.Tensor]  # (total, weight): shown as total / weight
Sums = dict[str, Metric]


class StepContractError(ConfigError):
    """A step returned something the wrapper cannot sum (one line, exit 2)."""


# do_not_convert: no Python branch on a tensor, no task code below (start-up time;
# docs/changing-the-step.md).
@tf.autograph.experimental.do_not_convert
def summable(metrics, source: str = "the step", reserved: tuple[str, ...] = ()) -> Sums:
    """`metrics` checked and made tensors: a Python number (e.g. the weight 1.0 of
    a per-step value) becomes a tensor of this replica's, which strategy.reduce can
    sum; anything that is not a dict of (total, weight) pairs of numbers, or a key
    in `reserved` (names the caller reports itself), is a StepContractError naming
    the key (raised at trace time: one `error:` line)."""
    if not isinstance(metrics, dict):
        raise StepContractError(f"{source} returned {type(metrics).__name__}, not a dict "
                                f"of name: (total, weight)")
    for key in metrics:
        if key in reserved:
            raise StepContractError(f"{source} returned a metric named {key!r}, which "
                                    f"the step reports itself; give it another name")
    checked = {}
    for key, value in metrics.items():
        try:
            total, weight = value
            total, weight = (tf.convert_to_tensor(v) for v in (total, weight))
        except (TypeError, ValueError) as err:
            raise StepContractError(
                f"{source}'s metric {key!r} is {_describe(value)}, not a (total, weight) "
                f"pair of numbers; return (sum over this replica's examples, their "
                f"count), or step.per_step(value) for a value per step") from err
        if not (total.dtype.is_floating or total.dtype.is_integer) or not (
                weight.dtype.is_floating or weight.dtype.is_integer):
            raise StepContractError(f"{source}'s metric {key!r} has a {total.dtype.name}/"
                                    f"{weight.dtype.name} (total, weight); both must be "
                                    f"numbers")
        if weight.shape.rank != 0:
            raise StepContractError(f"{source}'s metric {key!r} has a weight of shape "
                                    f"{weight.shape}; the weight must be one number")
        as_float = lambda t: t if t.dtype.is_floating else tf.cast(t, tf.float32)  # noqa: E731
        checked[key] = (as_float(total), as_float(weight))
    return checked


def _bookkept(replica_fn: Callable, state=None) -> Callable:
    """`replica_fn` with its metrics checked and made tensors (`summable`), and,
    given the run's state, after it in the replica: batch-norm's statistics averaged
    over the replicas, the step counter advanced and every weight checked finite
    (reading this replica's copies, on its device; no copy made). Returns (metrics,
    (step if a weight is non-finite else 0, 1 if so else 0))."""
    watched = state.model_variables() if state is not None else []
    statistics = state.replica_statistics() if state is not None else []

    def step_fn(batch):
        metrics = summable(replica_fn(batch), reserved=LOOP_KEYS)
        if state is None:
            return metrics, (tf.constant(0.0, tf.float64), tf.constant(0.0, tf.float64))
        context = tf.distribute.get_replica_context()
        with tf.control_dependencies(tf.nest.flatten(metrics)):  # after the step
            if statistics and context.num_replicas_in_sync > 1:
                # Batch-norm moved each replica's copy of its statistics by that
                # replica's examples: average them, so that every replica holds
                # the same state (what the checkpoint saves and a resume restores,
                # what an inference-mode pass in the step reads). Exact for moving
                # averages (they are linear); the weights do not read them. (Through
                # tf.identity: MultiWorkerMirroredStrategy's all-reduce refuses the
                # bare variable reads, "destinations can not be empty".)
                means = context.all_reduce(tf.distribute.ReduceOp.MEAN,
                                           [tf.identity(v) for v in statistics])
                for variable, mean in zip(statistics, means):
                    variable.assign(mean)
            # THE step counter: one more, whatever the task's step did.
            state.step.assign_add(1)
        with tf.control_dependencies(tf.nest.flatten(metrics) + [state.step.read_value()]):
            finite = tf.reduce_all(tf.stack(
                [tf.reduce_all(tf.math.is_finite(v)) for v in watched] or [True]))
            bad = 1.0 - tf.cast(finite, tf.float64)
            return metrics, (bad * tf.cast(state.step.read_value(), tf.float64), bad)
    return step_fn


def _describe(value) -> str:
    if tf.is_tensor(value):
        return "a tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _run_steps(strategy: tf.distribute.Strategy, replica_fns: list[Callable], iterator,
               num_steps: tf.Tensor, time_input: bool = False, state=None,
               choose: Callable | None = None, stop_now: Callable | None = None
               ) -> tuple[Sums, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """`num_steps` steps, or fewer: after each step, `stop_now()` > 0 ends the
    loop there. Returns every (total, weight) summed over replicas and steps, the
    seconds the steps waited for their input (time_input, else 0), the first step
    (its number, counted from 1) that left a weight non-finite (0: none; always 0
    without `state`), the steps run, and the last `stop_now()` (0 without it). Several `replica_fns`: at each
    step the one `choose(state's step counter)` names (trainer/step.py's Steps)."""
    step_fns = [_bookkept(fn, state) for fn in replica_fns]

    def summed(step_fn, batch):
        per_replica = strategy.run(step_fn, args=(batch,))
        # SUM over replicas: each returned totals over its own share of the batch.
        return tf.nest.map_structure(lambda t: strategy.reduce(SUM, t, axis=None),
                                     per_replica)

    def scheduled(batch):
        """The step the schedule names, of several: one switch_case around their
        strategy.run calls, here, outside the replicas (no collective under a cond
        in a replica), so only the chosen step's work is done."""
        # What each step returns, from a trace of its own (thrown away: tf.switch_case
        # needs every branch to return the same structure, known before it traces).
        traced = [tf.function(functools.partial(summed, step_fn)).get_concrete_function(
            batch).structured_outputs for step_fn in step_fns]
        # Every step's metrics: those a step lacks count 0 there (weight 0), and a
        # metric two steps return in two float types is summed in the wider.
        specs: dict[str, tuple[tf.TensorShape, tuple[tf.DType, tf.DType]]] = {}
        for outputs in traced:
            for key, (total, weight) in outputs[0].items():
                shape, dtypes = specs.get(key, (total.shape, (total.dtype, weight.dtype)))
                if shape != total.shape:
                    raise StepContractError(
                        f"metric {key!r} has shape {total.shape} in one scheduled step "
                        f"and {shape} in another; give them other names")
                specs[key] = shape, tuple(tf.float64 if d != t.dtype else d for d, t in
                                          zip(dtypes, (total, weight)))

        def branch(step_fn):
            def run():
                totals, flags = summed(step_fn, batch)
                return {key: tuple(tf.cast(t, d) for t, d in zip(totals[key], dtypes))
                        if key in totals else (tf.zeros(shape, dtypes[0]),
                                               tf.zeros([], dtypes[1]))
                        for key, (shape, dtypes) in specs.items()}, flags
            return run
        return tf.switch_case(choose(state.step.read_value()),
                              [branch(step_fn) for step_fn in step_fns])

    # A function of its own, traced once: its outputs' structure gives the loop's
    # variables their start (zeros), and the loop's body is its one call site.
    @tf.function
    def one_step(previous_done: tf.Tensor):
        if time_input:
            # The input wait: from the previous step's end (its sums exist) to this
            # step's batch being there. A pipeline that keeps up has it prefetched.
            with tf.control_dependencies([previous_done]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
                waited = tf.timestamp() - asked
        else:
            batch, waited = next(iterator), tf.constant(0.0, tf.float64)
        if len(step_fns) == 1:
            totals, (at, bad) = summed(step_fns[0], batch)
        else:
            totals, (at, bad) = scheduled(batch)
        nonfinite_at = tf.math.divide_no_nan(at, bad)  # (the same step on every replica)
        with tf.control_dependencies(tf.nest.flatten(totals)):
            done = tf.identity(previous_done)  # ready once this step's sums are
        return totals, waited, nonfinite_at, done

    # The step is not run once before the loop to learn what it returns (a peeled
    # first step): the graph would hold the step twice, and the first call's graph
    # optimization costs in proportion (twice the seconds on xception). A trace
    # tells the structure; the sums start at zero.
    outputs = one_step.get_concrete_function(
        tf.TensorSpec([], tf.float64)).structured_outputs
    for total in tf.nest.flatten(outputs[0]):
        if not total.shape.is_fully_defined():
            raise StepContractError(
                f"a step returned a metric of shape {total.shape}, which varies from "
                f"batch to batch; a metric's total must have one shape at every step")
    totals = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), outputs[0])
    waited = tf.constant(0.0, tf.float64)
    first_nonfinite = tf.constant(0.0, tf.float64)
    done = tf.constant(0.0, tf.float64)
    steps_done = tf.constant(0)

    def more(totals, waited, first_nonfinite, done, steps_done, stopping):
        return tf.logical_and(steps_done < num_steps, stopping <= 0)

    def body(totals, waited, first_nonfinite, done, steps_done, stopping):
        step_totals, step_waited, nonfinite_at, done = one_step(done)
        totals = tf.nest.map_structure(tf.add, totals, step_totals)
        first_nonfinite = tf.where(first_nonfinite > 0, first_nonfinite, nonfinite_at)
        # A stop request ends the loop at the next step boundary, however many steps
        # the call was given: the save follows at once (trainer/faults.py). Asked
        # here, after the step's sums exist (so in one order with its collectives on
        # every worker), and tested in the loop's condition (a `break` would put the
        # step under a cond: no collective may run there). The first step runs
        # whatever the flag says (a call runs at least one).
        with tf.control_dependencies([done]):
            stopping = (tf.cast(stop_now(), tf.float32) if stop_now is not None
                        else tf.constant(0.0))
        return (totals, waited + step_waited, first_nonfinite, done, steps_done + 1,
                stopping)

    # (a tf.while_loop, not a Python while: the loops below are not converted by
    # AutoGraph, whose conversion of this function cost a second of every start-up;
    # one_step, a tf.function, converts itself and the task's code it calls)
    totals, waited, first_nonfinite, done, steps_done, stopping = tf.while_loop(
        more, body, (totals, waited, first_nonfinite, done, steps_done, tf.constant(0.0)))
    return totals, waited, first_nonfinite, steps_done, stopping


def _maybe_jit(replica_fn: Callable, jit_compile: bool) -> Callable:
    # XLA-compile the replica's step, as Keras' own fit() does. (On a TPU the whole
    # loop is compiled anyway: callers pass False there.)
    return tf.function(replica_fn, jit_compile=True) if jit_compile else replica_fn


def determinism_enabled() -> bool:
    """Whether tf.config.experimental.enable_op_determinism() was called in this
    process (TensorFlow has no public getter; tests/test_private_apis.py checks it)."""
    from tensorflow.python.framework import config as tf_config
    return tf_config.is_op_determinism_enabled()


def make_train_loop(strategy: tf.distribute.Strategy, replica_fn, jit_compile: bool = False,
                    time_input: bool | None = None, state=None) -> Callable:
    """Returns train_loop(iterator, num_steps, stop_flag) -> (sums, stop_requested);
    sums[INPUT_WAIT] is (seconds the steps waited for their input, steps), or (0, 0)
    with time_input=False, the default under op determinism (which refuses
    timestamps; it is process-wide once enabled); sums[STEPS_DONE] is (the steps
    run, 1). state: the run's TrainState, whose step counter advances after every
    step; sums[NONFINITE_AT] is then (the first step whose end left a weight
    non-finite, 0 if none; 1), and sums[STEP_COUNTER] (the counter after the call,
    1): read in the call's own graph, so the loop checks it without an eager read.

    replica_fn: the per-replica step fn(batch) -> {name: (total, weight)}, or a
    schedule of several (trainer/step.py's Steps, bound to a batch: anything with
    `parts` and `index_at(step)`; needs `state`, whose step counter chooses).

    stop_flag: a float, 1.0 once a stop signal reached this worker; a variable
    (trainer/faults.py's StopSignals.flag) is read again before every step, so a
    signal during a long call ends it at the next step boundary. With several
    workers it is summed across them at every step (one scalar all-reduce), so a
    request on any worker stops every worker at the same step (one stopping alone
    would leave the others waiting in a collective); `stop_requested` is the
    flag (that sum) read after the last step.
    """
    if callable(replica_fn):
        replica_fns, choose = [replica_fn], None
    else:
        replica_fns, choose = [fn for _, fn, _ in replica_fn.parts], replica_fn.index_at
        if state is None and len(replica_fns) > 1:
            raise ValueError("a schedule of steps needs the state: its step counter "
                             "chooses the step")
    replica_fns = [_maybe_jit(fn, jit_compile) for fn in replica_fns]
    if time_input is None:
        time_input = not determinism_enabled()
    # One program drives every replica (one worker, or a TPU's single client): its
    # own flag is the answer. Several workers: the sum of theirs.
    several_workers = strategy_lib.is_multi_worker(strategy)

    @tf.function(autograph=False)  # (see _run_steps' while_loop)
    def train_loop(iterator, num_steps: tf.Tensor, stop_flag):
        def summed_flag():
            return strategy.reduce(SUM, strategy.run(lambda: tf.identity(stop_flag)),
                                   axis=None)

        stop_now = summed_flag if several_workers else lambda: tf.identity(stop_flag)
        # (the last answer of the loop's own: another read here, unordered, could
        # run before the loop, and a collective outside it in another order on
        # each worker)
        sums, waited, nonfinite_at, steps_done, stop = _run_steps(
            strategy, replica_fns, iterator, num_steps, time_input, state, choose,
            stop_now)
        timed = tf.cast(steps_done if time_input else 0, tf.float64)
        one = tf.constant(1.0, tf.float64)
        counter = ({STEP_COUNTER: (tf.cast(state.step.read_value(), tf.float64), one)}
                   if state is not None else {})
        return {**sums, INPUT_WAIT: (waited, timed), NONFINITE_AT: (nonfinite_at, one),
                STEPS_DONE: (tf.cast(steps_done, tf.float64), one), **counter}, stop

    return train_loop


def make_eval_loop(strategy: tf.distribute.Strategy, replica_fn: Callable,
                   jit_compile: bool = False) -> Callable:
    """Returns eval_loop(iterator, num_steps) -> sums."""
    replica_fn = _maybe_jit(replica_fn, jit_compile)

    @tf.function(autograph=False)
    def eval_loop(iterator, num_steps: tf.Tensor) -> Sums:
        return _run_steps(strategy, [replica_fn], iterator, num_steps)[0]  # all of them

    return eval_loop


def means(sums: Sums) -> dict[str, float]:
    """total / weight of every scalar metric (0 where nothing was counted)."""
    return {key: float(total) / float(weight) if float(weight) else 0.0
            for key, (total, weight) in sums.items()
            if np.size(total) == 1 and key not in LOOP_KEYS}
