"""The run's flags, shared by every command that builds a run (training,
check_step, the benchmark): one absl flag per `Config` field and per task setting,
made from the field's default and help text, and the validated Config they make
(the task's and the model's recipe under the flags given). And the errors every
command prints as one `error:` line with exit status 2."""
import dataclasses

from absl import flags, logging

from data import files, sources
import models
from trainer import checkpoints, cli, config as config_lib, run_settings, tasks, user_code
from trainer import strategy as strategy_lib

# Errors that mean "the user asked for something impossible": one line, status 2.
USER_ERRORS = (config_lib.ConfigError, sources.DatasetError, strategy_lib.DeviceError,
               checkpoints.CheckpointError, user_code.UserCodeError, files.LinkError)

# A field whose flag has another name: --import (`import` is a Python keyword).
FLAG_NAMES = {"imports": user_code.FLAG}


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, field)


def _setting_fields() -> list[dataclasses.Field]:
    """Every Config field that is a flag, then every task's settings."""
    return [*(f for f in dataclasses.fields(config_lib.Config)
              if f.name in config_lib.FLAG_FIELDS),
            *tasks.all_setting_fields().values()]


def define_flags(flag_values: flags.FlagValues) -> None:
    """The run's flags on the command's `flag_values` (defining twice is a no-op):
    one per Config field and one per task setting, its default and help from the
    field. Only a command's main reads them."""
    definers = {str: flags.DEFINE_string, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, bool: flags.DEFINE_bool}
    # In --help's order: by topic (config.TOPICS; a task's settings under it).
    for field in sorted(_setting_fields(), key=lambda f: run_settings.help_rank(f.name)):
        kind = type(field.default) if field.default is not None else str
        cli.define_flag(flag_values, definers[kind], flag_name(field.name),
                        field.default, _with_choices(field.metadata["help"]),
                        topic=run_settings.help_topic(field.name))


def _with_choices(text: str) -> str:
    """A setting's help with the registries' names as they are now (the user's
    own models, datasets and tasks, imported before the flags are made)."""
    return (text.replace("{tasks}", "|".join(tasks.names()))
            .replace("{models}", "|".join(models.names()))
            .replace("{datasets}", "|".join(sources.names())))


def config_from_flags(flag_values: flags.FlagValues) -> config_lib.Config:
    """The validated Config from a command's parsed `flag_values`: the model's
    recipe, the flags given over it."""
    # (A task registered after the flags were defined: its settings at their defaults.)
    names = [f.name for f in _setting_fields() if flag_name(f.name) in flag_values]
    # (A command imports them before it defines its flags, cli.import_user_code;
    # again here for a main called in-process.)
    user_code.import_modules(flag_values[user_code.FLAG].value)
    config, origin = run_settings.resolve(
        {name: flag_values[flag_name(name)].value for name in names},
        {name for name in names if flag_values[flag_name(name)].present})
    if origin:
        values = config.settings()
        taken = {name: source for name, source in origin.items() if name in values}
        given = [name for name, source in taken.items() if source == "flag"]
        # (what the recipe changes: a value it sets to the flag's default says nothing)
        logging.info("Recipe %s: %s%s", config.model, " ".join(
            f"{name}={values[name]}" for name, source in taken.items()
            if source != "flag" and values[name] != flag_values[flag_name(name)].default
            ) or "the defaults", f" (flags over it: {' '.join(given)})" if given else "")
    return run_settings.validate(config, models.names(), sources.names())
