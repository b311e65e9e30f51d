"""Settings live in groups beside the code that reads them (trainer/settings.py):
adding one is one field and its use, and everything else follows."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from test_main import ROOT

DOC = os.path.join(ROOT, "docs", "changing-the-step.md")


def _the_docs_diff() -> str:
    """The diff of docs/changing-the-step.md's "a new step setting" example."""
    text = open(DOC, encoding="utf-8").read()
    section = text[text.index("## Worked example: a new step setting"):]
    return re.search(r"```diff\n(.*?)```", section, re.S).group(1)


@pytest.mark.long(20)  # seconds, with -n 2
def test_a_new_setting_is_one_field_and_its_use(tmp_path):
    # The docs' diff on a copy of the project: its flag, --help topic, range error,
    # resume rule and run_config.json entry must all appear, with no other edit.
    for package in ("trainer", "models", "data"):
        shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    diff = _the_docs_diff()
    assert diff.count("+++ ") == 1 and "+++ b/trainer/step.py" in diff  # one file
    applied = subprocess.run(["patch", "-p1", "--forward", "--no-backup-if-mismatch"],
                             input=diff, text=True, cwd=tmp_path, capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr  # a stale doc fails
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(tmp_path))
    probe = subprocess.run([sys.executable, "-c", """
import models, data
from trainer import config, run_settings, step
from data import sources
c = config.Config()
print("run_config", c.as_dict()["clip_grad_value"])
print("topic", run_settings.help_topic("clip_grad_value"))
print("may_change_on_resume", "clip_grad_value" in config.MAY_CHANGE_ON_RESUME)
print("step_setting", "clip_grad_value" in step.SETTINGS)
try:
    run_settings.validate(c.replace(clip_grad_value=-1.0), models.names(), sources.names())
except config.ConfigError as err:
    print("error", err)
"""], cwd=tmp_path, env=env, text=True, capture_output=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in probe.stdout.strip().splitlines())
    assert lines == {"run_config": "0.0", "topic": "the training step",
                     "may_change_on_resume": "False", "step_setting": "True",
                     "error": "--clip_grad_value must be >= 0, got -1.0"}, probe.stdout
    shown = subprocess.run([sys.executable, "-m", "trainer.main", "--help"],
                           cwd=tmp_path, env=env, text=True, capture_output=True).stdout
    flag = shown.index("--clip_grad_value=0.0: Clip each element")
    assert shown.index("\nthe training step:\n") < flag < shown.index("\ndevices:\n")


def test_every_setting_declares_its_topic_range_and_resume_rule():
    import dataclasses
    from trainer import config as config_lib, settings
    for field in dataclasses.fields(config_lib.Config):
        if field.name == "task_settings":
            continue
        assert field.metadata["topic"] in config_lib.TOPIC_ORDER, field.name
        assert field.metadata["resume"] in (True, False, settings.NEVER,
                                            settings.ON_OFF), field.name
    # The groups are disjoint and together are the Config's fields.
    from trainer import inputs, optimizers, schedules, step, strategy
    groups = [config_lib.ModelSettings, inputs.DataSettings,
              optimizers.OptimizerSettings, schedules.ScheduleSettings,
              step.StepSettings, strategy.DeviceSettings, config_lib.LoopSettings,
              config_lib.RunSettings]
    names = [f.name for group in groups for f in dataclasses.fields(group)]
    assert sorted(names) == sorted(config_lib.FLAG_FIELDS)


def test_a_run_config_json_from_before_the_groups_loads_the_same(tiny_config):
    # run_config.json keeps one flat key per flag: the groups change no file.
    from trainer import config as config_lib
    flat = tiny_config.as_dict()
    assert "clip_grad_norm" in flat and "task_settings" in flat
    from trainer import run_settings
    assert run_settings.from_dict(flat) == tiny_config
    assert tiny_config.group(config_lib.LoopSettings).batch_size == tiny_config.batch_size


def test_a_task_builds_another_optimizer_from_the_runs_settings_changed(tiny_config):
    # A GAN's discriminator: another peak of the run's schedule, another optimizer.
    import keras
    import tensorflow as tf
    from trainer import build
    from trainer.config import ConfigError
    spec = build.run_data(tiny_config).spec
    builder = build.StateBuilder(tiny_config, spec, build.plan(tiny_config, spec, 1),
                                 tf.distribute.get_strategy(), "float32", build.TRAIN,
                                 build.make_task(tiny_config, spec))
    model = builder.model()
    run_s = builder.optimizer(model)
    other = builder.optimizer(model, learning_rate=0.5, optimizer="sgd", momentum=0.0)
    assert isinstance(run_s, getattr(keras.optimizers, tiny_config.optimizer.title()))
    assert isinstance(other, keras.optimizers.SGD) and other.momentum == 0.0
    assert float(other.learning_rate) / float(run_s.learning_rate) == pytest.approx(
        0.5 / tiny_config.learning_rate)
    with pytest.raises(ConfigError, match="momentun"):
        builder.optimizer(model, momentun=0.5)
    # A head alone, at another peak, other Adam betas: as docs/changing-the-step.md
    # says, and named in the run's log by build.state.
    head = [v for v in model.trainable_variables if v is model.trainable_variables[-1]]
    head_only = builder.optimizer(model, learning_rate=0.01, variables=head,
                                  optimizer="adam", optimizer_options="beta_1=0.0,beta_2=0.9")
    assert head_only.beta_1 == 0.0 and head_only.beta_2 == 0.9
    assert len([v for v in head_only.variables if "momentum" in v.path]) == 1
    builder.state({"main": model}, {"main": run_s, "head": head_only})
    assert set(builder.optimizer_notes) == {"head"}
    assert "peak 0.01" in builder.optimizer_notes["head"]
    assert f"1 of {model.name}'s {len(model.trainable_variables)}" in (
        builder.optimizer_notes["head"])
    with pytest.raises(ConfigError, match="trainable variables"):
        builder.optimizer(model, variables=[tf.Variable(1.0)])
