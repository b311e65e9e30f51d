"""Where a profiled run's step spends its time, from the trace `--profile_steps`
wrote:

    python -m trainer.tools.profile_summary --logdir=runs/airbench_cifar10 [--top=15]

Reads the newest `*.xplane.pb` under LOGDIR (the TensorFlow profiler's trace, the
same file TensorBoard's Profile tab shows) and prints Markdown tables: the TF ops'
CPU time summed over the compute threads, by part of the step (convolutions,
batch-norm, activations, pooling, the loss, the optimizer and Lookahead, the rest),
forward and backward; the most expensive op types; and the input pipeline's busy
time on its own threads. On a CPU the ops of the two cores overlap, so shares are
of the summed op time, not of the wall clock.
"""
import collections
import os
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402


FLAGS = flags.FLAGS

# (part, words of which one must be in an op's name or type), first match wins.
PARTS = (
    ("optimizer + Lookahead", ("SGD/", "sgd/", "Adam", "adam", "optimizer", "lookahead",
                               "ResourceApply", "AssignVariableOp", "AssignSubVariableOp",
                               "AssignAddVariableOp")),
    ("batch-norm", ("batch_normalization", "FusedBatchNorm")),
    ("convolution", ("Conv2D",)),
    ("activation (GELU/ReLU)", ("activation", "Gelu", "Relu", "Erf")),
    ("pooling", ("MaxPool", "max_pooling", "AvgPool")),
    ("loss", ("crossentropy", "Softmax", "LogSoftmax")),
    ("gradient norm, clip, finite check", ("global_norm", "L2Loss", "IsFinite")),
)


def newest_trace(logdir: str) -> str:
    """The newest *.xplane.pb under logdir (a run's model_dir, or its train/)."""
    found = [os.path.join(root, name) for root, _, names in tf.io.gfile.walk(logdir)
             for name in names if name.endswith(".xplane.pb")]
    if not found:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {logdir}; train "
                                f"with --profile_steps=A,B first")
    # Each trace's directory is named by its time (2026_12_01_03_12_00): the newest
    # by that name, whichever run under logdir it belongs to.
    return max(found, key=lambda path: (os.path.basename(os.path.dirname(path)), path))


def _busy_time(events) -> int:
    """Picoseconds covered by the union of the events' intervals."""
    busy, end = 0, -1
    for start, stop in sorted((e.offset_ps, e.offset_ps + e.duration_ps) for e in events):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def summarize(path: str) -> dict:
    """{"parts": {part: {"forward": ps, "backward": ps}}, "types": {op type: ps},
    "input_pipeline": ps busy on tf.data threads, "window": ps of the trace}."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with tf.io.gfile.GFile(path, "rb") as f:
        space.ParseFromString(f.read())
    host = next(plane for plane in space.planes if plane.name == "/host:CPU")
    names = host.event_metadata
    parts = collections.defaultdict(lambda: {"forward": 0, "backward": 0})
    types = collections.Counter()
    input_pipeline, first, last = 0, None, 0
    for line in host.lines:
        if line.name.startswith("tf_data"):
            input_pipeline += _busy_time(line.events)
            continue
        for event in line.events:
            name = names[event.metadata_id].name
            start = line.timestamp_ns * 1000 + event.offset_ps
            first = start if first is None else min(first, start)
            last = max(last, start + event.duration_ps)
            if ":" not in name or "::" in name or "__inference" in name:
                continue  # not one TF op ("scope/name:Type") but a call around ops
            op_type = name.rsplit(":", 1)[1]
            part = next((part for part, words in PARTS
                         if any(word in name for word in words)), "other")
            direction = "backward" if ("gradient_tape" in name or "Grad" in op_type
                                       or "Backprop" in op_type) else "forward"
            parts[part][direction] += event.duration_ps
            types[op_type] += event.duration_ps
    return {"parts": dict(parts), "types": dict(types), "input_pipeline": input_pipeline,
            "window": (last - (first or 0))}


def markdown(summary: dict, top: int = 15) -> str:
    total = sum(sum(d.values()) for d in summary["parts"].values()) or 1
    ms = lambda ps: f"{ps / 1e9:,.0f}"  # noqa: E731
    rows = [f"Trace window {summary['window'] / 1e12:.1f} s; TF op time summed over "
            f"threads {total / 1e12:.1f} s; input pipeline busy (tf.data threads) "
            f"{summary['input_pipeline'] / 1e12:.1f} s.", "",
            "| part of the step | forward ms | backward ms | share of op time |",
            "| --- | ---: | ---: | ---: |"]
    for part, times in sorted(summary["parts"].items(), key=lambda kv: -sum(kv[1].values())):
        rows.append(f"| {part} | {ms(times['forward'])} | {ms(times['backward'])} | "
                    f"{100 * sum(times.values()) / total:.1f}% |")
    rows += ["", "| op type | ms | share |", "| --- | ---: | ---: |"]
    for op_type, ps in collections.Counter(summary["types"]).most_common(top):
        rows.append(f"| {op_type} | {ms(ps)} | {100 * ps / total:.1f}% |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    del argv
    try:
        path = newest_trace(FLAGS.logdir)
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")
    print(f"{path}\n")
    print(markdown(summarize(path), FLAGS.top))


if __name__ == "__main__":
    flags.DEFINE_string("logdir", None, "A run's model_dir (or any directory above its "
                        "trace).", required=True)
    flags.DEFINE_integer("top", 15, "How many op types to list.")
    cli.run(main)
