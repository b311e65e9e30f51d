"""The callbacks protocol (trainer/callbacks.py): early stopping at the right step,
also across a resume (its state is in the checkpoint), the CSV log against
metrics.json, a callback of one's own asking the loop to stop."""
import json
import os

import pytest

from trainer import callbacks, loop


def _metrics(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)


def test_early_stopping_stops_at_the_right_step_and_its_state_resumes(tiny_config):
    # A learning rate too small to change a prediction: test accuracy never
    # improves after the first evaluation (step 2), so with a patience of 2 the
    # run stops at the evaluation of step 6, not later, however it is split.
    config = tiny_config.replace(learning_rate=1e-12, eval_every=2, checkpoint_every=2,
                                 early_stop_patience=2, train_steps=4)
    first = loop.train_and_evaluate(config)  # ends at step 4: one evaluation without
    assert first["steps"] == 4 and "stopped_early" not in first  # improvement so far
    # Resumed for up to 12 steps: the count (1) comes back from ckpt-4, so the stop
    # is at step 6; a callback that started afresh would stop at step 8.
    metrics = loop.train_and_evaluate(config.replace(train_steps=12))
    assert metrics["resumed_from_step"] == 4
    assert metrics["steps"] == 6, metrics["stopped_early"]
    assert "early stopping: test accuracy has not improved for 2 evaluations" in (
        metrics["stopped_early"])
    assert [r["step"] for r in metrics["eval_history"]] == [2, 4, 6]
    # A finished run: the same command again trains nothing.
    again = loop.train_and_evaluate(config.replace(train_steps=12))
    assert again["steps"] == 6 and again["weights_sha256"] == metrics["weights_sha256"]

    # The CSV log: a row per log line and per evaluation, the numbers of
    # metrics.json's histories (the resumed run kept the first run's rows).
    rows = callbacks.read_csv(os.path.join(config.model_dir, callbacks.CSV_FILE))
    written = _metrics(config.model_dir)
    for kind, history in (("train", written["train_history"]),
                          ("eval", written["eval_history"])):
        mine = [row for row in rows if row["kind"] == kind]
        assert [int(row["step"]) for row in mine] == [r["step"] for r in history]
        for row, record in zip(mine, history):
            for key, value in record.items():
                if isinstance(value, float):
                    assert float(row[key]) == pytest.approx(value, rel=1e-12), key


class _StopAtStep(callbacks.Callback):
    name = "stop_at_step"

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def on_train_begin(self, context):
        self.context = context

    def on_log(self, step, metrics):
        self.seen.append(("log", step))
        if step >= 4:
            self.context.request_stop("enough for this test")

    def on_eval(self, step, results, state):
        assert "test_accuracy" in results and state.step.numpy() == step
        self.seen.append(("eval", step))

    def on_checkpoint(self, step, path):
        assert path.endswith(f"ckpt-{step}")
        self.seen.append(("checkpoint", step))

    def on_train_end(self, metrics):
        self.seen.append(("end", metrics["steps"]))


def test_a_registered_callback_sees_every_hook_and_stops_the_run(tiny_config):
    made = []
    callbacks.register("stop_at_step")(lambda: made.append(_StopAtStep()) or made[-1])
    try:
        metrics = loop.train_and_evaluate(tiny_config.replace(
            callbacks="stop_at_step", train_steps=8, eval_every=8))
    finally:
        del callbacks._REGISTRY["stop_at_step"]
    assert metrics["steps"] == 4 and metrics["stopped_early"] == "enough for this test"
    # Stopped between evaluations: the run evaluates its last step before its end.
    assert made[0].seen == [("log", 2), ("checkpoint", 2), ("log", 4), ("checkpoint", 4),
                            ("eval", 4), ("end", 4)]


def test_an_unknown_callback_is_one_error_naming_the_registered_ones(tiny_config):
    from trainer import config as config_lib, run_settings
    with pytest.raises(config_lib.ConfigError, match="unknown callback 'nope'"):
        run_settings.validate(tiny_config.replace(callbacks="nope"), ("cifar_cnn",),
                            ("synthetic",))


@pytest.mark.figures
def test_lr_find_climbs_until_the_loss_diverges_and_suggests_a_rate(tmp_path, command):
    status, out, log = command(
        "trainer.tools.lr_find", "--model=cifar_cnn", "--model_size=tiny",
        "--dataset=synthetic", "--batch_size=16", "--eval_batch_size=256",
        "--precision=float32", "--lr_min=1e-5", "--lr_max=1e3", "--lr_find_steps=40",
        f"--output_dir={tmp_path / 'lr'}")
    assert status == 0, out + log
    with open(tmp_path / "lr" / "lr_find.json") as f:
        found = json.load(f)
    rates = found["learning_rates"]
    assert rates[0] == pytest.approx(1e-5) and rates == sorted(rates)
    # Adam at 1e3 diverges long before the 40th step: the test stopped itself.
    assert len(rates) < 40 and ("diverged" in log or "not finite" in log)
    assert 1e-5 <= found["steepest"] <= rates[-1]
    assert f"suggested learning rate: {found['steepest']:.3g}" in out
    assert (tmp_path / "lr" / "lr_find.png").stat().st_size > 10_000
