"""Times airbench's batch-norm + GELU pairs, forward and backward, three ways: Keras'
own layers, models/fused.py's batch-norm with Keras' GELU, and both of ours.

    python -m trainer.tools.fused_benchmark [--batch_size=1024] [--widths=32,64,128]

The shapes are the six BN+GELU of `airbench` at those widths (after each group's
first conv and its 2x2 pool, and after its second conv), mixed_bfloat16 as the
recipe trains; each round times every variant once, interleaved. Prints ms per
forward+backward pass.
"""
import sys
import time

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import airbench, fused  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_flag(FLAGS, flags.DEFINE_integer, "batch_size", 1024, "Images per batch.")
    cli.define_flag(FLAGS, flags.DEFINE_list, "widths", ["32", "64", "128"],
                    "airbench's three group widths (airbench_small's by default).")
    cli.define_flag(FLAGS, flags.DEFINE_integer, "rounds", 2, "Interleaved rounds.")
    cli.define_flag(FLAGS, flags.DEFINE_integer, "repeats", 8, "Passes timed per variant.")


def shapes(batch_size: int, widths: list[int]) -> list[tuple[int, int, int, int]]:
    """The BN inputs of airbench: 31x31 after the 2x2 whitening, halved by each pool."""
    sizes, size = [], 31
    for width in widths:
        size //= 2
        sizes += [(batch_size, size, size, width)] * 2
    return sizes


def time_pass(make_batch_norm, activation, input_shapes, repeats: int) -> float:
    """ms per forward+backward pass of BN -> activation over every shape."""
    inputs = [tf.Variable(tf.random.normal(shape)) for shape in input_shapes]
    norms = [make_batch_norm() for _ in input_shapes]

    @tf.function
    def one_pass():
        with tf.GradientTape() as tape:
            total = 0.0
            for x, norm in zip(inputs, norms):
                y = activation(norm(tf.cast(x, tf.bfloat16), training=True))
                total += tf.reduce_sum(tf.cast(y, tf.float32))
        variables = inputs + [v for norm in norms for v in norm.trainable_variables]
        return tape.gradient(total, variables)

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        one_pass()  # trace and warm up
        started = time.perf_counter()
        for _ in range(repeats):
            gradients = one_pass()
        gradients[0].numpy()
        return (time.perf_counter() - started) / repeats * 1000
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main(argv: list[str]) -> None:
    del argv
    input_shapes = shapes(FLAGS.batch_size, [int(w) for w in FLAGS.widths])
    options = dict(momentum=airbench.BN_MOMENTUM, epsilon=1e-12, scale=False)
    keras_gelu = lambda x: keras.activations.gelu(x, approximate=False)  # noqa: E731
    variants = {
        "Keras batch-norm + Keras GELU": (keras.layers.BatchNormalization, keras_gelu),
        "fused batch-norm + Keras GELU": (fused.BatchNormalization, keras_gelu),
        "fused batch-norm + fused GELU": (fused.BatchNormalization, fused.gelu),
    }
    print(f"| round | {' | '.join(variants)} |")
    print(f"| --- |{' ---: |' * len(variants)}")
    for round_index in range(FLAGS.rounds):
        times = [time_pass(lambda: layer(**options), activation, input_shapes,
                           FLAGS.repeats) for layer, activation in variants.values()]
        print(f"| {round_index + 1} | {' | '.join(f'{t:.1f} ms' for t in times)} |",
              flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main, FLAGS)
