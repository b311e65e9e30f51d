"""Settings are dataclass fields that carry everything about their flag, so every
command makes its flags from them (trainer/run_flags.py): its help text, --help
topic, range or choices, and whether a resumed run may change it. They are
declared in groups beside the code that reads them (`StepSettings` in
trainer/step.py, `OptimizerSettings` in trainer/optimizers.py, ...); the run's
`Config` (trainer/config.py) assembles the groups, and each task's own `Settings`
(trainer/tasks/) are made the same way. And the one error type a command prints as
one line with exit status 2."""
import dataclasses
import functools
import math
from typing import Any, Callable, TypeVar

Group = TypeVar("Group")


class ConfigError(ValueError):
    """A bad setting; commands print its one-line message and exit with status 2."""
    # Exception's own constructor: raised while TensorFlow traces a function,
    # autograph then keeps the type (else it becomes a StagingError).
    __init__ = Exception.__init__


def setting(default: Any, help: str, *,  # noqa: A002 (absl's word for it)
            topic: str = "", low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False,
            choices: tuple[str, ...] = (), resume: bool | str = False) -> Any:
    """A field with its flag's help text, its --help `topic`, the range its value
    must lie in (`low` <= value <= `high`, strict where open) or the `choices` it
    must be one of, and what a resumed run may do with it (trainer/checkpoints.py):
    `resume` True: change it (how long, how often, where and on which devices it
    runs); False: change it only with --resume_with_changes (it changes what is
    trained); NEVER: never (the checkpoint's variables depend on it); ON_OFF: never
    switch it on or off (whether its variables exist)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "topic": topic, "range": (low, high, low_open, high_open),
        "choices": tuple(choices), "resume": resume})


NEVER, ON_OFF = "never", "on_off"  # (`resume` values: see setting)


def section(topic: str) -> Callable[..., Any]:
    """`setting` with --help topic `topic`: `_ = section("the training step")`
    above a group, then `name: float = _(0.0, "help", low=0)` per field."""
    return functools.partial(setting, topic=topic)


def check(values: Any) -> None:
    """ConfigError for the first field of a settings object that is out of its
    declared range, not one of its choices, or not a finite number."""
    for field in dataclasses.fields(values):
        value = getattr(values, field.name)
        problem = non_finite(field.name, value)  # (nan < 0 is False: no range sees it)
        if problem:
            raise ConfigError(problem)
        choices = field.metadata.get("choices")
        if choices and value not in choices and not (value == "" and field.default == ""):
            raise ConfigError(f"unknown {field.name} {value!r}; valid: "
                              f"{', '.join(sorted(choices))}")
        low, high, low_open, high_open = field.metadata.get("range", (None,) * 4)
        if low is not None or high is not None:
            check_range(field.name, value, low, high, low_open, high_open)


def group_of(values: Any, kind: type[Group]) -> Group:
    """The `kind` settings group of an object that has its fields (the run's
    Config): what a reader of that group takes."""
    return kind(**{field.name: getattr(values, field.name)
                   for field in dataclasses.fields(kind)})


def check_range(name: str, value: float, low: float | None = None,
                high: float | None = None, low_open: bool = False,
                high_open: bool = False) -> None:
    """ConfigError unless low <= value <= high (< where open); NaN and inf fail."""
    bad = value != value or value in (float("inf"), float("-inf"))
    if low is not None:
        bad = bad or value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        left = "" if low is None else f"{'(' if low_open else '['}{low:g}, "
        right = "" if high is None else f"{high:g}{')' if high_open else ']'}"
        where = (f"in {left}{right}" if low is not None and high is not None
                 else f"{'>' if low_open else '>='} {low:g}" if low is not None
                 else f"{'<' if high_open else '<='} {high:g}")
        raise ConfigError(f"--{name} must be {where}, got {value}")


def message_of(error: BaseException) -> str:
    """An error's own message: raised while TensorFlow traced a function, it is
    the message under autograph's 'in user code:' frames (what a command prints as
    its one `error:` line)."""
    metadata = getattr(error, "ag_error_metadata", None)
    if metadata is None:
        return str(error).strip()
    message = metadata.cause_message.strip()  # "TypeError: the message"
    prefix = f"{type(error).__name__}: "
    return message[len(prefix):] if message.startswith(prefix) else message


FLOAT32_MAX = 3.4028234663852886e38  # TensorFlow computes every setting in float32


def non_finite(name: str, value) -> str | None:
    """The problem with a float setting that is nan, inf, or beyond float32 (where
    it would be inf); None for any other value."""
    if isinstance(value, float) and not (math.isfinite(value)
                                         and abs(value) <= FLOAT32_MAX):
        return (f"--{name}={value}: give a finite number"
                + ("" if not math.isfinite(value) else " (at most 3.4e38: float32)"))
    return None
