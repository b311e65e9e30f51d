"""Autoencoding: the model reconstructs its input image; no labels are read.

The loss is the per-pixel error between the reconstruction and the (augmented)
input, both mapped back to pixels in [0, 1]; PSNR (10 log10(1 / MSE) dB, per image,
averaged) is its readable twin. The best weights are those of the lowest test loss.
Pictures show inputs beside reconstructions; predict writes the reconstruction as
an image file; the exported SavedModel returns it as uint8 pixels.

    python -m trainer.main --task=autoencoder --dataset=cifar10
"""
import dataclasses

import numpy as np
import tensorflow as tf

import models
from trainer.output import figures
from trainer.settings import ConfigError, setting
from trainer.tasks import base


def psnr_of_pixels(image: np.ndarray, reconstruction: np.ndarray) -> float:
    """PSNR in dB between two uint8 images."""
    squared = np.mean((reconstruction.astype(np.float64) - image) ** 2)
    return float(10 * np.log10(255.0 ** 2 / max(squared, 1e-10)))


@dataclasses.dataclass(frozen=True)
class Settings:
    reconstruction_loss: str = setting("mse", "autoencoder: mse|l1, the per-pixel "
                                       "squared or absolute error on pixels in [0, 1].")

    def __post_init__(self):
        if self.reconstruction_loss not in ("mse", "l1"):
            raise ConfigError(f"--reconstruction_loss must be mse or l1, got "
                              f"{self.reconstruction_loss!r}")


class AutoencoderPresenter(base.Presenter):
    """The reconstruction as uint8 pixels; predict writes it as a PNG; the
    pictures show each input beside its reconstruction."""
    tiles_per_sample = 2  # the input and its reconstruction

    def serve(self, reconstruction) -> dict[str, tf.Tensor]:
        pixels = base.to_pixels(self.spec, tf.cast(reconstruction, tf.float32)) * 255.0
        return {"reconstruction": tf.cast(tf.clip_by_value(tf.round(pixels), 0, 255),
                                          tf.uint8)}

    def report(self, served: dict, title: str, image: np.ndarray, example: dict | None,
               output_stem: str, top: int = 5) -> list[str]:
        """Writes the reconstruction to output_stem.png; its PSNR against the input."""
        reconstruction = served["reconstruction"]
        path = f"{output_stem}.png"
        figures.write_png(path, reconstruction)
        return [title, f"  reconstruction: {path}  (PSNR "
                       f"{psnr_of_pixels(image, reconstruction):.2f} dB against the input "
                       f"at {image.shape[1]}x{image.shape[0]})"]

    def draw_samples(self, figure, samples: dict) -> None:
        """Each input beside its reconstruction, titled with its PSNR."""
        images, titles = [], []
        for image, reconstruction in zip(samples["image"], samples["reconstruction"]):
            images += [image, reconstruction]
            titles += ["input", f"{psnr_of_pixels(image, reconstruction):.1f} dB"]
        figures.image_grid(figure, np.stack(images), titles, columns=10)


@base.register
class Autoencoder(base.Task):
    name = "autoencoder"
    Settings = Settings
    batch_keys = ("image",)
    model_outputs = (models.IMAGE,)
    best = base.Best("loss", curve="psnr")
    presenter = AutoencoderPresenter
    recipe = dict(model="conv_autoencoder", dataset="cifar10", batch_size=256,
                  optimizer="adam", learning_rate=2e-3, lr_schedule="cosine",
                  warmup_epochs=0.5, epochs=10, augment="translate_flip")

    def _errors(self, images: tf.Tensor, reconstruction: tf.Tensor):
        """(the per-example loss, the per-example PSNR in dB), on [0, 1] pixels."""
        difference = (base.to_pixels(self.spec, tf.cast(reconstruction, images.dtype))
                      - base.to_pixels(self.spec, images))
        squared = tf.reduce_mean(tf.square(difference), axis=[1, 2, 3])
        psnr = 10.0 * tf.math.log(1.0 / tf.maximum(squared, 1e-10)) / np.log(10.0)
        if self.settings.reconstruction_loss == "l1":
            return tf.reduce_mean(tf.abs(difference), axis=[1, 2, 3]), psnr
        return squared, psnr

    def loss(self, batch: dict, reconstruction) -> tuple[tf.Tensor, dict[str, base.Metric]]:
        loss, psnr = self._errors(batch["image"], reconstruction)
        return loss, {"psnr": (tf.reduce_sum(psnr), tf.reduce_sum(tf.ones_like(psnr)))}

    def eval_metrics(self, batch: dict, reconstruction, weights: tf.Tensor
                     ) -> dict[str, base.Metric]:
        loss, psnr = self._errors(batch["image"], reconstruction)
        weights = tf.cast(weights, loss.dtype)
        count = tf.reduce_sum(weights)
        return {"loss": (tf.reduce_sum(loss * weights), count),
                "psnr": (tf.reduce_sum(psnr * weights), count)}
