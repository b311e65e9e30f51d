"""The one frozen config object a run is described by.

Every field carries its flag's help text: trainer/main.py declares one absl flag
per field from it, so a new setting is one field here (and its use where it
matters, e.g. `trainer/step.py`). The run's task has settings of its own, declared
in its file (trainer/tasks/), made into flags the same way and kept in
`Config.task_settings`. Commands parse the flags in their own `main` and call
`resolve`; library code below takes this object or plain values.
"""
import dataclasses
import os
import re
from typing import Any


from data import augment as augment_lib, files
import models
from trainer import callbacks as callbacks_lib, optimizers, recipes, schedules, tasks
from trainer.settings import ConfigError, non_finite, setting as _  # noqa: F401 (re-exported)

STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")
PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
JIT_CHOICES = ("auto", "true", "false")
ON_NAN = ("stop", "skip_step")
CACHE_CHOICES = ("auto", "memory", "none")


def _choices(names) -> str:
    return "|".join(names)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run. Defaults are the seed's CIFAR-10 recipe; each
    model's recipe (trainer/recipes.py) overrides them, flags override both."""
    # --- what to train, on what ---
    # ({tasks}, {models}, {datasets}: the registries' names, filled in when the flags
    # are made, trainer/run_flags.py: a user's own included, none imported here.)
    task: str = _("classification", "What the run optimizes and measures: {tasks} "
                  "(trainer/tasks/; each has its own settings and recipe).")
    model: str = _("cifar_cnn", "Model: {models}.")
    model_size: str = _("full", "full|tiny (tiny: the small test variant).")
    model_options: str = _("", "The model builder's own options, 'name=value,...' (e.g. "
                           "'widths=32:64:128,whiten=false' for airbench; tuples as "
                           "a:b:c).")
    dataset: str = _("cifar10", "Dataset: {datasets}, any TFDS "
                     "image-classification dataset as NAME[:VERSION] (e.g. cifar100, "
                     "imagenet2012, food101: classes, sizes and splits from its info), or "
                     "'tfrecord:PATTERN[;eval=EVAL_PATTERN][;classes=N]' (TFRecords in "
                     "the flowers codelab's format, local or gs://; without eval= a "
                     "fixed part is held out).")
    train_split: str = _("", "TFDS split to train on (default: train; slices work, e.g. "
                         "'train[:90%]').")
    eval_split: str = _("", "TFDS split to evaluate on (default: validation, else test, "
                        "else a fixed 15% held out of the training split).")
    cache: str = _("auto", "auto|memory|none: memory decodes the training data into an "
                   "in-memory cache before the first step; none streams it from its "
                   "files, decoding on the fly (any size, bounded memory, exact "
                   "resume); auto streams when the decoded data would pass a quarter of "
                   "this machine's memory or the augmentation crops while decoding "
                   "(ImageNet's), else caches.")
    image_size: int = _(0, "Train and evaluate at this square size (0: the dataset's own).")
    weights: str = _("none", "Initial weights: none | imagenet (xception, downloads) | "
                     "PATH (a .weights.h5 of the same model, or for xception Keras' "
                     "notop backbone file).")
    data_dir: str | None = _(None, "TFDS data dir; default: $TFDS_DATA_DIR, else the "
                             "TFDS default.")
    download_data: bool = _(False, "Let TFDS download and prepare a missing dataset "
                            "(needs network).")
    model_dir: str = _("", "Checkpoints, run_config.json, model.weights.h5, metrics.json "
                       "(default: runs/<model>_<dataset>). A run on a directory with a "
                       "checkpoint resumes from it.")
    # --- your own code ---
    imports: str = _("", "Modules of your own to import first, 'MODULE[,MODULE]' (given "
                     "as --import): they register models, tasks and callbacks "
                     "(models.register_keras, @tasks.register, "
                     "@trainer.callbacks.register). Recorded in the run: evaluate, "
                     "predict and export on it import them themselves.")
    callbacks: str = _("", "Registered callbacks to run, 'NAME[,NAME]' (yours, with "
                       "--import; trainer/callbacks.py). log.csv and early stopping "
                       "are always there.")
    # --- optimization ---
    batch_size: int = _(1024, "GLOBAL batch size, split evenly across all replicas.")
    eval_batch_size: int = _(0, "GLOBAL batch size of evaluation (0: --batch_size). "
                             "Evaluation is exact at any size (the last batch is "
                             "padded and masked).")
    epochs: int = _(50, "Epochs to train (see --train_steps).")
    train_steps: int = _(0, "If > 0: steps to train, overriding --epochs.")
    optimizer: str = _("adam", f"Any optimizer Keras ships: {_choices(optimizers.names())} "
                       "(sgd uses Nesterov momentum --momentum).")
    optimizer_options: str = _("", "The optimizer's own constructor arguments, "
                               "'name=value,...' (e.g. 'beta_1=0.95,epsilon=1e-7' for "
                               "adam, 'nesterov=false' for sgd).")
    learning_rate: float = _(1e-3, "Peak learning rate.")
    momentum: float = _(0.9, "Momentum for sgd (other optimizers: --optimizer_options).")
    lr_schedule: str = _("constant", f"{_choices(schedules.KINDS)}, each after a linear "
                         "warmup (rampup: the flowers codelab's ramp-up/sustain/decay).")
    warmup_epochs: float = _(0.0, "Linear warmup from --min_learning_rate to the peak.")
    lr_decay_rate: float = _(0.8, "Per-epoch factor of the exponential and rampup "
                             "schedules.")
    sustain_epochs: float = _(0.0, "rampup: epochs to hold the peak after warmup.")
    min_learning_rate: float = _(0.0, "Warmup start and floor of the decaying schedules.")
    warmup_start_factor: float = _(0.0, "If > 0, the warmup starts at this x the peak "
                                   "instead of --min_learning_rate (airbench: 0.2).")
    weight_decay: float = _(0.0, "Decoupled weight decay (not applied to biases and "
                            "norm layers unless --decay_vectors).")
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
    # --- the training step (read in trainer/step.py) ---
    clip_grad_norm: float = _(0.0, "Clip the global norm of the gradient summed over "
                              "all replicas to this value (0: off).")
    grad_accum_steps: int = _(1, "Split each replica's batch into this many "
                              "micro-batches and add their gradients: one update per "
                              "step, less memory (the per-replica batch must divide).")
    sam_rho: float = _(0.0, "Sharpness-aware minimization: take the gradient again at "
                       "the weights moved this far uphill along the summed gradient, "
                       "and apply that one (two passes a step; 0: off).")
    mixup_alpha: float = _(0.0, "Mixup: blend pairs of training images and their "
                           "targets with a Beta(alpha, alpha) weight (0: off).")
    cutmix_alpha: float = _(0.0, "CutMix: paste a box of another training image, "
                            "targets mixed by area, Beta(alpha, alpha) (0: off). With "
                            "mixup too, each batch uses one of the two at random.")
    lookahead_every: int = _(0, "Lookahead (airbench): every N steps move slow weights "
                             "towards the weights by (1 - decay) and set the weights to "
                             "them; decay = lookahead_decay^N * (step/total)^3; at the "
                             "end the weights are the slow ones (0: off).")
    lookahead_decay: float = _(0.95, "Lookahead's per-step decay (see --lookahead_every).")
    ema_decay: float = _(0.0, "Weight averaging: keep an exponential moving average of "
                         "the weights with this per-step decay (e.g. 0.99), evaluate "
                         "and save it; metrics also show the raw weights' (0: "
                         "off).")
    # --- devices ---
    tpu: str | None = _(None, "TPU name, grpc:// address, or 'local' (TPU VM). If none "
                        "is found the run falls back to GPU/CPU with a warning.")
    require_tpu: bool = _(False, "Fail instead of falling back when no TPU is found.")
    strategy: str = _("auto", f"{_choices(STRATEGIES)}; auto: a TPU if reachable, else "
                      "all GPUs (Mirrored), else the CPU.")
    cpu_replicas: int = _(1, "Split the host CPU into N logical devices and run N "
                          "replicas with MirroredStrategy (debug distribution on a "
                          "laptop).")
    jit_compile: str = _("auto", "auto|true|false: XLA-compile the step. auto: on TPU "
                         "and GPU, not on the CPU (measured 1.6-7x slower there).")
    precision: str = _("auto", f"{_choices(PRECISIONS)}. auto: bf16 on TPU, bf16/fp16 on "
                       "GPU by generation, bf16 on CPUs with native bf16, else float32.")
    # --- the loop ---
    steps_per_loop: int = _(10, "Steps per tf.function call (an in-graph loop).")
    log_every: int = _(50, "Steps between log lines (0: per epoch).")
    eval_every: int = _(0, "Steps between evaluations (0: at the end of every epoch).")
    checkpoint_every: int = _(0, "Steps between checkpoints (0: every epoch's end).")
    keep_checkpoints: int = _(3, "Checkpoints kept.")
    shuffle_buffer: int = _(10_000, "Training shuffle: blocks of this many examples, "
                            "visited in a random order, each permuted; the order depends "
                            "only on --seed and the epoch (0: no shuffle).")
    alternating_flip: bool = _(False, "Flip each training image on alternate epochs "
                               "(its first-epoch flip at random), instead of at random "
                               "every epoch (airbench). Needs an augmentation that does "
                               "not flip by itself, e.g. --augment=translate.")
    augment: str = _("", f"Training augmentation: "
                     f"{_choices(augment_lib.TRAIN_AUGMENTATIONS)} (default: the "
                     "dataset's own: pad_crop_flip for CIFAR, flip_saturation for "
                     "flowers).")
    deterministic: bool = _(False, "Deterministic ops: the same command gives bitwise "
                            "the same weights on the same machine, also across a kill "
                            "and resume (slower on GPU).")
    on_nan: str = _("stop", "A step whose loss or summed gradient is not finite never "
                    "updates the weights; then stop (an error naming the steps; "
                    "checkpoints kept) or skip_step (count it and go on).")
    seed: int = _(0, "Seed for weights, shuffling and augmentation.")
    resume_with_changes: bool = _(False, "Continue the run in --model_dir although "
                                  "settings that change what is trained differ from "
                                  "its own (each change is recorded in its "
                                  "run_history.json; without this, one error line "
                                  "lists them).")
    early_stop_patience: int = _(0, "Stop when the task's best metric (e.g. test "
                                 "accuracy) has not improved for this many evaluations "
                                 "in a row; the run is then finished (0: off).")
    early_stop_min_delta: float = _(0.0, "What counts as an improvement for "
                                    "--early_stop_patience: a change beyond this.")
    # --- measuring ---
    histograms: bool = _(False, "Write histograms of every trained weight and of its "
                         "gradient (on one training batch) to TensorBoard at every "
                         "evaluation.")
    measure_peak: bool = _(False, "Measure this device's matmul FLOP/s at start-up (a "
                           "few seconds) and show the step's FLOP/s as a fraction of it.")
    profile_steps: str = _("", "'A,B': write a TensorFlow profiler trace of steps A to B "
                           "to the run's TensorBoard directory (model_dir/train, the "
                           "Profile tab); summarise it with python -m "
                           "trainer.tools.profile_summary.")

    # --- the task's own settings (not a flag: its fields are, see trainer/tasks/) ---
    task_settings: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """Every setting, flat, in field order: the Config fields and the task's own
        settings given (task_settings) in its place."""
        values = {**self.as_dict(), **self.task_settings}
        values.pop("task_settings")
        return values

    def with_settings(self, **settings: Any) -> "Config":
        """The same run with some of its task's settings changed."""
        return self.replace(task_settings={**self.task_settings, **settings})

    def task_options(self) -> Any:
        """The task's Settings (its defaults, overridden by task_settings)."""
        return tasks.make_settings(self.task, self.task_settings)


