"""The one frozen config object a run is described by.

`trainer/main.py` builds it from absl flags; everything below it takes plain values
read from this object (or plain arguments), never flags.
"""
import dataclasses
from typing import Any

from data import augment as augment_lib
from trainer import optimizers, schedules

STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")
PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
JIT_CHOICES = ("auto", "true", "false")
ON_NAN = ("stop", "skip_step")
OPTIMIZERS = optimizers.NAMES
SCHEDULES = schedules.KINDS


class ConfigError(ValueError):
    """A bad setting; main prints its one-line message and exits with status 2."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run. Defaults are the seed's CIFAR-10 recipe."""
    model: str = "cifar_cnn"
    model_size: str = "full"            # "tiny" builds the small test variant
    dataset: str = "cifar10"
    image_size: int = 0                 # 0: the dataset's own size
    weights: str = "none"               # none | imagenet (xception) | PATH
    data_dir: str | None = None         # None: TFDS_DATA_DIR or the TFDS default
    download_data: bool = False
    model_dir: str = ""                 # "": runs/<model>_<dataset>
    batch_size: int = 1024              # global, summed over all replicas
    epochs: int = 50
    train_steps: int = 0                # > 0 overrides epochs
    optimizer: str = "adam"
    learning_rate: float = 1e-3         # peak
    momentum: float = 0.9               # sgd (Nesterov)
    lr_schedule: str = "constant"
    warmup_epochs: float = 0.0
    lr_decay_rate: float = 0.8          # per epoch, for exponential and rampup
    sustain_epochs: float = 0.0         # rampup: epochs at the peak after warmup
    min_learning_rate: float = 0.0      # warmup start, and the floor of decays
    weight_decay: float = 0.0           # decoupled; not applied to biases and norms
    tpu: str | None = None
    require_tpu: bool = False
    strategy: str = "auto"
    cpu_replicas: int = 1
    jit_compile: str = "auto"
    precision: str = "auto"
    steps_per_loop: int = 10
    log_every: int = 50
    eval_every: int = 0                 # steps; 0 = at the end of every epoch
    checkpoint_every: int = 0           # steps; 0 = at the end of every epoch
    keep_checkpoints: int = 3
    shuffle_buffer: int = 10_000
    augment: str = ""                   # "": the dataset's default augmentation
    deterministic: bool = False         # op determinism: bitwise reproducible on CPU
    on_nan: str = "stop"                # stop | skip_step (a non-finite loss)
    label_smoothing: float = 0.0
    tta_flip: bool = False              # evaluate on each image and its mirror image
    ema_decay: float = 0.0              # per-step weight averaging (0: off), see averaging.py
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(
            f"unknown {name} {value!r}; valid: {', '.join(sorted(valid))}")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"--{name} must be {bound}, got {value}")


def validate(config: Config, model_names, dataset_names) -> Config:
    """Cheap checks done before any heavy work. Raises ConfigError."""
    _check_choice("model", config.model, model_names)
    _check_choice("model_size", config.model_size, ("full", "tiny"))
    if not config.dataset.startswith("tfrecord:"):
        _check_choice("dataset", config.dataset, dataset_names)
    _check_choice("optimizer", config.optimizer, OPTIMIZERS)
    _check_choice("lr_schedule", config.lr_schedule, SCHEDULES)
    _check_choice("precision", config.precision, PRECISIONS)
    _check_choice("strategy", config.strategy, STRATEGIES)
    _check_choice("jit_compile", config.jit_compile, JIT_CHOICES)
    _check_choice("on_nan", config.on_nan, ON_NAN)
    if config.augment:
        _check_choice("augment", config.augment, augment_lib.TRAIN_AUGMENTATIONS)
    for name in ("batch_size", "learning_rate", "steps_per_loop", "cpu_replicas",
                 "keep_checkpoints"):
        _check_positive(name, getattr(config, name))
    for name in ("epochs", "train_steps", "warmup_epochs", "weight_decay",
                 "sustain_epochs", "min_learning_rate", "log_every", "eval_every",
                 "checkpoint_every", "shuffle_buffer", "image_size"):
        _check_positive(name, getattr(config, name), allow_zero=True)
    if config.epochs == 0 and config.train_steps == 0:
        raise ConfigError("nothing to train: set --epochs or --train_steps above 0")
    if not 0 <= config.label_smoothing < 1:
        raise ConfigError(f"--label_smoothing must be in [0, 1), got "
                          f"{config.label_smoothing}")
    if not 0 <= config.ema_decay < 1:
        raise ConfigError(f"--ema_decay must be in [0, 1) (0: no averaging), got "
                          f"{config.ema_decay}")
    if not 0 < config.lr_decay_rate <= 1:
        raise ConfigError(f"--lr_decay_rate must be in (0, 1], got {config.lr_decay_rate}")
    if config.batch_size % config.cpu_replicas:
        raise ConfigError(
            f"--batch_size={config.batch_size} does not divide by "
            f"--cpu_replicas={config.cpu_replicas}; use a multiple of it")
    if config.require_tpu and config.strategy not in ("auto", "tpu"):
        raise ConfigError(f"--require_tpu conflicts with --strategy={config.strategy}")
    return config
