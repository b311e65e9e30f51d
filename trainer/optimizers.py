"""Optimizers by name, and how the training step applies an update.

The step (trainer/step.py) sums the gradients over replicas itself, where a reader
sees it, so the optimizers made here apply the gradient they are given: Keras'
own cross-replica sum inside `apply` is switched off (`summed`, which wraps any
Keras optimizer class). `--optimizer` takes every optimizer Keras ships, by its
lower-case class name (`names()`), with its own constructor arguments settable
through `--optimizer_options`. A plain Keras optimizer handed to `apply_or_skip`
is refused with one line: on N replicas it would sum the summed gradient again.
`optimizer.iterations` counts the optimizer's own updates, and nothing else: an
update held back (a non-finite gradient, an optimizer whose step did not run at
this step) does not advance it, so Adam's bias correction sees only real updates.
The run's step counter is the state's (trainer/state.py): the learning-rate
schedule, the freezes and Lookahead read that one.
"""
import dataclasses
import fnmatch
import functools
import inspect

import keras
import tensorflow as tf

import models
from trainer import distributed, settings

# Constructor arguments set from the run's own flags, or that would fight the step.
_SET_BY_FLAGS = {"learning_rate": "the schedule (--learning_rate, --lr_schedule)",
                 "weight_decay": "--weight_decay", "use_ema": "--ema_decay",
                 "ema_momentum": "--ema_decay",
                 "gradient_accumulation_steps": "--grad_accum_steps",
                 "loss_scale_factor": "--precision=mixed_float16",
                 "name": "the optimizer's class"}
_NOT_OPTIMIZERS = ("Optimizer", "LossScaleOptimizer", "MultiOptimizer")


class _SummedGradients:
    """Mixin for a Keras optimizer whose gradients arrive already summed over the
    replicas: without it, `apply` inside a replica context would all-reduce them a
    second time (Keras 3 has no switch for this; the sum lives in one private
    method, `_all_reduce_sum_gradients`, which tests/test_optimizers.py watches).
    Also: per-variable learning-rate multipliers (`set_lr_multipliers`) and
    variables frozen from a step on (`set_freeze_steps`)."""

    _lr_multipliers: tuple[float, ...] = ()  # by variable index; () for all 1
    _freeze_steps: tuple[int | None, ...] = ()  # by variable index; () for none
    _decayed_here: tuple[bool, ...] = ()
    _run_step = None  # a _Hidden holding the run's step counter: what freezes read

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return grads_and_vars

    def set_lr_multipliers(self, multipliers: list[float]) -> None:
        """The learning rate of variable i (in build order) times multipliers[i].
        Decoupled weight decay is not multiplied (as in airbench)."""
        self._lr_multipliers = tuple(multipliers)

    def set_step_counter(self, step: tf.Variable) -> None:
        """The run's step counter (trainer/state.py), which the freezes read instead
        of this optimizer's own iteration count (held where attribute tracking
        cannot see it: it is the state's variable, not this optimizer's)."""
        self._run_step = _Hidden(step)

    def set_freeze_steps(self, steps: list[int | None], decayed: list[bool]) -> None:
        """Variable i gets no update at all once the run's step (set_step_counter;
        else optimizer.iterations) reaches steps[i] (None: never): no gradient
        step and no weight decay, as a PyTorch parameter with requires_grad=False
        (airbench freezes its whitening bias after 3 epochs). Its decoupled weight
        decay (decayed[i]) is applied in update_step, where the freeze can skip it:
        `create` excludes such variables from Keras' own decay pass, which runs
        before the update with the same formula."""
        self._freeze_steps, self._decayed_here = tuple(steps), tuple(decayed)

    def update_step(self, gradient, variable, learning_rate):
        if not (self._lr_multipliers or self._freeze_steps):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        scaled = learning_rate
        if self._lr_multipliers and self._lr_multipliers[index] != 1.0:
            scaled = learning_rate * self._lr_multipliers[index]
        freeze = self._freeze_steps[index] if self._freeze_steps else None
        if freeze is None:
            return super().update_step(gradient, variable, scaled)

        def train():
            if self._decayed_here[index]:  # Keras' decay pass, moved here
                variable.assign_sub(variable * tf.cast(self.weight_decay, variable.dtype)
                                    * tf.cast(learning_rate, variable.dtype))
            super(_SummedGradients, self).update_step(gradient, variable, scaled)

        step = self._run_step.value if self._run_step else self.iterations
        tf.cond(step < freeze, train, lambda: None)