# What a start may change in a run directory (trainer/checkpoints.py): how long it
# trains, how often it logs, evaluates and saves, where its files are and on which
# devices it runs (the replicas change the rounding, not the arithmetic: check_step).
MAY_CHANGE_ON_RESUME = (
    "model_dir", "data_dir", "download_data", "epochs", "train_steps", "log_every",
    "eval_every", "checkpoint_every", "keep_checkpoints", "steps_per_loop",
    "eval_batch_size", "cache", "tpu", "require_tpu", "strategy", "cpu_replicas",
    "jit_compile", "measure_peak", "profile_steps", "resume_with_changes", "imports",
    "callbacks", "early_stop_patience", "early_stop_min_delta", "histograms")

FLAG_FIELDS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "task_settings")

# Each flag's topic, the headings of --help in their order (trainer/cli.py); each
# task's own settings show under their task, after "task". A new field needs a
# topic here (tests/test_main.py checks every flag has one).
TOPICS: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_size", "model_options", "weights"),
    "data": ("dataset", "train_split", "eval_split", "image_size", "augment",
             "alternating_flip", "shuffle_buffer", "cache", "data_dir", "download_data"),
    "task": ("task",),
    "optimization": ("batch_size", "epochs", "train_steps", "optimizer",
                     "optimizer_options", "learning_rate", "momentum", "lr_schedule",
                     "warmup_epochs", "warmup_start_factor", "lr_decay_rate",
                     "sustain_epochs", "min_learning_rate", "weight_decay",
                     "decay_vectors", "lr_multipliers", "freeze_after_epochs"),
    "the training step": ("clip_grad_norm", "grad_accum_steps", "sam_rho", "mixup_alpha",
                          "cutmix_alpha", "lookahead_every", "lookahead_decay",
                          "ema_decay", "on_nan", "seed", "deterministic"),
    "devices": ("tpu", "require_tpu", "strategy", "cpu_replicas", "jit_compile",
                "precision"),
    "the loop": ("steps_per_loop", "log_every", "eval_every", "eval_batch_size",
                 "early_stop_patience", "early_stop_min_delta"),
    "run directory and outputs": ("model_dir", "checkpoint_every", "keep_checkpoints",
                                  "resume_with_changes"),
    "measuring": ("measure_peak", "profile_steps", "histograms"),
    "your own code": ("imports", "callbacks"),
}
_TOPIC_OF = {field: topic for topic, fields in TOPICS.items() for field in fields}


