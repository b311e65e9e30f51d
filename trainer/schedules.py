"""Learning-rate schedules as functions of the optimizer step.

Every schedule starts with a linear warmup from `start` (default: `floor`) to
`peak` over `warmup_steps` (none when 0), then:
- constant:     peak
- exponential:  floor + (peak - floor) * decay_rate ** epochs_since_warmup
- cosine:       floor + (peak - floor) * (1 + cos(pi * progress)) / 2, to the last step
- linear:       floor + (peak - floor) * (1 - progress): with a warmup, the one-cycle
                (triangular) schedule of the CIFAR-10 speed records
- rampup:       the flowers codelab's lrfn: hold the peak for `sustain_steps`, then
                decay exponentially per epoch towards `floor`
- range_test:   from `floor` up to `peak`, exponentially, over the run's steps (the
                learning-rate range test: python -m trainer.tools.lr_find)
Epochs here are fractional (step / steps_per_epoch), so the curve is smooth.
"""
import dataclasses
import math

import keras
import tensorflow as tf

from trainer import settings

KINDS = ("constant", "exponential", "cosine", "linear", "rampup", "range_test")

_ = settings.section("optimization")  # (--help's heading of each field below)


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """What a run's `WarmupSchedule` is made of (flags of the same names)."""
    learning_rate: float = _(1e-3, "Peak learning rate.", low=0, low_open=True)
    lr_schedule: str = _("constant", f"{'|'.join(KINDS)}, each after a linear warmup "
                         "(rampup: the flowers codelab's ramp-up/sustain/decay).",
                         choices=KINDS)
    warmup_epochs: float = _(0.0, "Linear warmup from --min_learning_rate to the peak.",
                             low=0)
    warmup_start_factor: float = _(0.0, "If > 0, the warmup starts at this x the peak "
                                   "instead of --min_learning_rate (airbench: 0.2).")
    lr_decay_rate: float = _(0.8, "Per-epoch factor of the exponential and rampup "
                             "schedules.", low=0, low_open=True, high=1)
    sustain_epochs: float = _(0.0, "rampup: epochs to hold the peak after warmup.", low=0)
    min_learning_rate: float = _(0.0, "Warmup start and floor of the decaying "
                                 "schedules.", low=0)

    def make(self, total_steps: int, steps_per_epoch: int) -> "WarmupSchedule":
        """The run's schedule over `total_steps` steps of `steps_per_epoch` a epoch."""
        return WarmupSchedule(
            self.lr_schedule, self.learning_rate, total_steps, steps_per_epoch,
            warmup_steps=round(self.warmup_epochs * steps_per_epoch),
            decay_rate=self.lr_decay_rate,
            sustain_steps=round(self.sustain_epochs * steps_per_epoch),
            floor=self.min_learning_rate,
            start=self.warmup_start_factor * self.learning_rate
            if self.warmup_start_factor > 0 else None)


class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then one of KINDS. Serializable via get_config."""

    def __init__(self, kind: str, peak: float, total_steps: int, steps_per_epoch: int,
                 warmup_steps: int = 0, decay_rate: float = 0.8, sustain_steps: int = 0,
                 floor: float = 0.0, start: float | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown lr_schedule {kind!r}; valid: {', '.join(KINDS)}")
        self.kind, self.peak, self.floor = kind, float(peak), float(floor)
        self.total_steps, self.steps_per_epoch = int(total_steps), max(1, steps_per_epoch)
        self.warmup_steps, self.sustain_steps = int(warmup_steps), int(sustain_steps)
        self.decay_rate = float(decay_rate)
        self.start = self.floor if start is None else float(start)  # the warmup's

    def _after_warmup(self, steps_since_warmup: tf.Tensor) -> tf.Tensor:
        span = self.peak - self.floor
        if self.kind == "constant":
            return tf.fill(tf.shape(steps_since_warmup), self.peak)
        if self.kind in ("cosine", "linear"):
            decay_steps = max(1, self.total_steps - self.warmup_steps)
            progress = tf.minimum(steps_since_warmup / decay_steps, 1.0)
            if self.kind == "linear":
                return self.floor + span * (1.0 - progress)
            return self.floor + span * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.kind == "range_test":  # floor * (peak / floor) ** progress
            progress = steps_since_warmup / max(1, self.total_steps - 1)
            return self.floor * tf.pow(self.peak / self.floor, tf.minimum(progress, 1.0))
        if self.kind == "rampup":
            steps_since_warmup = tf.maximum(steps_since_warmup - self.sustain_steps, 0.0)
        epochs = steps_since_warmup / self.steps_per_epoch
        return self.floor + span * tf.pow(self.decay_rate, epochs)

    def __call__(self, step) -> tf.Tensor:
        step = tf.cast(step, tf.float32)
        warmup = self.start + (self.peak - self.start) * step / max(1, self.warmup_steps)
        after = self._after_warmup(tf.maximum(step - self.warmup_steps, 0.0))
        return tf.where(step < self.warmup_steps, warmup, after)

    def get_config(self) -> dict:
        return dict(kind=self.kind, peak=self.peak, total_steps=self.total_steps,
                    steps_per_epoch=self.steps_per_epoch, warmup_steps=self.warmup_steps,
                    decay_rate=self.decay_rate, sustain_steps=self.sustain_steps,
                    floor=self.floor, start=self.start)


def sample_points(schedule: WarmupSchedule, num: int = 6) -> list[tuple[int, float]]:
    """(step, lr) at the start, end of warmup and evenly to the end: for the log."""
    last = max(0, schedule.total_steps - 1)
    steps = sorted({0, min(schedule.warmup_steps, last), last,
                    *(round(last * i / (num - 1)) for i in range(1, num - 1))})
    return [(s, float(schedule(s))) for s in steps]


def describe(schedule: WarmupSchedule) -> str:
    """'step 0: 0, step 194: 0.321, ...' for the log."""
    return ", ".join(f"step {s}: {lr:.3g}" for s, lr in sample_points(schedule))


class _OnStep(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule read at the run's step counter instead of the optimizer's own
    iteration count: every optimizer of a state (a GAN's two, one that updates
    every other step) follows the run's schedule at the run's step."""

    def __init__(self, schedule, step: tf.Variable):
        self.schedule = schedule
        self._step = lambda: step  # (not an attribute an optimizer would track)

    def __call__(self, iterations) -> tf.Tensor:
        return self.schedule(self._step())

    def get_config(self) -> dict:
        return self.schedule.get_config()


def on_step(schedule, step: tf.Variable | None):
    """`schedule` (or a constant) read at `step`; as it is without a step."""
    if step is None or not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule
    return _OnStep(schedule, step)