class _Hidden:
    """A value held where attribute tracking cannot see it (a plain object)."""

    def __init__(self, value) -> None:
        self.value = value


def keras_optimizers() -> dict[str, type]:
    """Every optimizer class Keras ships, by lower-case class name."""
    return {name.lower(): cls for name, cls in vars(keras.optimizers).items()
            if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
            and name not in _NOT_OPTIMIZERS}


def names() -> tuple[str, ...]:
    return tuple(sorted(keras_optimizers()))


_ = settings.section("optimization")  # (--help's heading, unless a field names another)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """What `create` builds an optimizer with (flags of the same names)."""
    optimizer: str = _("adam", f"Any optimizer Keras ships: {'|'.join(names())} "
                       "(sgd uses Nesterov momentum --momentum).", choices=names(),
                       resume=settings.NEVER)
    optimizer_options: str = _("", "The optimizer's own constructor arguments, "
                               "'name=value,...' (e.g. 'beta_1=0.95,epsilon=1e-7' for "
                               "adam, 'nesterov=false' for sgd).", resume=settings.NEVER)
    momentum: float = _(0.9, "Momentum for sgd (other optimizers: --optimizer_options).")
    weight_decay: float = _(0.0, "Decoupled weight decay (not applied to biases and "
                            "norm layers unless --decay_vectors).", low=0)
    decay_vectors: bool = _(False, "Weight decay on 1-D variables too: biases and "
                            "batch-norm offsets (airbench decays every trained variable).")
    lr_multipliers: str = _("", "Per-variable learning-rate factors, 'PATTERN=FACTOR,...': "
                            "the first glob matching a trainable variable's path wins "
                            "(e.g. '*/beta=64': batch-norm biases x64, as airbench; "
                            "weight decay is not multiplied).")
    freeze_after_epochs: str = _("", "Variables that stop training after some epochs, "
                                 "'PATTERN=EPOCHS,...' (globs on the variable's path, as "
                                 "--lr_multipliers): from then on no gradient step and no "
                                 "weight decay (airbench: 'whiten/*=3').")
    ema_decay: float = _(0.0, "Weight averaging: keep an exponential moving average of "
                         "the weights with this per-step decay (e.g. 0.99), evaluate "
                         "and save it; metrics also show the raw weights' (0: off).",
                         topic="the training step", low=0, high=1, high_open=True,
                         resume=settings.ON_OFF)


@functools.cache
def summed(cls: type) -> type:
    """`cls` (a Keras optimizer class) applying the gradient it is given, without a
    second cross-replica sum. Same name, so variable paths and checkpoints are
    those of `cls`."""
    if issubclass(cls, _SummedGradients):
        return cls
    return type(cls.__name__, (_SummedGradients, cls), {"__module__": __name__})


def option_defaults(name: str) -> dict:
    """The constructor arguments of optimizer `name` that --optimizer_options may
    set, with their defaults."""
    parameters = inspect.signature(keras_optimizers()[name].__init__).parameters
    return {key: p.default for key, p in parameters.items()
            if key not in ("self", "kwargs", *_SET_BY_FLAGS)
            and p.default is not inspect.Parameter.empty}


def parse_options(name: str, text: str) -> dict:
    """'beta_1=0.95,epsilon=1e-7' -> constructor keyword arguments of optimizer
    `name`, typed after the defaults. ValueError naming the flag if bad."""
    for item in text.split(","):
        key = item.partition("=")[0].strip()
        if key in _SET_BY_FLAGS:
            raise ValueError(f"--optimizer_options: {key} is set by "
                             f"{_SET_BY_FLAGS[key]}, not here")
    return models.parse_keyword_options(text, option_defaults(name),
                                        "--optimizer_options", name)


