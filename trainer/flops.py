"""How much arithmetic a training step does, and how much this device can do: the
FLOPs per training image of a model (counted once, from its forward graph) and the
device's measured matmul peak. The loop shows their product with the image rate as
GFLOP/s in every log line; trainer.tools.benchmark compares them side by side."""
import time
from typing import Callable

import keras
import tensorflow as tf


def training_flops_per_image(make_model: Callable[[], keras.Model],
                             shape: tuple[int, ...]) -> float:
    """3 x the forward pass's float ops (the backward pass is about twice the
    forward) of a fresh model from `make_model` (the run's own builder)."""
    return 3.0 * forward_flops_per_image(make_model, shape)


def forward_flops_per_image(make_model: Callable[[], keras.Model],
                            shape: tuple[int, ...]) -> float:
    """The float ops of one forward pass of a fresh model from `make_model`,
    counted by TF's profiler on the frozen inference graph at batch 1.
    Multiply-adds count 2, as in the speed records' FLOP counts."""
    from tensorflow.python.framework import convert_to_constants
    from tensorflow.python.util import deprecation
    model = make_model()
    forward = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((1, *shape), tf.float32))
    graph = convert_to_constants.convert_variables_to_constants_v2(forward).graph
    profile_options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    profile_options["output"] = "none"
    with deprecation.silence():  # the v1 profiler warns about its own internals
        info = tf.compat.v1.profiler.profile(graph=graph, options=profile_options)
    return float(info.total_float_ops)


def forward_flops_of(model: keras.Model) -> float:
    """The float ops of one forward pass of `model` (counted on a fresh copy: the
    same architecture, new weights), per example of its own input shape."""
    shape = tuple(model.inputs[0].shape[1:])
    return forward_flops_per_image(lambda: keras.models.clone_model(model), shape)


def peak_flops(precision: str, n: int = 2048, repeats: int = 20) -> float:
    """FLOP/s of n x n matmuls in the compute dtype of `precision`, best of 3, on
    the default device. The matmuls are chained (each uses the last one's result)
    and the inputs are arguments, so graph optimizations can neither fold nor
    merge them."""
    dtype = tf.bfloat16 if precision == "mixed_bfloat16" else (
        tf.float16 if precision == "mixed_float16" else tf.float32)
    x = tf.cast(tf.random.normal((n, n)), dtype)
    w = tf.cast(tf.random.normal((n, n)) / n ** 0.5, dtype)  # keeps the scale

    @tf.function
    def chain(x, w):
        for _ in range(repeats):
            x = tf.matmul(x, w)
        return tf.reduce_sum(tf.cast(x[:1], tf.float32))

    chain(x, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        float(chain(x, w))
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 * repeats / best


def run_peak_flops(precision: str, strategy: tf.distribute.Strategy,
                   device_kind: str) -> float:
    """The run's peak: the matmul peak measured on its first device, times the
    devices that compute side by side: every replica on GPUs and TPUs, one per
    worker on CPUs (logical CPU devices share the host's cores)."""
    devices = strategy.extended.worker_devices
    with tf.device(devices[0]):
        one_device = peak_flops(precision)
    workers = strategy.num_replicas_in_sync // len(devices)
    return one_device * workers * (len(devices) if device_kind != "cpu" else 1)
