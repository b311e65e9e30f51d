"""WGAN-GP (Gulrajani et al. 2017): a critic that estimates the Wasserstein
distance between the training images and the generated ones, kept 1-Lipschitz by
a gradient penalty, and a generator that lowers it. Two steps on a schedule
(`train_steps`): --critic_steps critic updates, then one generator update, again
and again. The generator, the critic (--discriminator: a model without
batch-norm, whose per-example gradients the penalty needs), the Fréchet distance
and the pictures are those of the `gan` task (trainer/tasks/gan.py).

    python -m trainer.main --task=wgan_gp --fid_classifier_dir=runs/airbench_small_cifar10

The critic's step, on one replica (every step of the schedule takes one batch):
1. a latent vector and an interpolation weight per example, drawn from (--seed,
   the step, the example's index), the same however the batch is split;
2. the generated images (no gradient into the generator), and the per-example
   loss critic(fake) - critic(real) + penalty * (||d critic(x) / dx|| - 1)^2 at
   x = e real + (1 - e) fake (each example's own gradient: the critic has no
   batch-norm, so it is the gradient of the sum);
3. its mean over the GLOBAL batch, the gradient summed over the replicas once
   (step.summed_gradients), one update (or none if not finite).
The generator's step: -critic(generated), the same way, the critic fixed.
Only the step that runs is computed: no gradient is taken to be thrown away, and
each optimizer counts its own updates (Adam's bias correction).

Evaluation: `loss` is the critic's estimate of the Wasserstein distance on the test
images and as many generated from fixed latent vectors (lower: closer), and the
Fréchet distance with --fid_classifier_dir (then the best weights are its).
"""
import dataclasses

import keras
import tensorflow as tf

from trainer import randomness, step
from trainer.settings import ConfigError, check_range, setting
from trainer.tasks import base, gan


@dataclasses.dataclass(frozen=True)
class Settings(gan.Settings):
    gradient_penalty: float = setting(10.0, "wgan_gp: the weight of the gradient "
                                      "penalty (||grad critic|| - 1)^2.")
    critic_steps: int = setting(5, "wgan_gp: critic updates per generator update.")

    def __post_init__(self):
        super().__post_init__()
        check_range("gradient_penalty", self.gradient_penalty, 0)
        check_range("critic_steps", self.critic_steps, 1)


def _has_batch_norm(model) -> bool:
    return any(isinstance(layer, keras.layers.BatchNormalization) or _has_batch_norm(layer)
               for layer in getattr(model, "layers", []))


def slope_norms(critic, images: tf.Tensor) -> tf.Tensor:
    """||d critic(x) / dx|| of each example [B], in the images' dtype: the gradient
    of the batch's summed score, which is each example's own because the critic
    mixes no examples (no batch-norm)."""
    with tf.GradientTape() as tape:
        tape.watch(images)
        scores = tf.reduce_sum(critic(images, training=True))
    slopes = tf.cast(tape.gradient(scores, images), images.dtype)
    return tf.sqrt(tf.reduce_sum(tf.square(slopes), axis=[1, 2, 3]) + 1e-12)


