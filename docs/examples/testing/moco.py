"""MoCo v2-style contrastive learning (He et al. 2020; Chen et al. 2020), one task
file: a query encoder trained by the optimizer, a key encoder that follows it by
momentum (never by a gradient), and a queue of the keys of past GLOBAL batches as
negatives, with its pointer. The example of docs/testing.md: test_moco.py beside
it tests this step with trainer.testing.

    python -m trainer.check_step --import=moco --task=moco --model=cifar_cnn --model_size=tiny --dataset=synthetic --batch_size=16
"""
import dataclasses

import keras
import tensorflow as tf

import models
from data import augment
from trainer import step
from trainer.settings import check_range, setting
from trainer.tasks import base


@dataclasses.dataclass(frozen=True)
class Settings:
    queue_size: int = setting(4096, "moco: keys kept as negatives (a multiple of the "
                              "global batch).")
    key_momentum: float = setting(0.99, "moco: the key encoder's momentum per step.")
    moco_temperature: float = setting(0.2, "moco: the softmax temperature.")
    moco_dim: int = setting(128, "moco: the projection's size.")

    def __post_init__(self):
        check_range("queue_size", self.queue_size, 1)
        check_range("key_momentum", self.key_momentum, 0, 1)
        check_range("moco_temperature", self.moco_temperature, 0, low_open=True)
        check_range("moco_dim", self.moco_dim, 1)


@base.register
class MoCo(base.Task):
    name = "moco"
    Settings = Settings
    model_outputs = (models.LOGITS,)  # any classifier: its features are the backbone
    step_settings = ()

    def training_batch(self, images, labels, key, standard, normalize) -> dict:
        """Two views of every image (SimCLR's augmentation), from the batch's key."""
        views = {}
        for name, view_key in zip(("query", "key"), augment._seeds(key, 2)):  # noqa: SLF001
            views[name], _ = normalize(augment.simclr_view(images, view_key), labels)
        return views

    def encoder(self, build) -> keras.Model:
        backbone = build.model()
        features = models.features_of(backbone).outputs[0]
        projection = keras.layers.Dense(self.settings.moco_dim, name="projection")(features)
        return keras.Model(backbone.inputs, projection, name="moco_encoder")

    def create_state(self, build):
        query, key = self.encoder(build), self.encoder(build)
        key.set_weights(query.get_weights())  # the key encoder starts as the query's
        queue = tf.math.l2_normalize(tf.random.stateless_normal(
            [self.settings.queue_size, self.settings.moco_dim], [build.data.seed, 0]), -1)
        return build.state(
            {"main": query, "key": build.frozen(key)},  # (frozen: no optimizer, no grad)
            {"main": build.optimizer(query)},
            {"queue": build.variable(queue, "queue"),
             "queue_pointer": build.variable(0, "queue_pointer", tf.int64)})

    def train_step(self, state, batch, options):
        query, key = state.models["main"], state.models["key"]
        queue, pointer = state.extras["queue"], state.extras["queue_pointer"]
        settings = self.settings
        # The keys of this replica's images, then of the GLOBAL batch: float32 at
        # least (all_gather refuses bfloat16), no gradient.
        keys = tf.math.l2_normalize(tf.stop_gradient(key(batch["key"], training=False)), -1)
        keys = tf.cast(keys, tf.float64 if keys.dtype == tf.float64 else tf.float32)
        all_keys = tf.distribute.get_replica_context().all_gather(keys, axis=0)

        def contrastive(b):
            q = tf.math.l2_normalize(query(b["query"], training=True), -1)
            q = tf.cast(q, keys.dtype)
            positive = tf.reduce_sum(q * keys, -1, keepdims=True)
            negative = tf.matmul(q, tf.cast(queue, keys.dtype), transpose_b=True)
            logits = tf.concat([positive, negative], -1) / settings.moco_temperature
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                tf.zeros(tf.shape(logits)[:1], tf.int32), logits)
            hits = tf.cast(tf.argmax(logits, -1) == 0, loss.dtype)
            count = tf.cast(tf.size(loss), loss.dtype)
            return loss, {"contrastive_accuracy": (tf.reduce_sum(hits), count)}

        objective = step.Objective(contrastive, query.trainable_variables, (query,),
                                   state.optimizers["main"], "task moco's loss")
        metrics = step.train_step(state, self, batch, options, objective)  # THE sum
        # AFTER the update: the key encoder follows the query encoder ...
        m = settings.key_momentum
        for mine, theirs in zip(key.weights, query.weights):
            mine.assign(m * mine + (1.0 - m) * tf.cast(theirs, mine.dtype))
        # ... and the global batch's keys replace the oldest in the queue.
        slots = (pointer + tf.range(tf.shape(all_keys)[0], dtype=tf.int64)) % settings.queue_size
        queue.assign(tf.tensor_scatter_nd_update(queue, slots[:, None],
                                                 tf.cast(all_keys, queue.dtype)))
        pointer.assign((pointer + tf.cast(tf.shape(all_keys)[0], tf.int64))
                       % settings.queue_size)
        return metrics

    def eval_step(self, state, batch):
        """How far the query's and the key's embeddings of a test image are apart."""
        q = tf.math.l2_normalize(state.models["main"](batch["image"], training=False), -1)
        k = tf.math.l2_normalize(state.models["key"](batch["image"], training=False), -1)
        weights = tf.cast(batch["mask"], tf.float32)
        distance = 1.0 - tf.cast(tf.reduce_sum(q * tf.cast(k, q.dtype), -1), tf.float32)
        return {"loss": (tf.reduce_sum(distance * weights), tf.reduce_sum(weights))}
