"""Differentially private SGD (Abadi et al. 2016): every example's gradient clipped
to --l2_clip, the clipped gradients summed over the global batch, Gaussian noise of
standard deviation noise_multiplier x l2_clip added ONCE to the sum, then divided
by the global batch and applied.

One task file. Copy it into trainer/tasks/ (every module there is a task), then:

    python -m trainer.check_step --task=dp_sgd --model=convnet --model_size=tiny --dataset=synthetic --batch_size=32
    python -m trainer.main --task=dp_sgd --model=convnet --dataset=cifar10 --optimizer=sgd --learning_rate=0.5

Per-example gradients need a model without batch-norm (it mixes the examples):
convnet has none. They are taken one example at a time with tf.map_fn and
parallel_iterations=1, which is exact and reproducible; tf.vectorized_map is
faster but gave other bits on each run here (check_step's repeat run reports it),
and tape.jacobian ran out of memory. The noise is drawn from the step's seed, the
same on every replica (trainer/randomness.py): noise drawn per replica would be
added N times. The privacy budget (epsilon) is not computed here: the
dp-accounting package does it from the noise multiplier, the sampling rate and
the steps.
"""
import dataclasses

import tensorflow as tf

from trainer import randomness, step
from trainer.settings import check_range, setting
from trainer.tasks import base, classification


@dataclasses.dataclass(frozen=True)
class Settings(classification.Settings):
    l2_clip: float = setting(1.0, "dp_sgd: each example's gradient is clipped to this "
                             "L2 norm.")
    noise_multiplier: float = setting(1.0, "dp_sgd: the noise's standard deviation, "
                                      "in units of --l2_clip.")

    def __post_init__(self):
        super().__post_init__()
        check_range("l2_clip", self.l2_clip, 0, low_open=True)
        check_range("noise_multiplier", self.noise_multiplier, 0)


@base.register
class DPSGD(classification.Classification):
    name = "dp_sgd"
    Settings = Settings

    def clipped_gradient_sum(self, model, batch):
        """(this replica's sum of per-example gradients, each clipped to l2_clip;
        the per-example losses)."""
        variables = model.trainable_variables
        clip = self.settings.l2_clip

        def one(example):
            image, label = example
            with tf.GradientTape() as tape:
                logits = classification.logits_of(model(image[None], training=True))
                loss = classification.objective(label[None], logits)[0]
            gradients = tape.gradient(loss, variables,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            norm = tf.linalg.global_norm(gradients)
            scale = tf.minimum(clip / (norm + 1e-12), tf.ones_like(norm))
            return [g * tf.cast(scale, g.dtype) for g in gradients], loss

        signature = ([tf.TensorSpec(v.shape, v.dtype) for v in variables],
                     tf.TensorSpec([], batch["image"].dtype))
        per_example, losses = tf.map_fn(one, (batch["image"], batch["label"]),
                                        fn_output_signature=signature,
                                        parallel_iterations=1)
        return [tf.reduce_sum(g, axis=0) for g in per_example], losses

    def noise(self, state, gradients):
        """N(0, (noise_multiplier x l2_clip)^2) for each gradient, from the step's
        seed: the same numbers on every replica."""
        seed = randomness.step_seed(state, "dp noise")
        std = self.settings.noise_multiplier * self.settings.l2_clip
        return [std * tf.random.stateless_normal(
            g.shape, tf.random.experimental.stateless_fold_in(seed, i), dtype=g.dtype)
            for i, g in enumerate(gradients)]

    step_settings = ()  # its clipping is per example; none of the default step's

    def train_step(self, state, batch, options):
        model, optimizer = state.models["main"], state.optimizers["main"]
        summed, losses = self.clipped_gradient_sum(model, batch)
        summed = step.all_reduce_sum(summed)  # THE sum: every example's clipped gradient
        gradients = [(g + n) / options.batch_size  # noise once, then the global mean
                     for g, n in zip(summed, self.noise(state, summed))]
        grad_norm = tf.linalg.global_norm(gradients)
        finite = tf.math.is_finite(grad_norm)
        step.apply_or_skip(optimizer, gradients, model.trainable_variables, finite)
        count = tf.cast(tf.size(losses), losses.dtype)
        return {"loss": (tf.reduce_sum(losses), count),
                "grad_norm": step.per_step(grad_norm),
                "skipped": step.per_step(1.0 - tf.cast(finite, tf.float32))}