def parse_patterns(text: str, flag: str, what: str = "FACTOR",
                   example: str = "*/beta=64") -> list[tuple[str, float]]:
    """'*/beta=64,whiten/*=0' -> [('*/beta', 64.0), ('whiten/*', 0.0)]; ValueError
    naming `flag` if malformed or a value is negative."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, _, value = item.rpartition("=")
        try:
            pairs.append((pattern, float(value)))
        except ValueError:
            pattern = ""
        if not pattern or pairs[-1][1] < 0:
            raise ValueError(f"{flag}: {item!r} is not PATTERN={what} with a "
                             f"{what.lower()} >= 0 (e.g. '{example}')")
    return pairs


def parse_lr_multipliers(text: str) -> list[tuple[str, float]]:
    return parse_patterns(text, "--lr_multipliers")


def per_variable(variables: list, pairs: list[tuple[str, float]], default,
                 flag: str = "--lr_multipliers") -> list:
    """Each variable's value: that of the first glob pattern matching its path
    (e.g. 'batch_normalization_3/beta'), else `default`. A pattern matching nothing
    is a ValueError naming `flag` (a typo would silently change nothing)."""
    values, used = [], set()
    for variable in variables:
        value = default
        for pattern, given in pairs:
            if fnmatch.fnmatchcase(variable.path, pattern):
                value = given
                used.add(pattern)
                break
        values.append(value)
    unused = [pattern for pattern, _ in pairs if pattern not in used]
    if unused:
        raise ValueError(f"{flag}: {', '.join(unused)} match(es) no trainable "
                         f"variable; paths look like {variables[0].path!r}")
    return values


def lr_multipliers(variables: list, pairs: list[tuple[str, float]]) -> list[float]:
    return per_variable(variables, pairs, 1.0)


def create(settings: OptimizerSettings | str, learning_rate, variables,
           precision: str = "float32", steps_per_epoch: int = 1,
           step_counter: tf.Variable | None = None, **fields) -> keras.optimizers.Optimizer:
    """Builds and *builds* the optimizer of `settings` (an OptimizerSettings, or an
    optimizer's name and `fields` of OptimizerSettings: a test's shorthand; slot
    variables exist before the first step), wrapped by `summed`.

    Call inside `strategy.scope()`: Keras 3 optimizers must create their slots there,
    or the first distributed update fails (keras-team/keras#23085).
    sgd uses Nesterov momentum `momentum` (override: optimizer_options
    'nesterov=false'); other optimizers take their momentum-like arguments from
    optimizer_options ('beta_1=0.95', ...). Weight decay is decoupled (AdamW style)
    and skips 1-D variables (biases and batch-norm scales/offsets) unless
    decay_vectors (airbench decays them too). ema_decay > 0 keeps a moving average
    of the weights (see trainer/averaging.py). freeze_after_epochs
    ('PATTERN=EPOCHS,...'): matching variables get no update from that epoch on
    (epochs of `steps_per_epoch` steps of `step_counter`, the run's step; default:
    the optimizer's iteration count).
    """
    if isinstance(settings, str):
        settings = OptimizerSettings(optimizer=settings, **fields)
    name, weight_decay = settings.optimizer, settings.weight_decay
    classes = keras_optimizers()
    if name not in classes:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(names())}")
    arguments = dict(use_ema=settings.ema_decay > 0, ema_momentum=settings.ema_decay)
    if name == "adamw":  # its own default decay (0.004) would apply at --weight_decay=0
        arguments["weight_decay"] = weight_decay
    elif "weight_decay" in inspect.signature(classes[name].__init__).parameters:
        arguments["weight_decay"] = weight_decay or None
    if name == "sgd":
        arguments.update(momentum=settings.momentum, nesterov=True)
    arguments.update(parse_options(name, settings.optimizer_options))
    optimizer = summed(classes[name])(learning_rate, **arguments)
    if settings.lr_multipliers:
        optimizer.set_lr_multipliers(
            lr_multipliers(variables, parse_lr_multipliers(settings.lr_multipliers)))
    undecayed = ([v for v in variables if len(v.shape) <= 1]
                 if weight_decay and not settings.decay_vectors else [])
    if settings.freeze_after_epochs:
        epochs = per_variable(variables, parse_patterns(
            settings.freeze_after_epochs, "--freeze_after_epochs", "EPOCHS", "whiten/*=3"),
            None, "--freeze_after_epochs")
        steps = [None if e is None else round(e * steps_per_epoch) for e in epochs]
        decayed = [bool(optimizer.weight_decay) and s is not None
                   and not any(v is u for u in undecayed) for v, s in zip(variables, steps)]
        optimizer.set_freeze_steps(steps, decayed)
        # Keras' exclusion list is one set, replaced by each call: give it everything.
        undecayed += [v for v, s in zip(variables, steps) if s is not None]
    if undecayed:
        optimizer.exclude_from_weight_decay(var_list=undecayed)
    if step_counter is not None:  # (what the freezes and Lookahead read)
        optimizer.set_step_counter(step_counter)
    if precision == "mixed_float16":
        # float16 gradients underflow: the loss is scaled up, the summed gradients
        # unscaled (`unscale`), and the scale adapts (`apply_or_skip`).
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(variables)
    return optimizer


# do_not_convert: no Python branch on a tensor, no task code below (start-up time;
# docs/changing-the-step.md).
@tf.autograph.experimental.do_not_convert
def loss_scaled(optimizer: keras.optimizers.Optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


@tf.autograph.experimental.do_not_convert
def unscale(optimizer: keras.optimizers.Optimizer, gradients: list) -> list:
    """Gradients of the scaled loss -> gradients of the loss (mixed_float16)."""
    if not loss_scaled(optimizer):
        return gradients
    return [g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in gradients]


def float_state(optimizer: keras.optimizers.Optimizer) -> list:
    """The optimizer's float variables an update changes (moments, an EMA of the
    weights), not its step counter or a loss scale."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return [v for v in inner.variables if tf.as_dtype(v.dtype).is_floating]


@tf.autograph.experimental.do_not_convert
def apply_or_skip(optimizer: keras.optimizers.Optimizer, gradients: list, variables,
                  apply: tf.Tensor) -> None:
    """In a replica context: applies `gradients` (summed over replicas, unscaled) if
    `apply` (a bool that is the same on every replica), else leaves the weights and
    optimizer state alone. optimizer.iterations counts the updates applied only
    (Adam's bias correction is that of the real updates). Under
    loss scaling the scale doubles after `dynamic_growth_steps` good steps and
    halves at a skipped one, as Keras' LossScaleOptimizer does.
    """
    apply = tf.convert_to_tensor(apply, tf.bool)  # (a Python bool too)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(inner, _SummedGradients):
        raise distributed.StepContractError(
            f"{type(inner).__name__} is a plain Keras optimizer: its apply() would sum "
            f"the already-summed gradients over the replicas a second time; make it "
            f"with trainer.optimizers.create({type(inner).__name__.lower()!r}, ...) or "
            f"trainer.optimizers.summed(keras.optimizers.{type(inner).__name__})(...)")

    def update_loss_scale(apply):
        if inner is optimizer:
            return
        scale, counter = optimizer.dynamic_scale, optimizer.step_counter
        grow = tf.logical_and(apply, counter + 1 >= optimizer.dynamic_growth_steps)
        scale.assign(tf.where(apply, tf.where(grow, scale * 2.0, scale), scale / 2.0))
        counter.assign(tf.where(tf.logical_and(apply, tf.logical_not(grow)),
                                counter + 1, tf.zeros_like(counter)))

    def skip():  # (the weights, the slots and optimizer.iterations stay)
        return None

    def update(grads=gradients):
        inner.apply(grads, variables)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        # e.g. XLA on GPUs: no merge_call, a plain cond in the replica context.
        tf.cond(apply, update, skip)
        update_loss_scale(apply)
        return

    # A cond whose branch updates mirrored variables must run in the cross-replica
    # context (a merge_call), each branch going back to the replicas to apply.
    def cross_replica(strategy, apply, gradients):
        apply = strategy.experimental_local_results(apply)[0]
        tf.cond(apply,
                lambda: strategy.extended.call_for_each_replica(update, args=(gradients,)),
                skip)
        update_loss_scale(apply)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(apply, gradients))
