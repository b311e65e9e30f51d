"""A run's settings with what the registries know (the tasks, models, callbacks
and recipes), kept out of trainer/config.py so that it imports none of them: a
command line's values resolved under the recipes (`resolve`), checked (`validate`,
also the checks that span settings groups), read back from a run_config.json
(`from_dict`), the task's own settings (`task_settings_of`), the recipe a run is
told apart from (`recipe_values`, `changed_from_recipe`), --help's topics, and the
settings two starts of a run directory are compared by (`comparable_settings`,
`differences`: trainer/run_dir.py)."""
import dataclasses
import json
from typing import Any

from data import augment as augment_lib, files
import models
from trainer import callbacks as callbacks_lib, config as config_lib, inputs
from trainer import optimizers, recipes, settings, tasks
from trainer.config import Config, ConfigError
from trainer.settings import non_finite


def help_topic(name: str) -> str:
    """The --help heading of setting `name`: its field's topic, or for a task's own
    setting its task ('task gan'; 'task classification (also distill)'), else
    'other'."""
    if name in config_lib.TOPIC_OF:
        return config_lib.TOPIC_OF[name]
    owners = tasks.owners(name)
    if not owners:
        return "other"
    return f"task {owners[0]}" + (f" (also {', '.join(owners[1:])})" if owners[1:] else "")


def help_rank(name: str) -> float:
    """Where setting `name`'s topic comes in --help: TOPIC_ORDER, a task's own
    settings right after "task", 'other' last."""
    order = list(config_lib.TOPIC_ORDER)
    topic = help_topic(name)
    if topic in order:
        return order.index(topic)
    return order.index("task") + 0.5 if topic != "other" else len(order)


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
        values["model_dir"] = config_lib.default_model_dir(
            values["model"], values["dataset"], values["task"],
            _changed_settings(values, explicit))
    config = Config(**{name: values[name] for name in config_lib.FLAG_FIELDS},
                    task_settings=task_settings)
    task_settings_of(config)  # the task's own checks
    return config, origin


def _changed_settings(values: dict, explicit: set[str]) -> dict[str, Any]:
    """The settings given on the command line that change what is trained: those
    whose value differs from what the same model, dataset and task would train
    with without them (their recipe, else the defaults)."""
    identity = ("model", "dataset", "task")
    without = recipe_values(values["model"], values["dataset"], values["task"])
    return {name: values[name] for name in sorted(explicit)
            if name in values and name not in (*identity, *config_lib.MAY_CHANGE_ON_RESUME)
            and values[name] != without.get(name)}


def recipe_values(model: str, dataset: str, task: str) -> dict[str, Any]:
    """Every setting (the Config fields and every task's settings) as a run of this
    model, dataset and task has it when no other is given: the defaults under the
    task's recipe and the model's. What a run's own settings are told apart from
    (its directory's name, summary.png's title, TensorBoard's settings table)."""
    defaults = {**{f.name: f.default for f in dataclasses.fields(config_lib.Config)
                   if f.name in config_lib.FLAG_FIELDS},
                **{name: f.default for name, f in tasks.all_setting_fields().items()}}
    values, _ = recipes.resolve({**defaults, "model": model, "dataset": dataset,
                                 "task": task}, {"model", "dataset", "task"},
                                tasks.get(task).recipe)
    return values


def changed_from_recipe(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run (`Config.settings()`: its task's too) whose value is
    not what its model, dataset and task train with by default (`recipe_values`),
    in field order, but for where it reads and writes (model_dir, data_dir): e.g.
    {"seed": 1}."""
    baseline = recipe_values(settings["model"], settings["dataset"], settings["task"])
    return {name: value for name, value in settings.items()
            if name not in ("model", "dataset", "task", "model_dir", "data_dir")
            and value != baseline.get(name)}


def task_settings_of(config: Config) -> Any:
    """The run's task's Settings (its defaults, overridden by config.task_settings);
    ConfigError for a value the task refuses."""
    return tasks.make_settings(config.task, config.task_settings)


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
    return Config(**{key: values[key] for key in config_lib.FLAG_FIELDS if key in values},
                  task_settings=task_settings)


def _check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(
            f"unknown {name} {value!r}; valid: {', '.join(sorted(valid))}")


def validate(config: Config, model_names, dataset_names) -> Config:
    """Cheap checks done before any heavy work. Raises ConfigError. Each field's
    own range and choices (settings.check), then what the registries know and the
    checks that span settings, in one place. (That the batch divides by the
    replicas is checked once the strategy exists: build.Plan.)"""
    _check_choice("model", config.model, model_names)
    if not config.dataset:
        raise ConfigError("--dataset is empty; name a dataset (e.g. cifar10)")
    _check_choice("task", config.task, tasks.names())
    settings.check(config)
    for name, value in config.task_settings.items():
        problem = non_finite(name, value)  # nan < 0 is False: no range check sees it
        if problem:
            raise ConfigError(problem)
    if config.image_size > inputs.MAX_IMAGE_SIZE:
        raise ConfigError(f"--image_size={config.image_size} is beyond "
                          f"{inputs.MAX_IMAGE_SIZE} pixels a side; choose a smaller "
                          f"size (0: the dataset's own)")
    if config.epochs == 0 and config.train_steps == 0:
        raise ConfigError("nothing to train: set --epochs or --train_steps above 0")
    if config.alternating_flip and config.augment not in augment_lib.NO_FLIP:
        given = config.augment or "(the dataset's default)"
        raise ConfigError(f"--alternating_flip needs an augmentation that does not flip "
                          f"at random itself, got --augment={given}; use "
                          f"{' or '.join(augment_lib.NO_FLIP)}")
    if config.profile_steps:
        config_lib.profile_range(config.profile_steps)  # raises if malformed
    task = tasks.get(config.task)
    if (config.mixup_alpha or config.cutmix_alpha) and "target" not in task.batch_keys:
        raise ConfigError(f"--mixup_alpha/--cutmix_alpha mix labels into soft targets; "
                          f"task {config.task} does not train on them (drop the flags)")
    try:
        callbacks_lib.parse_names(config.callbacks)
        optimizers.parse_options(config.optimizer, config.optimizer_options)
        models.parse_options(config.model, config.model_options)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    task_settings_of(config)
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


def comparable_settings(run_config: dict) -> dict:
    """Every setting of a run, flat (its task's own too), as JSON holds them: the
    defaults of those an older run_config.json lacks filled in."""
    try:
        config = from_dict(run_config)
        values = {**config.as_dict(), **dataclasses.asdict(task_settings_of(config))}
    except (ValueError, TypeError, RuntimeError):  # (ConfigError: a task unknown here)
        values = {**run_config, **(run_config.get("task_settings") or {})}
    values.pop("task_settings", None)
    return json.loads(json.dumps(values))


def differences(recorded: dict, run_config: dict) -> list[tuple[str, object, object]]:
    """(setting, recorded value, this run's value) for each setting that differs,
    the task's own settings included."""
    before, now = comparable_settings(recorded), comparable_settings(run_config)
    return [(key, before.get(key), now.get(key)) for key in dict.fromkeys([*before, *now])
            if before.get(key) != now.get(key)]