def help_topic(name: str) -> str:
    """The --help heading of setting `name`: its TOPICS entry, or for a task's own
    setting its task ('task gan'; 'task classification (also distill)'), else
    'other'."""
    if name in _TOPIC_OF:
        return _TOPIC_OF[name]
    owners = tasks.owners(name)
    if not owners:
        return "other"
    return f"task {owners[0]}" + (f" (also {', '.join(owners[1:])})" if owners[1:] else "")


def help_rank(name: str) -> float:
    """Where setting `name`'s topic comes in --help: TOPICS' order, a task's own
    settings right after "task", 'other' last."""
    order = list(TOPICS)
    topic = help_topic(name)
    if topic in order:
        return order.index(topic)
    return order.index("task") + 0.5 if topic != "other" else len(order)


def from_dict(values: dict) -> Config:
    """The Config of a run_config.json, also of runs from before tasks had their
    own settings (then classification's were top-level fields); keys no field has
    any more are dropped."""
    task = values.get("task", "classification")
    known = tasks.setting_fields(task) if task in tasks.names() else {}
    task_settings = {key: values[key] for key in known if key in values}
    nested = values.get("task_settings") or {}
    for key in task_settings.keys() & nested.keys():  # (an edit of one of them)
        if task_settings[key] != nested[key]:
            raise ConfigError(f"{key} is set twice, {files.shorter(repr(task_settings[key]), 60)}"
                              f" at the top and {files.shorter(repr(nested[key]), 60)} in "
                              f"task_settings; keep one")
    task_settings.update(nested)
    return Config(**{key: values[key] for key in FLAG_FIELDS if key in values},
                  task_settings=task_settings)


