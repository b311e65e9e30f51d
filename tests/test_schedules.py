"""Learning-rate schedule values at the points that matter."""
import math

import pytest

from trainer import schedules

TOTAL, PER_EPOCH, WARMUP = 100, 10, 20


def _lr(kind, step, **kwargs):
    schedule = schedules.WarmupSchedule(kind, 1.0, TOTAL, PER_EPOCH, warmup_steps=WARMUP,
                                        floor=0.1, **kwargs)
    return float(schedule(step))


@pytest.mark.parametrize("kind", [k for k in schedules.KINDS if k != "range_test"])
def test_warmup_starts_at_floor_and_reaches_peak(kind):
    assert _lr(kind, 0) == pytest.approx(0.1)
    assert _lr(kind, WARMUP // 2) == pytest.approx(0.55)
    assert _lr(kind, WARMUP) == pytest.approx(1.0)


def test_the_range_test_climbs_exponentially_from_floor_to_peak():
    schedule = schedules.WarmupSchedule("range_test", 10.0, 101, PER_EPOCH, floor=1e-4)
    assert [float(schedule(s)) for s in (0, 50, 100, 150)] == pytest.approx(
        [1e-4, 1e-4 * 1e5 ** 0.5, 10.0, 10.0], rel=1e-5)


def test_constant_holds_the_peak():
    assert _lr("constant", 60) == _lr("constant", TOTAL - 1) == pytest.approx(1.0)


def test_exponential_decays_per_epoch_towards_floor():
    assert _lr("exponential", WARMUP + PER_EPOCH, decay_rate=0.5) == pytest.approx(0.55)
    last = 0.1 + 0.9 * 0.5 ** ((TOTAL - 1 - WARMUP) / PER_EPOCH)
    assert _lr("exponential", TOTAL - 1, decay_rate=0.5) == pytest.approx(last)


def test_cosine_is_half_way_in_the_middle_and_floor_at_the_end():
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert _lr("cosine", middle) == pytest.approx(0.55)
    assert _lr("cosine", TOTAL) == pytest.approx(0.1)
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (TOTAL - 1 - WARMUP) / 80))
    assert _lr("cosine", TOTAL - 1) == pytest.approx(expected)


def test_rampup_sustains_then_decays_like_the_codelab():
    kwargs = dict(decay_rate=0.8, sustain_steps=20)
    assert _lr("rampup", WARMUP + 19, **kwargs) == pytest.approx(1.0)
    # Codelab lrfn: (max - min) * decay ** (epochs after sustain) + min.
    assert _lr("rampup", WARMUP + 20 + 2 * PER_EPOCH, **kwargs) == pytest.approx(
        0.9 * 0.8 ** 2 + 0.1)


def test_no_warmup_starts_at_peak():
    schedule = schedules.WarmupSchedule("cosine", 2.0, TOTAL, PER_EPOCH)
    assert float(schedule(0)) == pytest.approx(2.0)


def test_sample_points_cover_start_warmup_end():
    schedule = schedules.WarmupSchedule("cosine", 1.0, TOTAL, PER_EPOCH, warmup_steps=WARMUP)
    steps = [s for s, _ in schedules.sample_points(schedule)]
    assert steps[0] == 0 and WARMUP in steps and steps[-1] == TOTAL - 1


def test_linear_is_the_one_cycle_triangle():
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert _lr("linear", middle) == pytest.approx(0.1 + 0.9 * 0.5)
    assert _lr("linear", TOTAL) == pytest.approx(0.1)


def test_unknown_schedule_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: constant, exponential, cosine, linear"):
        schedules.WarmupSchedule("onecycle", 1.0, TOTAL, PER_EPOCH)


def test_a_warmup_start_of_its_own_leaves_the_floor_to_the_end():
    # airbench's triangle: from 0.2 x peak up to the peak, then down to the floor.
    assert _lr("linear", 0, start=0.2) == pytest.approx(0.2)
    assert _lr("linear", WARMUP // 2, start=0.2) == pytest.approx(0.6)
    assert _lr("linear", WARMUP, start=0.2) == pytest.approx(1.0)
    assert _lr("linear", TOTAL, start=0.2) == pytest.approx(0.1)
    restored = schedules.WarmupSchedule.from_config(schedules.WarmupSchedule(
        "linear", 1.0, TOTAL, PER_EPOCH, warmup_steps=WARMUP, floor=0.1,
        start=0.2).get_config())
    assert float(restored(0)) == pytest.approx(0.2)
