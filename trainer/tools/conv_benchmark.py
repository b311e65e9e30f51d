"""airbench's six 3x3 convolutions, each direction timed by oneDNN itself, in
TensorFlow and (with torch installed) in PyTorch beside it: where issue 20's
remaining speed gap is.

    python -m trainer.tools.conv_benchmark [--widths=64,256,256] [--batch_size=1024]
        [--sides=tf,torch] [--data_format=NHWC] [--repeats=10]

Both frameworks call oneDNN for bf16 convolutions on this CPU. Each side runs in
a process of its own with ONEDNN_VERBOSE=1 and times every forward, backward-data
and backward-weights op one at a time (nothing else running); the table is built
from oneDNN's own `exec` lines: the library's version, its threading runtime, the
kernel it chose and the median milliseconds per op, so both sides are measured by
the same clock in the same place. TF_NUM_INTRAOP_THREADS in the environment reaches
the TensorFlow side (the thread-pool experiment in BUILD.md).
"""
from collections import Counter
import json
import os
import statistics
import subprocess
import sys

from absl import flags

from trainer import cli

FLAGS = flags.FLAGS
DIRECTIONS = ("forward_training", "backward_data", "backward_weights")


def define_flags() -> None:
    cli.define_flag(FLAGS, flags.DEFINE_list, "widths", ["64", "256", "256"],
                    "airbench's three group widths (the full recipe's by default).")
    cli.define_flag(FLAGS, flags.DEFINE_integer, "batch_size", 1024, "Images per batch.")
    cli.define_flag(FLAGS, flags.DEFINE_list, "sides", ["tf", "torch"],
                    "tf, torch or both (torch: only where it imports).")
    cli.define_flag(FLAGS, flags.DEFINE_enum, "data_format", "NHWC",
                    "TensorFlow's layout (PyTorch runs channels_last, as the peer).",
                    enum_values=["NHWC", "NCHW"])
    cli.define_flag(FLAGS, flags.DEFINE_integer, "repeats", 10, "Ops timed per layer "
                    "and direction (after 2 untimed).")
    cli.define_flag(FLAGS, flags.DEFINE_string, "side", None, "Internal: run one side "
                    "in this process and print oneDNN's lines.")


def layers(widths: list[int]) -> list[tuple[int, int, int]]:
    """(size, in channels, out channels) of airbench's 3x3 convolutions: the first
    of each group before its 2x2 pool, the second after; 31x31 after the 2x2
    whitening (24 channels)."""
    shapes, size, channels = [], 31, 24
    for width in widths:
        shapes.append((size, channels, width))
        size //= 2
        shapes.append((size, width, width))
        channels = width
    return shapes


def _run_tf(shapes, batch: int, data_format: str, repeats: int) -> None:
    import tensorflow as tf
    strides = [1, 1, 1, 1]
    for size, cin, cout in shapes:
        def tensor(channels):
            shape = ([batch, size, size, channels] if data_format == "NHWC"
                     else [batch, channels, size, size])
            # variables, not constants: grappler would fold a constant's convolution
            return tf.Variable(tf.cast(tf.random.normal(shape), tf.bfloat16))
        x, dy = tensor(cin), tensor(cout)
        w = tf.Variable(tf.cast(tf.random.normal([3, 3, cin, cout]) * 0.1, tf.bfloat16))
        ops = [
            lambda: tf.raw_ops.Conv2D(input=x, filter=w, strides=strides, padding="SAME",
                                      data_format=data_format),
            lambda: tf.raw_ops.Conv2DBackpropInput(
                input_sizes=tf.shape(x), filter=w, out_backprop=dy, strides=strides,
                padding="SAME", data_format=data_format),
            lambda: tf.raw_ops.Conv2DBackpropFilter(
                input=x, filter_sizes=tf.shape(w), out_backprop=dy, strides=strides,
                padding="SAME", data_format=data_format),
        ]
        for op in ops:  # each a graph of one op (oneDNN's kernels run in graphs)
            function = tf.function(lambda op=op: tf.reduce_sum(tf.cast(op()[:1], tf.float32)))
            for _ in range(repeats + 2):
                function().numpy()


def _run_torch(shapes, batch: int, repeats: int) -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
    for size, cin, cout in shapes:
        def tensor(*shape):
            return torch.randn(*shape).to(memory_format=torch.channels_last).bfloat16()
        x, dy = tensor(batch, cin, size, size), tensor(batch, cout, size, size)
        w = (tensor(cout, cin, 3, 3) * 0.1).requires_grad_(True)
        x.requires_grad_(True)
        for _ in range(repeats + 2):
            y = torch.nn.functional.conv2d(x, w, padding=1)  # forward_training
            torch.autograd.grad(y, [x, w], dy)  # backward_data, backward_weights