def default_model_dir(model: str, dataset: str, task: str = "classification",
                      settings: dict[str, Any] | None = None) -> str:
    """runs/<model>_<dataset>[_<task>][_<name>=<value>...]: no suffix for
    classification; for TFRecords, the data folder's name (not its path); then each
    of `settings` (those given on the command line that change what is trained), so
    that the points of a sweep land in runs of their own and the same command
    resumes its run. A name over 120 characters ends in a hash of the settings."""
    if dataset.startswith("tfrecord:"):
        pattern = dataset[len("tfrecord:"):].split(";")[0].rstrip("/")
        folder = pattern.rsplit("/", 2)[-2] if pattern.count("/") else "data"
        dataset = "tfrecord_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", folder)
    name = f"{model}_{dataset}" + ("" if task == "classification" else f"_{task}")
    given = "_".join(f"{key}={value}" for key, value in sorted((settings or {}).items()))
    if given:
        given = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", given)
        if len(name) + len(given) > 119:
            import hashlib
            given = "settings_" + hashlib.sha256(given.encode()).hexdigest()[:12]
        name += "_" + given
    return os.path.join("runs", name)


def resolve(values: dict[str, Any], explicit: set[str]
            ) -> tuple[Config, dict[str, str]]:
    """The Config of a command line's values (Config fields and every task's
    settings): the task's recipe and the model's under the values given explicitly
    (`explicit`). Returns (config, origin of each recipe value), unvalidated but
    for the task's settings (a ConfigError if another task's is given)."""
    tasks.get(values["task"])  # a ConfigError listing the tasks if unknown
    values, origin = recipes.resolve(values, explicit, tasks.get(values["task"]).recipe)
    mine = tasks.setting_fields(values["task"])
    for name in tasks.all_setting_fields():
        if name in explicit and name not in mine:
            tasks.make_settings(values["task"], {name: values[name]})  # raises
    task_settings = {name: values[name] for name in mine if name in values}
    if not values["model_dir"]:
        values["model_dir"] = default_model_dir(
            values["model"], values["dataset"], values["task"],
            _changed_settings(values, explicit))
    config = Config(**{name: values[name] for name in FLAG_FIELDS},
                    task_settings=task_settings)
    config.task_options()  # the task's own checks
    return config, origin


