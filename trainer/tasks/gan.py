"""A generative adversarial network (DCGAN, Radford et al. 2016): the generator
(--model, "main") learns to make images that the discriminator (--discriminator)
cannot tell from the training images. Two networks, two optimizers, and the step
of this file: a step of its own, written with trainer/step.py's pieces.

    python -m trainer.main --task=gan --fid_classifier_dir=runs/airbench_small_cifar10

One step, on one replica:
1. a latent vector per example, drawn from (--seed, the step, the example's index)
   (trainer/randomness.py: the same numbers however the batch is split), and the
   generator's one forward pass of the step, in training mode;
2. the discriminator's update: real images -> 1, the generated ones (stopped: no
   gradient into the generator) -> 0, the non-saturating loss, its mean over the
   GLOBAL batch, its gradient summed over the replicas once (step.summed_gradients);
3. the generator's update, through the discriminator just updated: its fakes ->
   1, the gradient taken down the same forward pass, summed over the replicas.
Each update is applied, or skipped if its summed gradient is not finite.

Evaluation: the discriminator's loss on the test images and as many generated
ones, and a Fréchet distance between the two sets' features in one of our own
trained classifiers (--fid_classifier_dir: a finished classification run on the
same data; its features are the input of its head, e.g. airbench's 256 pooled
channels). Over every test image (10,000 for CIFAR-10) and as many generated from
fixed latent vectors. It is not the Inception FID (no Inception weights here):
numbers compare only with the same classifier. The pictures show generated images;
predict writes a grid of them; the SavedModel maps latent vectors (or seeds) to
images.
"""
import dataclasses

import keras
import numpy as np
import tensorflow as tf

import models
from trainer import optimizers, randomness, step
from trainer.output import figures
from trainer.settings import ConfigError, setting
from trainer.tasks import base

EVAL_LATENTS = "evaluation latents"  # the fixed latent vectors' name (randomness)


@dataclasses.dataclass(frozen=True)
class Settings:
    discriminator: str = setting("dcgan_discriminator", "gan: the discriminator, a "
                                 "registered model with one logit.")
    discriminator_options: str = setting("", "gan: the discriminator's own options, "
                                         "'name=value,...' (as --model_options).")
    fid_classifier_dir: str = setting("", "gan: a finished classification run on the "
                                      "same data whose features give the Fréchet "
                                      "distance of evaluation (empty: no distance).")

    def __post_init__(self):
        if self.discriminator not in models.names():
            raise ConfigError(f"--discriminator={self.discriminator!r} is not a "
                              f"registered model; valid: {', '.join(models.names())}")


def _bce_with_logits(logits: tf.Tensor, real: bool) -> tf.Tensor:
    """Per-example binary cross-entropy against all-real (1) or all-fake (0):
    softplus(-logit) or softplus(logit)."""
    logits = tf.reshape(logits, [-1])
    return tf.nn.softplus(-logits if real else logits)


