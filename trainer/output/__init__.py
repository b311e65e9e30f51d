"""What a run leaves for people to read: log lines, the live bar, metrics.json,
TensorBoard events and pictures. Only the chief writes."""
from typing import Any


def tensorboard_callbacks(config: Any) -> list:
    """The built-in TensorBoard callbacks (trainer/callbacks.py) of a run: its
    settings and final metrics (HParams, Text) always, weight and gradient
    histograms with --histograms."""
    from trainer.output import hparams, histograms  # (they import trainer.callbacks)
    return [hparams.HParams(), *([histograms.Histograms()] if config.histograms else [])]