def recipe_values(model: str, dataset: str, task: str) -> dict[str, Any]:
    """Every setting (the Config fields and every task's settings) as a run of this
    model, dataset and task has it when no other is given: the defaults under the
    task's recipe and the model's. What a run's own settings are told apart from
    (its directory's name, summary.png's title, TensorBoard's settings table)."""
    defaults = {**{f.name: f.default for f in dataclasses.fields(Config)
                   if f.name in FLAG_FIELDS},
                **{name: f.default for name, f in tasks.all_setting_fields().items()}}
    values, _ = recipes.resolve({**defaults, "model": model, "dataset": dataset,
                                 "task": task}, {"model", "dataset", "task"},
                                tasks.get(task).recipe)
    return values


def changed_from_recipe(config: Config) -> dict[str, Any]:
    """The settings of a run (its task's too) whose value is not what its model,
    dataset and task train with by default (`recipe_values`), in field order, but
    for where it reads and writes (model_dir, data_dir): e.g. {"seed": 1}."""
    baseline = recipe_values(config.model, config.dataset, config.task)
    return {name: value for name, value in config.settings().items()
            if name not in ("model", "dataset", "task", "model_dir", "data_dir")
            and value != baseline.get(name)}


def _changed_settings(values: dict, explicit: set[str]) -> dict[str, Any]:
    """The settings given on the command line that change what is trained: those
    whose value differs from what the same model, dataset and task would train
    with without them (their recipe, else the defaults)."""
    identity = ("model", "dataset", "task")
    without = recipe_values(values["model"], values["dataset"], values["task"])
    return {name: values[name] for name in sorted(explicit)
            if name in values and name not in (*identity, *MAY_CHANGE_ON_RESUME)
            and values[name] != without.get(name)}


def profile_range(text: str) -> tuple[int, int]:
    """'A,B' -> (A, B) with 0 <= A < B; ConfigError otherwise."""
    try:
        first, last = (int(part) for part in text.split(","))
    except ValueError:
        first = last = -1
    if not 0 <= first < last:
        raise ConfigError(f"--profile_steps={text!r}: give two steps 'A,B' with "
                          f"0 <= A < B, e.g. '20,30'")
    return first, last


def _check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(
            f"unknown {name} {value!r}; valid: {', '.join(sorted(valid))}")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"--{name} must be {bound}, got {value}")


MAX_IMAGE_SIZE = 4096  # a side; larger is a typo (one such image is 200 MB of floats)