def frechet_distance(mean_a, cov_a, mean_b, cov_b) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^1/2), with the trace of the
    square root from the eigenvalues of S_a^1/2 S_b S_a^1/2 (symmetric), float64."""
    def sqrt_psd(matrix):
        values, vectors = np.linalg.eigh(matrix)
        return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
    root_a = sqrt_psd(cov_a)
    middle = np.linalg.eigvalsh(root_a @ cov_b @ root_a)
    trace_sqrt = np.sum(np.sqrt(np.clip(middle, 0, None)))
    return float(np.sum((mean_a - mean_b) ** 2) + np.trace(cov_a) + np.trace(cov_b)
                 - 2 * trace_sqrt)


class GanPresenter(base.Presenter):
    """Generated images: predict writes a grid of them, the SavedModel maps latent
    vectors (or seeds) to images, the pictures show them."""
    serves_images = False
    tiles_per_sample = 2  # generated images shown per eval sample

    def generate(self, model: keras.Model, count: int, seed: int = 0) -> np.ndarray:
        """`count` uint8 images from fixed latent vectors (eager)."""
        latent = randomness.fixed_per_example(
            randomness.fixed_seed(seed, EVAL_LATENTS), tf.range(count),
            model.inputs[0].shape[1:])
        return self.serve(model(latent, training=False))["image"].numpy()

    def serve(self, generated) -> dict[str, tf.Tensor]:
        pixels = (tf.cast(generated, tf.float32) + 1.0) * 127.5
        return {"image": tf.cast(tf.clip_by_value(tf.round(pixels), 0, 255), tf.uint8)}

    def export_functions(self, model: keras.Model, image_functions: dict) -> dict:
        """serving_default(latent: float32 [N, latent_dim]) and
        generate_from_seed(seeds: int32 [N]) -> {"image": uint8 [N, H, W, C]}."""
        latent_shape = model.inputs[0].shape[1:]

        def from_latent(latent):
            return self.serve(model(latent, training=False))

        def from_seed(seeds):
            latent = tf.map_fn(
                lambda s: randomness.fixed_per_example(
                    tf.stack([tf.cast(s, tf.int64), tf.constant(0, tf.int64)]),
                    tf.zeros([1], tf.int32), latent_shape)[0],
                seeds, fn_output_signature=tf.TensorSpec(latent_shape, tf.float32))
            return from_latent(latent)

        return {"serving_default": (from_latent, [tf.TensorSpec([None, *latent_shape],
                                                                tf.float32, name="latent")]),
                "generate_from_seed": (from_seed, [tf.TensorSpec([None], tf.int32,
                                                                 name="seeds")])}

    def report_generated(self, model: keras.Model, output_stem: str, count: int,
                         seed: int) -> list[str]:
        images = self.generate(model, count, seed)
        columns = int(np.ceil(np.sqrt(count)))
        rows = int(np.ceil(count / columns))
        height, width, channels = images.shape[1:]
        grid = np.zeros((rows * height, columns * width, channels), np.uint8)
        for i, image in enumerate(images):
            r, c = divmod(i, columns)
            grid[r * height:(r + 1) * height, c * width:(c + 1) * width] = image
        path = f"{output_stem}.png"
        figures.write_png(path, grid)
        return [f"  {count} generated images ({width}x{height}, {rows}x{columns} grid): "
                f"{path}"]

    def sample_predictions(self, model: keras.Model, samples: dict) -> dict:
        return {**samples, "generated": self.generate(
            model, len(samples["image"]) * self.tiles_per_sample)}

    def draw_samples(self, figure, samples: dict) -> None:
        images = samples["generated"]
        figures.image_grid(figure, images, [""] * len(images), columns=10)

    def report(self, served, title, image, example, output_stem, top=5) -> list[str]:
        raise ConfigError("a gan run generates its images: predict takes no image")


@base.register
class Gan(base.Task):
    name = "gan"
    Settings = Settings
    batch_keys = ("image",)
    model_outputs = (models.GENERATOR,)
    step_settings = ()  # its two updates carry out none of the default step's settings
    best = base.Best("loss")
    presenter = GanPresenter
    recipe = dict(model="dcgan", dataset="cifar10", batch_size=128, optimizer="adam",
                  learning_rate=2e-4, optimizer_options="beta_1=0.5",
                  lr_schedule="constant", warmup_epochs=0.0, epochs=20, augment="flip")

    def __init__(self, settings, spec, input_shape):
        super().__init__(settings, spec, input_shape)
        if settings.fid_classifier_dir:  # the distance picks the best weights
            self.best = base.Best("fid")

    # --- the state and the step ------------------------------------------------------

    def create_state(self, build):
        """The generator ("main") and the discriminator, an optimizer each (the
        run's: --optimizer, --learning_rate, the schedule at the run's step), and
        the frozen classifier of the Fréchet distance."""
        generator = build.model()
        state_models = {"main": generator}
        state_optimizers = {"main": build.optimizer(generator)}
        if build.purpose != "serve":
            discriminator = build.model(self.settings.discriminator, num_classes=1,
                                        options=self.settings.discriminator_options)
            state_models["discriminator"] = discriminator
            state_optimizers["discriminator"] = build.optimizer(discriminator)
            if self.settings.fid_classifier_dir:
                # The features of a finished classification run on the same data.
                state_models["fid_classifier"] = build.frozen(models.features_of(
                    build.finished_classifier(self.settings.fid_classifier_dir,
                                              "--fid_classifier_dir",
                                              "final")))
        return build.state(state_models, state_optimizers)

    def to_model_input(self, generated: tf.Tensor) -> tf.Tensor:
        """Generator output (tanh, [-1, 1]) -> the data's normalized input space (in
        the output's dtype: float64 in check_step)."""
        pixels = (generated + 1.0) / 2.0
        mean = tf.constant(self.spec.mean, pixels.dtype)
        std = tf.constant(self.spec.std, pixels.dtype)
        return (pixels - mean) / std

    def train_step(self, state, batch: dict, options) -> dict[str, base.Metric]:
        generator, discriminator = state.models["main"], state.models["discriminator"]
        g_optimizer, d_optimizer = (state.optimizers["main"],
                                    state.optimizers["discriminator"])
        real = batch["image"]
        latent = randomness.per_example_normal(
            state, batch, "latent", generator.inputs[0].shape[1:], real.dtype)
        with tf.GradientTape() as g_tape:
            # 1. The generator's one pass of the step (its batch-norm moves once).
            fake = tf.cast(self.to_model_input(generator(latent, training=True)),
                           real.dtype)

            # 2. The discriminator: real -> 1, generated (stopped) -> 0. Its loss is
            # a mean over the GLOBAL batch, its gradient summed over the replicas.
            d_objective = step.Objective(
                lambda b: self.discriminator_loss(discriminator, b),
                discriminator.trainable_variables, (discriminator,), d_optimizer,
                "task gan's discriminator loss")
            with g_tape.stop_recording():  # (its own tape: nothing for the generator)
                d_gradients, sums = step.summed_gradients(
                    d_objective, {"image": real, "fake": tf.stop_gradient(fake)},
                    options)
                d_norm = tf.linalg.global_norm(d_gradients)
                d_finite = tf.math.is_finite(d_norm)
                step.apply_or_skip(d_optimizer, d_gradients, d_objective.variables,
                                   d_finite)

            # 3. The generator, through the discriminator just updated: fakes -> 1.
            g_per_example = _bce_with_logits(discriminator(fake, training=True), True)
            g_loss = g_optimizer.scale_loss(step.global_mean(g_per_example, options))
        g_gradients = g_tape.gradient(g_loss, generator.trainable_variables,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
        g_gradients = optimizers.unscale(g_optimizer,
                                         step.all_reduce_sum(g_gradients))  # THE sum
        g_norm = tf.linalg.global_norm(g_gradients)
        g_finite = tf.math.is_finite(g_norm)
        step.apply_or_skip(g_optimizer, g_gradients, generator.trainable_variables,
                           g_finite)
        count = tf.cast(tf.size(g_per_example), g_per_example.dtype)
        both = tf.cast(tf.logical_and(d_finite, g_finite), tf.float32)
        return {**sums,  # "loss": the discriminator's
                "g_loss": (tf.reduce_sum(g_per_example), count),
                "grad_norm": step.per_step(d_norm), "g_grad_norm": step.per_step(g_norm),
                "skipped": step.per_step(1.0 - both)}

    @staticmethod
    def discriminator_loss(discriminator: keras.Model, batch: dict):
        """(per-example loss: real "image" -> 1, "fake" -> 0; metrics), per replica
        (the step averages it over the global batch)."""
        real_logits = discriminator(batch["image"], training=True)
        fake_logits = discriminator(batch["fake"], training=True)
        loss = _bce_with_logits(real_logits, True) + _bce_with_logits(fake_logits, False)
        scored = tf.cast(tf.size(loss), loss.dtype)
        return loss, {"d_real": (tf.reduce_sum(tf.sigmoid(real_logits)), scored),
                      "d_fake": (tf.reduce_sum(tf.sigmoid(fake_logits)), scored)}

    def eval_step(self, state, batch: dict) -> dict[str, base.Metric]:
        """The discriminator's loss on the test images and as many generated from
        fixed latent vectors (one per test example, by its index), and the sums of
        both sets' classifier features (and their outer products) for the Fréchet
        distance."""
        generator = state.models["main"]
        discriminator = state.models["discriminator"]
        real, weights = batch["image"], tf.cast(batch["mask"], tf.float32)
        latent = randomness.fixed_per_example(
            randomness.fixed_seed(state.seed, EVAL_LATENTS), batch["index"],
            generator.inputs[0].shape[1:], real.dtype)
        fake = tf.cast(self.to_model_input(generator(latent, training=False)), real.dtype)
        metrics = self.discriminator_metrics(
            tf.cast(tf.reshape(discriminator(real, training=False), [-1]), tf.float32),
            tf.cast(tf.reshape(discriminator(fake, training=False), [-1]), tf.float32),
            weights)
        count = tf.reduce_sum(weights)
        if "fid_classifier" in state.models:
            classifier = state.models["fid_classifier"]
            for name, images in (("real", real), ("fake", fake)):
                features = tf.cast(classifier(images, training=False), tf.float32)
                weighted = features * weights[:, None]
                metrics[f"{name}_features"] = (tf.reduce_sum(weighted, 0), count)
                metrics[f"{name}_outer"] = (tf.matmul(weighted, features,
                                                      transpose_a=True), count)
        return metrics

    @staticmethod
    def discriminator_metrics(real_logits: tf.Tensor, fake_logits: tf.Tensor,
                              weights: tf.Tensor) -> dict[str, base.Metric]:
        """Evaluation's "loss" (the discriminator's, on the test images and as many
        generated) and its mean verdicts, from its float32 logits [B]."""
        loss = _bce_with_logits(real_logits, True) + _bce_with_logits(fake_logits, False)
        count = tf.reduce_sum(weights)
        return {"loss": (tf.reduce_sum(loss * weights), count),
                "d_real": (tf.reduce_sum(tf.sigmoid(real_logits) * weights), count),
                "d_fake": (tf.reduce_sum(tf.sigmoid(fake_logits) * weights), count)}

    def finish_evaluation(self, result: dict) -> dict:
        """The Fréchet distance from the summed features (then dropped)."""
        if "real_features" not in result:
            return result
        n = result["test_examples"]
        moments = {}
        for name in ("real", "fake"):
            total = np.asarray(result.pop(f"{name}_features"), np.float64)
            outer = np.asarray(result.pop(f"{name}_outer"), np.float64)
            mean = total / n
            moments[name] = (mean, (outer - n * np.outer(mean, mean)) / (n - 1))
        result["test_fid"] = frechet_distance(*moments["real"], *moments["fake"])
        return result

    def training_flops(self, state, forward, options) -> float:
        """Per example: the generator forward and backward (3x its forward pass),
        the discriminator forward and backward on the real and on the generated
        image, and once more forward and backward for the generator's update."""
        return (3.0 * forward(state.models["main"])
                + 9.0 * forward(state.models["discriminator"]))
