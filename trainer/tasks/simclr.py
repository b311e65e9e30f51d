"""Contrastive self-supervised learning (SimCLR, Chen et al. 2020): two augmented
views of each image, and a loss that tells each view's partner from every other
view of the GLOBAL batch. No labels are read in training; evaluation is a kNN
classifier on the learned features.

    python -m trainer.main --task=simclr --model=resnet --dataset=cifar10

The input pipeline yields the two views (`training_batch`: SimCLR's crop, flip,
colour jitter, grey and, with --simclr_blur, blur), made inside tf.data from the
pipeline's own stateless seeds, so streaming, caching and exact resume hold. The
model is --model's features (the input of its classification head: any registered
classifier is a backbone) and a projection MLP; the loss (NT-Xent) compares every
view with the 2N views of the global batch of N images: each replica gathers the
others' projections with `all_gather` (whose gradient sums the replicas' upstream
gradients and hands each replica its slice), so 2 replicas compute what 1 does.

Evaluation: each test image's features against the training images' (computed
before each evaluation on every replica), cosine similarity, the k = --knn_k
nearest vote with weights exp(similarity / 0.1) (Wu et al. 2018, as SimCLR's
CIFAR-10 results): kNN accuracy, and as "loss" -log of the vote for the true class.
"""
import dataclasses

import keras
import numpy as np
import tensorflow as tf

import models
from data import augment
from trainer import step
from trainer.settings import ConfigError, check_range, setting
from trainer.tasks import base

KNN_TEMPERATURE = 0.1  # of the kNN vote's weights (Wu et al. 2018)


@dataclasses.dataclass(frozen=True)
class Settings:
    temperature: float = setting(0.5, "simclr: the NT-Xent temperature (0.5 for "
                                 "CIFAR-10, 0.1 for ImageNet in SimCLR).")
    projection_dim: int = setting(128, "simclr: the projection's output size.")
    projection_hidden: int = setting(512, "simclr: the projection MLP's hidden size.")
    crop_min_area: float = setting(0.08, "simclr: the smallest crop, as a fraction of "
                                   "the image's area.")
    jitter_strength: float = setting(0.5, "simclr: colour jitter strength s (factors "
                                     "1 +- 0.8 s, hue +- 0.2 s; 0.5 for CIFAR-10, 1 "
                                     "for ImageNet).")
    simclr_blur: bool = setting(False, "simclr: also blur half the views (SimCLR's "
                                "ImageNet views; not its CIFAR-10 ones).")
    knn_k: int = setting(200, "simclr: neighbours of the kNN evaluation.")

    def __post_init__(self):
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("projection_dim", self.projection_dim, 1)
        check_range("projection_hidden", self.projection_hidden, 1)
        check_range("crop_min_area", self.crop_min_area, 0, 1, low_open=True)
        check_range("jitter_strength", self.jitter_strength, 0)
        check_range("knn_k", self.knn_k, 1)


def _unit(x: tf.Tensor) -> tf.Tensor:
    return tf.math.l2_normalize(x, axis=-1)


def _unit_features(state, batch: dict) -> dict[str, tf.Tensor]:
    """The main model's features of batch["image"] (evaluation mode), unit length."""
    features = state.models["main"](batch["image"], training=False)["features"]
    return {"features": _unit(tf.cast(features, tf.float32))}


