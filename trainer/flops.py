"""How much arithmetic a training step does, and how much this device can do: the
FLOPs per training image of a model (counted once, from its forward graph) and the
device's measured matmul peak. The loop shows their product with the image rate as
GFLOP/s in every log line; trainer.tools.benchmark compares them side by side."""
import time
from typing import Callable

from absl import logging
import keras
import numpy as np
import tensorflow as tf


def training_flops_per_image(make_model: Callable[[], keras.Model],
                             shape: tuple[int, ...]) -> float:
    """3 x the forward pass's float ops (the backward pass is about twice the
    forward) of a fresh model from `make_model` (the run's own builder)."""
    return 3.0 * forward_flops_per_image(make_model, shape)


def forward_flops_per_image(make_model: Callable[[], keras.Model],
                            shape: tuple[int, ...]) -> float:
    """The float ops of one forward pass of the model from `make_model`: its
    convolutions and matrix products, counted from the shapes of its graph traced
    at batch 1 (every shape known), a multiply-add counting 2 as in the speed
    records' FLOP counts. Elementwise work (batch-norm, activations, pooling) is
    left out: a few percent at most, and not what the matmul peak measures."""
    model = make_model()
    forward = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((1, *shape), tf.float32))
    total, unknown = _graph_flops(forward.graph)
    if unknown:
        logging.warning("%d convolution(s) or matmul(s) of %s have shapes not known "
                        "before running: not counted in its FLOPs", unknown, model.name)
    return float(total)


def _graph_flops(graph: tf.Graph) -> tuple[float, int]:
    """(the multiply-adds x 2 of every convolution and matrix product in `graph`
    and in the functions it calls, how many of them had unknown shapes)."""
    total, unknown = 0.0, 0
    for op in graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            # A tf.function inside the model (e.g. models/fused.py's GELU): its body.
            called = _called_graph(graph, op.get_attr("f").name)
            if called is not None:
                inner, inner_unknown = _graph_flops(called)
                total, unknown = total + inner, unknown + inner_unknown
            continue
        try:
            flops = _op_flops(op)
        except ValueError:  # a shape not known at tracing
            unknown += 1
            continue
        total += flops
    return total, unknown


def _called_graph(graph: tf.Graph, name: str) -> tf.Graph | None:
    """The graph of the function `name` that `graph` calls (None if not found)."""
    # Private: tests/test_private_apis.py fails loudly if an upgrade changes it.
    function = graph._get_function(name)  # noqa: SLF001
    return getattr(function, "graph", None)


def _known(tensor: tf.Tensor) -> list[int]:
    if not tensor.shape.is_fully_defined():
        raise ValueError(f"{tensor.name} has shape {tensor.shape}")
    return tensor.shape.as_list()


def _op_flops(op: tf.Operation) -> float:
    """2 x the multiply-adds of a convolution or matrix product (0 for any other
    op). ValueError if its shapes are not known."""
    if op.type in ("Conv2D", "Conv3D"):  # kernel [*window, in / groups, out]
        return 2.0 * np.prod(_known(op.outputs[0])) * np.prod(_known(op.inputs[1])[:-1])
    if op.type == "DepthwiseConv2dNative":  # kernel [*window, in, multiplier]
        return 2.0 * np.prod(_known(op.outputs[0])) * np.prod(_known(op.inputs[1])[:-2])
    if op.type in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):  # a transposed
        # convolution: each input value meets the whole kernel [*window, out, in]
        return 2.0 * np.prod(_known(op.inputs[2])) * np.prod(_known(op.inputs[1])[:-1])
    if op.type == "MatMul":
        a = _known(op.inputs[0])
        inner = a[0] if op.get_attr("transpose_a") else a[1]
        return 2.0 * np.prod(_known(op.outputs[0])) * inner
    if op.type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = _known(op.inputs[0])
        inner = a[-2] if op.get_attr("adj_x") else a[-1]
        return 2.0 * np.prod(_known(op.outputs[0])) * inner
    if op.type == "Einsum" and len(op.inputs) == 2:
        return 2.0 * np.prod(_known(op.outputs[0])) * _einsum_summed_size(op)
    return 0.0


def _einsum_summed_size(op: tf.Operation) -> int:
    """The product of the sizes of the labels an einsum sums over (in its inputs,
    not in its output): 'bij,bjk->bik' -> size of j."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    operands, output = equation.split("->")
    sizes = {}
    for labels, tensor in zip(operands.split(","), op.inputs):
        shape = _known(tensor)
        head, _, tail = labels.partition("...")
        for label, size in [*zip(head, shape), *zip(tail, shape[len(shape) - len(tail):])]:
            sizes[label] = size
    return int(np.prod([size for label, size in sizes.items() if label not in output]))


def forward_flops_of(model: keras.Model) -> float:
    """The float ops of one forward pass of `model`, per example of its own input
    shape: `model` itself traced at batch 1, never run (its weights and statistics
    untouched; a fresh copy cost a second more of start-up on xception)."""
    shape = tuple(model.inputs[0].shape[1:])
    return forward_flops_per_image(lambda: model, shape)


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
