"""Everything a run trains or updates, in one object: the TrainState.

A task makes it (`Task.create_state`, trainer/tasks/base.py) under the one build
path (trainer/build.py); the default is one model, "main", and its optimizer. A
GAN holds a generator and a discriminator with an optimizer each; a mean teacher
holds the student and its moving-average copy; a contrastive method may add a
queue of negatives as an extra variable. Whatever is in here is

- saved and restored by the checkpoint, all of it (`trackables`): a resume never
  builds part of it afresh, and a variable the checkpoint lacks is one error line;
- compared by trainer.check_step, all of it (`compared_variables`), on 1 and 2
  replicas, and replica copy against replica copy;
- checked for non-finite values after every step (`finite`) and before anything
  is written, so no checkpoint or weights file ever holds a NaN.

`step` is the run's ONE step counter: the learning-rate schedules, the data
position (a resumed run continues the stream there), the step's random draws
(trainer/randomness.py), `ckpt-N` and the logs all read it. The distribution
wrapper (trainer/distributed.py) advances it by one after every step, whatever the
step did, so a task's own step cannot forget to count.
"""
import dataclasses

import keras
import tensorflow as tf

MAIN = "main"  # the model every task has: built from --model


@dataclasses.dataclass
class TrainState:
    """What a run trains and updates; see the module docstring."""
    models: dict[str, keras.Model]
    optimizers: dict[str, keras.optimizers.Optimizer]
    step: tf.Variable                 # int64, THE step counter
    seed: int                         # --seed; with `step`, the step's random draws
    extras: dict[str, tf.Variable] = dataclasses.field(default_factory=dict)

    # --- what the checkpoint saves ------------------------------------------------

    def trackables(self) -> dict:
        """The checkpoint's objects by name. The one-model run keeps the names it
        always had ("model", "optimizer", "rng")."""
        items: dict = {"step": self.step}
        for name, model in self.models.items():
            suffix = "" if name == MAIN else f"_{name}"
            items[f"model{suffix}"] = model
            items[f"rng{suffix}"] = random_state(model)
        for name, optimizer in self.optimizers.items():
            items["optimizer" if name == MAIN else f"optimizer_{name}"] = optimizer
        for name, variable in self.extras.items():
            items[f"extra_{name}"] = variable
        return items

    # --- what check_step compares and the write guard checks ------------------------

    def compared_variables(self) -> list[tuple[str, tf.Variable]]:
        """(name, variable) of everything the state holds, in a fixed order: every
        model's weights (trainable and not: batch-norm statistics), every
        optimizer's variables (its slots, an EMA of the weights, Lookahead's slow
        weights, its iteration count), the step, the extras."""
        named = []
        for name, model in self.models.items():
            named += [(f"{name}/{v.path}", v) for v in model.weights]
        for name, optimizer in self.optimizers.items():
            named += [(f"{name}_optimizer/{v.path}", v) for v in optimizer.variables]
        named.append(("step", self.step))
        named += [(f"extras/{name}", v) for name, v in self.extras.items()]
        return named

    def float_variables(self) -> list[tuple[str, tf.Variable]]:
        return [(name, v) for name, v in self.compared_variables()
                if tf.as_dtype(v.dtype).is_floating]

    def model_variables(self) -> list:
        """The float variables a step writes to that the next forward pass reads:
        every model's weights and statistics, and the float extras."""
        return [v for v in [*(w for model in self.models.values() for w in model.weights),
                            *self.extras.values()] if tf.as_dtype(v.dtype).is_floating]

    def random_variables(self) -> list:
        """Every model's random generators' state (dropout's seeds): saved by the
        checkpoint, restored by check_step with the rest, never compared."""
        return [v for model in self.models.values() for v in random_state(model)]

    def replica_statistics(self) -> list:
        """The moving statistics of every model the step may change (not a frozen
        one): each replica's forward pass updates its own copy from its own
        examples, so the wrapper averages them over the replicas after every step
        (trainer/distributed.py)."""
        return [v for model in self.models.values() if model.trainable
                for v in moving_statistics(model)]

    def nonfinite(self) -> list[str]:
        """The names of the variables holding a NaN or an infinity (eager): the one
        scan behind the loop's divergence line and the checkpoint's guard."""
        return nonfinite_names(self.compared_variables())

    # --- convenience -----------------------------------------------------------------

    @property
    def model(self) -> keras.Model:
        """The main model."""
        return self.models[MAIN]

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The main model's optimizer."""
        return self.optimizers[MAIN]


def nonfinite_names(named_variables: list) -> list[str]:
    """The names of the float variables of (name, variable) pairs that hold a NaN
    or an infinity (eager)."""
    return [name for name, v in named_variables if tf.as_dtype(v.dtype).is_floating
            and not bool(tf.reduce_all(tf.math.is_finite(v)))]


def random_state(model: keras.Model) -> list:
    """The variables of `model`'s random generators (Keras 3 keeps dropout's seed
    state in variables that a checkpoint of the model alone does not save)."""
    return [v.value for v in model.variables if "seed_generator_state" in v.path]


# do_not_convert: no Python branch on a tensor, no task code below (start-up time;
# docs/changing-the-step.md).
@tf.autograph.experimental.do_not_convert
def moving_statistics(model: keras.Model) -> list:
    """The non-trainable float state a forward pass updates (batch-norm's moving
    mean and variance); not the random generators' state."""
    return [v for v in model.non_trainable_variables
            if v.dtype.startswith("float") and "seed_generator" not in v.path]


def new_step_counter() -> tf.Variable:
    """The step counter (call under the strategy's scope): int64, 0. Advanced in a
    replica context, it takes the first replica's update on every replica (as
    Keras' own optimizer.iterations does)."""
    return tf.Variable(0, dtype=tf.int64, trainable=False, name="step",
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def single(model: keras.Model, optimizer: keras.optimizers.Optimizer,
           seed: int = 0) -> TrainState:
    """The one-model state of `model` and `optimizer` (built under the current
    strategy's scope), for steps driven by hand (tests, notebooks)."""
    return TrainState({MAIN: model}, {MAIN: optimizer}, new_step_counter(), seed)