def nt_xent(z1: tf.Tensor, z2: tf.Tensor, all_z1: tf.Tensor, all_z2: tf.Tensor,
            offset: tf.Tensor, temperature: float) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-example NT-Xent of this replica's b images (projections z1, z2 [b, d],
    unit length) against the global batch's 2N views (all_z1, all_z2 [N, d]);
    this replica's images are all_z[offset:offset + b]. Returns (the loss of each
    image, the mean of its two views' [b]; whether each view's nearest other view
    is its partner [2b])."""
    b = tf.shape(z1)[0]
    everyone = tf.concat([all_z1, all_z2], axis=0)  # [2N, d]
    total = tf.shape(all_z1)[0]
    mine = offset + tf.range(b)
    queries = tf.concat([z1, z2], axis=0)  # [2b, d]
    logits = tf.matmul(queries, everyone, transpose_b=True) / temperature  # [2b, 2N]
    self_index = tf.concat([mine, mine + total], axis=0)
    partner = tf.concat([mine + total, mine], axis=0)
    logits -= 1e9 * tf.one_hot(self_index, 2 * total, dtype=logits.dtype)  # not itself
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(partner, logits)
    hit = tf.equal(tf.argmax(logits, axis=-1, output_type=partner.dtype), partner)
    return (loss[:b] + loss[b:]) / 2, tf.cast(hit, loss.dtype)


class SimCLRPresenter(base.Presenter):
    """The features (and their unit-length copy) when serving; predict prints
    their first values."""

    def serve(self, features) -> dict[str, tf.Tensor]:
        features = tf.cast(features, tf.float32)
        return {"features": features, "unit_features": _unit(features)}

    def report(self, served: dict, title: str, image: np.ndarray, example: dict | None,
               output_stem: str, top: int = 5) -> list[str]:
        features = served["features"]
        shown = ", ".join(f"{v:.3f}" for v in features[:top])
        return [title, f"  features ({features.shape[0]} values, norm "
                       f"{np.linalg.norm(features):.3f}): {shown}, ..."]


@base.register
class SimCLR(base.Task):
    name = "simclr"
    Settings = Settings
    batch_keys = ("view_1", "view_2")
    model_outputs = (models.LOGITS, models.HEADS)  # a classifier as the backbone
    best = base.Best("knn_accuracy", higher_is_better=True)
    presenter = SimCLRPresenter
    recipe = dict(model="resnet", dataset="cifar10", batch_size=512, optimizer="adamw",
                  learning_rate=2e-3, weight_decay=1e-4, lr_schedule="cosine",
                  warmup_epochs=1.0, epochs=20, eval_batch_size=1000)

    # --- the data ----------------------------------------------------------------------

    def training_batch(self, images, labels, key, standard, normalize) -> dict:
        """Two views of every image, each from its own half of the batch's key."""
        settings = self.settings
        views = {}
        for name, view_key in zip(("view_1", "view_2"), augment._seeds(key, 2)):
            view = augment.simclr_view(images, view_key, settings.crop_min_area,
                                       settings.jitter_strength, settings.simclr_blur)
            views[name], _ = normalize(view, labels)
        return {**views, "label": tf.cast(labels, tf.int32)}  # (labels: kNN only)

    # --- the state and the step ------------------------------------------------------

    def create_state(self, build):
        """--model's features (the input of its head) and a projection MLP, one
        model ("main") with {"features", "projection"} outputs, and its optimizer."""
        backbone = build.model()
        features = models.features_of(backbone).outputs[0]
        hidden = keras.layers.Dense(self.settings.projection_hidden, activation="relu",
                                    name="projection_hidden")(features)
        projection = keras.layers.Dense(self.settings.projection_dim,
                                        name="projection")(hidden)
        model = keras.Model(backbone.inputs, {"features": features,
                                              "projection": projection},
                            name=f"simclr_{backbone.name}")
        return build.state({"main": model}, {"main": build.optimizer(model)})

    def contrastive_loss(self, model: keras.Model, batch: dict):
        """(per-image NT-Xent over the global batch [b], metrics), on one replica."""
        # Both views in one forward pass (as SimCLR's own code): batch-norm sees the
        # 2b views at once, and moves its statistics once a step.
        both = model(tf.concat([batch["view_1"], batch["view_2"]], axis=0),
                     training=True)["projection"]
        z1, z2 = tf.split(_unit(both), 2, axis=0)
        if z1.dtype != tf.float64:
            z1, z2 = tf.cast(z1, tf.float32), tf.cast(z2, tf.float32)
        context = tf.distribute.get_replica_context()
        # The negatives: every replica's views (the gradient flows back to each).
        all_z1 = context.all_gather(z1, axis=0)
        all_z2 = context.all_gather(z2, axis=0)
        offset = context.replica_id_in_sync_group * tf.shape(z1)[0]
        loss, hits = nt_xent(z1, z2, all_z1, all_z2, offset, self.settings.temperature)
        return loss, {"contrastive_accuracy": (tf.reduce_sum(hits),
                                               tf.cast(tf.size(hits), hits.dtype))}

    # Micro-batches would gather each micro-batch's projections alone: not the
    # global batch's negatives.
    step_settings = tuple(s for s in step.SETTINGS if s != "grad_accum_steps")

    def train_step(self, state, batch: dict, options) -> dict[str, base.Metric]:
        """The default step (trainer/step.py: THE all-reduce, clipping, SAM, the
        skip of a non-finite update, Lookahead) on the contrastive loss."""
        model = state.models["main"]
        objective = step.Objective(lambda b: self.contrastive_loss(model, b),
                                   model.trainable_variables, (model,),
                                   state.optimizers["main"], "task simclr's loss")
        return step.train_step(state, self, batch, options, objective)

    # --- evaluation: kNN on the features -------------------------------------------------

    def before_evaluation(self, state, splits) -> None:
        """The training images' unit features and labels, on every replica."""
        bank = splits.map(_unit_features)  # (one function: traced once per run)
        with splits.strategy.scope():  # (a copy on every replica)
            if not hasattr(self, "_bank"):
                self._bank = tf.Variable(bank["features"], trainable=False,
                                         name="knn_bank")
                self._bank_labels = tf.Variable(bank["label"], trainable=False,
                                                name="knn_labels")
            else:
                self._bank.assign(bank["features"])
                self._bank_labels.assign(bank["label"])

    def eval_step(self, state, batch: dict) -> dict[str, base.Metric]:
        if not hasattr(self, "_bank"):
            raise ConfigError("task simclr evaluates with a kNN over the training "
                              "features: before_evaluation must run first")
        weights = tf.cast(batch["mask"], tf.float32)
        features = _unit_features(state, batch)["features"]
        similarity = tf.matmul(features, self._bank, transpose_b=True)  # [b, N]
        k = min(self.settings.knn_k, int(self._bank.shape[0]))
        top, index = tf.math.top_k(similarity, k)
        neighbours = tf.gather(self._bank_labels, index)  # [b, k]
        votes = tf.reduce_sum(tf.one_hot(neighbours, self.spec.num_classes)
                              * tf.exp(top / KNN_TEMPERATURE)[..., None], axis=1)
        votes /= tf.reduce_sum(votes, axis=-1, keepdims=True)
        labels = batch["label"]
        right = tf.cast(tf.equal(tf.argmax(votes, -1, output_type=labels.dtype), labels),
                        tf.float32)
        true_vote = tf.gather(votes, labels, batch_dims=1)
        count = tf.reduce_sum(weights)
        return {"loss": (tf.reduce_sum(-tf.math.log(true_vote + 1e-8) * weights), count),
                "knn_accuracy": (tf.reduce_sum(right * weights), count)}

    # --- what serving reads (its presenter above), the float ops of the log lines -----

    def predict(self, model: keras.Model, images: tf.Tensor):
        return model(images, training=False)["features"]

    def training_flops(self, state, forward, options) -> float:
        """Two views of each image, each forward and backward (3x the forward)."""
        return 6.0 * forward(state.models["main"])