def validate(config: Config, model_names, dataset_names) -> Config:
    """Cheap checks done before any heavy work. Raises ConfigError. (That the batch
    divides by the replicas is checked once the strategy exists: build.Plan.)"""
    _check_choice("model", config.model, model_names)
    _check_choice("model_size", config.model_size, ("full", "tiny"))
    if not config.dataset:
        raise ConfigError("--dataset is empty; name a dataset (e.g. cifar10)")
    _check_choice("cache", config.cache, CACHE_CHOICES)
    _check_choice("task", config.task, tasks.names())
    _check_choice("optimizer", config.optimizer, optimizers.names())
    _check_choice("lr_schedule", config.lr_schedule, schedules.KINDS)
    _check_choice("precision", config.precision, PRECISIONS)
    _check_choice("strategy", config.strategy, STRATEGIES)
    _check_choice("jit_compile", config.jit_compile, JIT_CHOICES)
    _check_choice("on_nan", config.on_nan, ON_NAN)
    if config.augment:
        _check_choice("augment", config.augment, augment_lib.TRAIN_AUGMENTATIONS)
    for name in ("batch_size", "learning_rate", "steps_per_loop", "cpu_replicas",
                 "keep_checkpoints", "grad_accum_steps"):
        _check_positive(name, getattr(config, name))
    for name, value in [*config.as_dict().items(), *config.task_settings.items()]:
        problem = non_finite(name, value)  # nan < 0 is False: no range check sees it
        if problem:
            raise ConfigError(problem)
    for name in ("early_stop_patience", "early_stop_min_delta",
                 "epochs", "train_steps", "eval_batch_size", "warmup_epochs", "weight_decay",
                 "sustain_epochs", "min_learning_rate", "log_every", "eval_every",
                 "checkpoint_every", "shuffle_buffer", "image_size", "clip_grad_norm",
                 "mixup_alpha", "cutmix_alpha", "lookahead_every", "sam_rho"):
        _check_positive(name, getattr(config, name), allow_zero=True)
    if config.image_size > MAX_IMAGE_SIZE:
        raise ConfigError(f"--image_size={config.image_size} is beyond {MAX_IMAGE_SIZE} "
                          f"pixels a side; choose a smaller size (0: the dataset's own)")
    if config.epochs == 0 and config.train_steps == 0:
        raise ConfigError("nothing to train: set --epochs or --train_steps above 0")
    if not 0 <= config.ema_decay < 1:
        raise ConfigError(f"--ema_decay must be in [0, 1) (0: no averaging), got "
                          f"{config.ema_decay}")
    if not 0 < config.lookahead_decay <= 1:
        raise ConfigError(f"--lookahead_decay must be in (0, 1], got "
                          f"{config.lookahead_decay}")
    if config.alternating_flip and config.augment not in augment_lib.NO_FLIP:
        given = config.augment or "(the dataset's default)"
        raise ConfigError(f"--alternating_flip needs an augmentation that does not flip "
                          f"at random itself, got --augment={given}; use "
                          f"{' or '.join(augment_lib.NO_FLIP)}")
    if config.profile_steps:
        profile_range(config.profile_steps)  # raises if malformed
    task = tasks.get(config.task)
    if (config.mixup_alpha or config.cutmix_alpha) and not task.soft_targets:
        raise ConfigError(f"--mixup_alpha/--cutmix_alpha mix labels into soft targets; "
                          f"task {config.task} does not train on them (drop the flags)")
    try:
        callbacks_lib.parse_names(config.callbacks)
        optimizers.parse_options(config.optimizer, config.optimizer_options)
        models.parse_options(config.model, config.model_options)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    config.task_options()
    if not 0 < config.lr_decay_rate <= 1:
        raise ConfigError(f"--lr_decay_rate must be in (0, 1], got {config.lr_decay_rate}")
    if config.min_learning_rate > config.learning_rate:  # (a decay would climb)
        raise ConfigError(f"--min_learning_rate={config.min_learning_rate} is above "
                          f"--learning_rate={config.learning_rate}: it is the floor the "
                          f"--lr_schedule decays to and the warmup's start; give "
                          f"min_learning_rate <= learning_rate")
    if config.lr_schedule == "range_test" and not 0 < config.min_learning_rate < (
            config.learning_rate):
        raise ConfigError(f"--lr_schedule=range_test climbs from --min_learning_rate to "
                          f"--learning_rate: give 0 < min_learning_rate < learning_rate, "
                          f"got {config.min_learning_rate} and {config.learning_rate}")
    if config.require_tpu and config.strategy not in ("auto", "tpu"):
        raise ConfigError(f"--require_tpu conflicts with --strategy={config.strategy}")
    return config