@base.register
class WganGp(gan.Gan):
    name = "wgan_gp"
    Settings = Settings
    step_settings = ()  # its two steps carry out none of the default step's settings
    recipe = dict(model="dcgan", dataset="cifar10", batch_size=64, optimizer="adam",
                  learning_rate=1e-4, optimizer_options="beta_1=0.0,beta_2=0.9",
                  lr_schedule="constant", warmup_epochs=0.0, epochs=20, augment="flip")

    def create_state(self, build):
        state = super().create_state(build)
        critic = state.models.get("discriminator")
        if critic is not None and _has_batch_norm(critic):
            raise ConfigError(f"--discriminator={self.settings.discriminator} has "
                              f"batch-norm, which mixes a batch's examples; WGAN-GP's "
                              f"gradient penalty needs each example's own gradient: give "
                              f"a critic without it (dcgan_discriminator)")
        return state

    def train_steps(self, plan) -> step.Steps:
        return step.Steps((("critic", self.critic_step, self.settings.critic_steps),
                           ("generator", self.generator_step, 1)))

    def _generated(self, state, batch: dict, dtype, training: bool = True):
        generator = state.models["main"]
        latent = randomness.per_example_normal(
            state, batch, "latent", generator.inputs[0].shape[1:], dtype)
        return tf.cast(self.to_model_input(generator(latent, training=training)), dtype)

    def critic_step(self, state, batch: dict, options) -> dict[str, base.Metric]:
        critic = state.models["discriminator"]
        real = batch["image"]
        # (the generator in training mode, as it generates in its own step; its
        # batch-norm statistics move with every step, the critic's steps too)
        fake = tf.stop_gradient(self._generated(state, batch, real.dtype))
        mix = randomness.per_example_uniform(state, batch, "interpolation", (1, 1, 1),
                                             dtype=real.dtype)
        between = mix * real + (1.0 - mix) * fake

        def critic_loss(inputs):
            real_score = tf.reshape(critic(inputs["real"], training=True), [-1])
            fake_score = tf.reshape(critic(inputs["fake"], training=True), [-1])
            penalty = tf.square(slope_norms(critic, inputs["between"]) - 1.0)
            real_score = tf.cast(real_score, real.dtype)
            fake_score = tf.cast(fake_score, real.dtype)
            count = tf.cast(tf.size(penalty), real.dtype)
            per_example = (fake_score - real_score
                           + self.settings.gradient_penalty * penalty)
            return per_example, {
                "wasserstein": (tf.reduce_sum(real_score - fake_score), count),
                "gradient_penalty": (tf.reduce_sum(penalty), count)}

        objective = step.Objective(critic_loss, critic.trainable_variables, (critic,),
                                   state.optimizers["discriminator"],
                                   "task wgan_gp's critic loss")
        return self._update(objective, {"real": real, "fake": fake, "between": between},
                            options, "critic")

    def generator_step(self, state, batch: dict, options) -> dict[str, base.Metric]:
        generator, critic = state.models["main"], state.models["discriminator"]
        dtype = batch["image"].dtype

        def generator_loss(_):
            fake = self._generated(state, batch, dtype)
            return -tf.cast(tf.reshape(critic(fake, training=True), [-1]), dtype), {}

        objective = step.Objective(generator_loss, generator.trainable_variables,
                                   (generator,), state.optimizers["main"],
                                   "task wgan_gp's generator loss")
        return self._update(objective, {}, options, "generator")

    @staticmethod
    def _update(objective: step.Objective, inputs: dict, options, who: str
                ) -> dict[str, base.Metric]:
        """One update of `objective` (THE all-reduce in summed_gradients), or none
        if its summed gradient is not finite; its metrics under `who`'s names."""
        gradients, sums = step.summed_gradients(objective, inputs, options)
        norm = tf.linalg.global_norm(gradients)
        finite = tf.math.is_finite(norm)
        step.apply_or_skip(objective.optimizer, gradients, objective.variables, finite)
        loss_total, count = sums.pop("loss")
        return {**sums, f"{who}_loss": (loss_total, count),
                f"{who}_grad_norm": step.per_step(norm),
                "skipped": step.per_step(1.0 - tf.cast(finite, tf.float32))}

    @staticmethod
    def discriminator_metrics(real_logits, fake_logits, weights):
        """The critic's estimate of the Wasserstein distance (lower: the generated
        images are closer), as evaluation's "loss"."""
        count = tf.reduce_sum(weights)
        return {"loss": (tf.reduce_sum((real_logits - fake_logits) * weights), count),
                "critic_real": (tf.reduce_sum(real_logits * weights), count),
                "critic_fake": (tf.reduce_sum(fake_logits * weights), count)}

    def training_flops(self, state, forward, options) -> float:
        """Per example, averaged over the schedule's cycle: a critic step runs the
        generator forward (1x), the critic forward and backward on the real and the
        generated image (2 x 3x) and on the interpolation with the gradient of its
        gradient (about 5x); the generator's step 3x both networks."""
        g, d = forward(state.models["main"]), forward(state.models["discriminator"])
        n = self.settings.critic_steps
        return (n * (g + 11.0 * d) + 3.0 * (g + d)) / (n + 1)
