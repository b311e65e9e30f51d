"""Tests of a MoCo-style step (moco.py, beside this file) with trainer.testing: run
with `python -m pytest` in this folder (its conftest.py takes the kit in one line),
from anywhere the project is installed. docs/testing.md walks through them."""
import numpy as np
import pytest

from trainer import testing

import moco  # noqa: F401  (registers --task=moco)

SETTINGS = dict(task="moco", queue_size=64, moco_dim=8, batch_size=16)


def test_the_queue_advances_by_the_global_batch(step_config):
    trained = testing.train(step_config(**SETTINGS), steps=3, replicas=2)
    assert trained.before["extras/queue_pointer"] == 0
    assert trained.after["extras/queue_pointer"] == 3 * 16  # not 3 x 8: global keys
    changed_rows = np.any(trained.before["extras/queue"] != trained.after["extras/queue"],
                          axis=1)
    assert changed_rows.sum() == 3 * 16 and changed_rows[:48].all()


def test_the_key_encoder_moves_by_momentum_only(step_config):
    config = step_config(**SETTINGS)
    trained = testing.train(config, steps=1)
    m = config.task_settings.get("key_momentum", 0.99)
    keys = [name for name in trained.before if name.startswith("key/")]
    queries = [name for name in trained.before if name.startswith("main/")]
    assert len(keys) == len(queries) > 0
    assert "key" not in trained.run.state.optimizers  # no optimizer, no gradient
    for key, query in zip(keys, queries):  # exactly m x before + (1 - m) x query after
        expected = m * trained.before[key] + (1 - m) * trained.after[query]
        np.testing.assert_array_equal(trained.after[key], expected, err_msg=key)


def test_one_and_two_replicas_agree(step_config):
    config = step_config(**SETTINGS)
    one = testing.train(config, steps=2, replicas=1)
    two = testing.train(config, steps=2, replicas=2, start=one.before)
    for name, mine, theirs in one.pairs(two):  # (float64: rounding apart at most)
        np.testing.assert_allclose(theirs, mine, rtol=1e-10, atol=1e-12, err_msg=name)
    verdict = testing.check(config)
    assert verdict.passed, verdict.report()


@pytest.mark.parametrize("replicas", [2])
def test_the_step_runs_in_the_runs_own_precision(step_config, replicas):
    # mixed_bfloat16 (the run's on a TPU and on this CPU): the all_gather of the
    # keys must get float32.
    trained = testing.train(step_config(**SETTINGS, precision="auto"), steps=1,
                            replicas=replicas, precision="run")
    assert np.isfinite(trained.metrics["loss"])
