"""Settings are dataclass fields that carry their flag's help text, so every
command makes its flags from them (trainer/main.py): the run's `Config`
(trainer/config.py) and each task's own `Settings` (trainer/tasks/). And the one
error type a command prints as one line with exit status 2."""
import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A bad setting; commands print its one-line message and exit with status 2."""
    # Exception's own constructor: raised while TensorFlow traces a function,
    # autograph then keeps the type (else it becomes a StagingError).
    __init__ = Exception.__init__


def setting(default: Any, help: str) -> Any:  # noqa: A002 (absl's word for it)
    """A field with its flag's help text."""
    return dataclasses.field(default=default, metadata={"help": help})


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