def parse_verbose(output: str) -> dict:
    """oneDNN's version, runtime and, per (direction, problem), its kernel and the
    median ms of the timed ops (the first 2 of each are warm-up)."""
    info, times, kernels = {}, {}, {}
    for line in output.splitlines():
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or len(fields) < 4:
            continue
        if fields[2] == "info" and fields[3].startswith("oneDNN"):
            info["version"] = fields[3].split()[1]
        elif (fields[2] == "info" and fields[3] == "cpu" and len(fields) > 4
              and fields[4].startswith("runtime")):
            info["runtime"] = fields[4].split(":", 1)[1]
        elif (fields[2:4] == ["primitive", "exec"] and len(fields) > 8
              and fields[5] == "convolution"):
            key = (fields[7], fields[-2])
            times.setdefault(key, []).append(float(fields[-1]))
            kernels[key] = fields[6]
    ms = {key: statistics.median(values[2:] or values) for key, values in times.items()}
    return {**info, "ms": ms, "kernels": kernels}


def run_side(side: str, widths: list[int], batch_size: int, data_format: str,
             repeats: int) -> dict:
    """One side in its own process, oneDNN verbose; its parsed lines."""
    env = dict(os.environ, ONEDNN_VERBOSE="1", TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-m", "trainer.tools.conv_benchmark", f"--side={side}",
               f"--widths={','.join(map(str, widths))}", f"--batch_size={batch_size}",
               f"--data_format={data_format}", f"--repeats={repeats}"]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or [""])[-1]
        print(f"error: the {side} side failed: {tail}", file=sys.stderr)
        sys.exit(1)
    return parse_verbose(result.stdout + result.stderr)


def _problem(batch: int, size: int, cin: int, cout: int) -> str:
    return (f"mb{batch}_ic{cin}oc{cout}_ih{size}oh{size}kh3sh1dh0ph1_"
            f"iw{size}ow{size}kw3sw1dw0pw1")


def table(results: dict, shapes, batch: int) -> str:
    sides = list(results)
    lines = [f"{side}: oneDNN {r.get('version', '?')}, runtime {r.get('runtime', '?')}"
             for side, r in results.items()]
    lines += ["", "ms per op (each row once; the totals count repeated layers)", "",
              "| layer | direction | " + " | ".join(f"{s} ms" for s in sides)
              + (" | tf/torch |" if sides == ["tf", "torch"] else " |"),
              "| --- | --- |" + " ---: |" * (len(sides) + (sides == ["tf", "torch"]))]
    totals = {(side, d): 0.0 for side in sides for d in DIRECTIONS}
    for (size, cin, cout), count in Counter(shapes).items():
        problem = _problem(batch, size, cin, cout)
        name = f"{size}x{size} {cin}->{cout}" + (f" (x{count})" if count > 1 else "")
        for direction in DIRECTIONS:
            row = [results[s]["ms"].get((direction, problem)) for s in sides]
            for side, value in zip(sides, row):
                totals[(side, direction)] += count * (value or 0.0)
            cells = " | ".join("-" if v is None else f"{v:.1f}" for v in row)
            ratio = (f" | {row[0] / row[1]:.2f}" if sides == ["tf", "torch"]
                     and None not in row else "")
            lines.append(f"| {name} | {direction} | {cells}{ratio} |")
    for direction in DIRECTIONS:
        row = [totals[(s, direction)] for s in sides]
        ratio = f" | {row[0] / row[1]:.2f}" if sides == ["tf", "torch"] and row[1] else ""
        lines.append(f"| **all six** | {direction} | "
                     + " | ".join(f"{v:.1f}" for v in row) + f"{ratio} |")
    kernels = sorted({(s, d, k) for s, r in results.items()
                      for (d, _), k in r["kernels"].items()})
    lines += ["", "kernels: " + "; ".join(f"{s} {d}: {k}" for s, d, k in kernels)]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    widths = [int(w) for w in FLAGS.widths]
    shapes = layers(widths)
    if FLAGS.side == "tf":
        return _run_tf(shapes, FLAGS.batch_size, FLAGS.data_format, FLAGS.repeats)
    if FLAGS.side == "torch":
        return _run_torch(shapes, FLAGS.batch_size, FLAGS.repeats)
    unknown = set(FLAGS.sides) - {"tf", "torch"}
    if unknown:
        print(f"error: --sides={','.join(FLAGS.sides)}: the sides are tf and torch",
              file=sys.stderr)
        sys.exit(2)
    sides = list(FLAGS.sides)
    if "torch" in sides and subprocess.run([sys.executable, "-c", "import torch"],
                                           capture_output=True).returncode != 0:
        print("torch does not import here (pip install -e \".[peer]\"): TensorFlow only",
              file=sys.stderr)
        sides.remove("torch")
    results = {side: run_side(side, widths, FLAGS.batch_size, FLAGS.data_format,
                              FLAGS.repeats) for side in sides}
    report = table(results, shapes, FLAGS.batch_size)
    print(report)
    print(json.dumps({side: {"version": r.get("version"), "runtime": r.get("runtime")}
                      for side, r in results.items()}))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
