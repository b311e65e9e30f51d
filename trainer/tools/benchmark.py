"""Training throughput, side by side in one process:

    python -m trainer.tools.benchmark --model=cifar_cnn --batch_size=1024 [--steps=10 --rounds=3]

Cases (all the same model and global batch, on this machine's default device):
ours (in-memory batches), Keras model.fit at the same precision and XLA setting,
ours fed by the real input pipeline (TFDS + augmentation) cached in memory, and
streamed from the files (--cache=none: decoded on the fly), ours with
--steps_per_loop=1, ours in the other precision, ours with XLA toggled. The cases run
interleaved, round after round, so drifting machine load hits all of them alike;
the table gives the median over rounds. FLOPs per training image are counted from
the forward graph (TF's profiler, float ops of the inference graph at batch 1) times
3 (the backward pass is about twice the forward), and compared with this machine's
peak measured in the same run: a 2048x2048 matmul in the same precision.
Prints a Markdown table and writes JSON (--output). --cpu_replicas=2 runs our cases
on 2 logical CPU devices (MirroredStrategy; model.fit then runs on the same strategy).
"""
import dataclasses
import functools
import statistics
import sys
import time
import types

from trainer import cli  # noqa: E402

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files, sources  # noqa: E402
import models  # noqa: E402
from trainer import build, distributed, inputs  # noqa: E402
from trainer.flops import peak_flops, training_flops_per_image  # noqa: E402
from trainer.config import Config, ModelSettings  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Case:
    key: str             # for --cases
    name: str
    runner: str          # "ours" | "fit" | "input" (the pipeline alone, no step)
    precision: str
    jit: bool
    steps_per_loop: int = 10
    data: str = "memory"  # "memory" | "pipeline" (cached) | "stream"


def _in_memory(shape, num_classes: int, batch: int, as_dict: bool = True
               ) -> tf.data.Dataset:
    images = tf.random.stateless_normal((batch, *shape), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), (3, 4), maxval=num_classes,
                                         dtype=tf.int32)
    element = {"image": images, "label": labels} if as_dict else (images, labels)
    return tf.data.Dataset.from_tensors(element).repeat()


class Runner:
    """One case, built once; run(steps) trains that many steps and returns seconds.
    Ours is built as trainer.main builds a run (trainer/build.py: the task, model,
    optimizer and step), with Adam 1e-3; model.fit gets the same model and a plain
    Keras Adam 1e-3 (fit sums the gradients itself)."""

    def __init__(self, case: Case, args, spec, shape):
        self.case, self.batch = case, args.batch_size
        keras.mixed_precision.set_global_policy(case.precision)
        keras.utils.set_random_seed(0)
        strategy = (strategy_lib.mirrored(tuple(args.devices)) if len(args.devices) > 1
                    else tf.distribute.OneDeviceStrategy("/cpu:0"))
        config = Config(model=args.model, model_size=args.model_size,
                        dataset=args.dataset, image_size=shape[0],
                        batch_size=self.batch, data_dir=args.data_dir, optimizer="adam",
                        learning_rate=1e-3, train_steps=args.steps,
                        cache="none" if case.data == "stream" else "memory")
        self.loop = None
        self.waited = 0.0  # seconds the timed steps waited for their input
        if case.runner == "input":  # how fast the streaming pipeline alone can feed
            _, train_examples = sources.load(spec, spec.train_split, args.data_dir)
            data = build.run_data(config, spec)
            mode, record_files, _ = inputs.choose_mode(data, train_examples)
            self.iterator = iter(inputs.train_input_fn(
                data, train_examples, mode=mode, files=record_files)(
                    tf.distribute.InputContext()))
        elif case.runner == "fit":
            with strategy.scope():
                task = build.make_task(config, spec)
                self.model = build.build_model(config.group(ModelSettings), shape, task)
                self.model.compile(optimizer=keras.optimizers.Adam(1e-3),
                                   jit_compile=case.jit,
                                   loss=keras.losses.SparseCategoricalCrossentropy(
                                       from_logits=True))
            self.dataset = _in_memory(shape, spec.num_classes, self.batch, as_dict=False)
        else:
            run = build.build_run(config, spec, build.plan(
                config, spec, strategy.num_replicas_in_sync), strategy, case.precision)
            self.loop = distributed.make_train_loop(strategy, run.train_steps, case.jit,
                                                     state=run.state)
            if case.data in ("pipeline", "stream"):  # exactly what trainer.main trains on
                _, train_examples = sources.load(spec, spec.train_split, args.data_dir)
                data = build.run_data(config, spec)
                mode, record_files, _ = inputs.choose_mode(data, train_examples)
                dataset = strategy.distribute_datasets_from_function(
                    inputs.train_input_fn(data, train_examples, mode=mode,
                                          files=record_files))
            else:
                dataset = strategy.experimental_distribute_dataset(
                    _in_memory(shape, spec.num_classes, self.batch))
            self.iterator = iter(dataset)
        keras.mixed_precision.set_global_policy("float32")

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        if self.case.runner == "input":  # timed over 10x the steps: else the batches
            for _ in range(10 * steps):   # prefetched between rounds are most of it
                next(self.iterator)["label"].numpy()
            return (time.perf_counter() - start) / 10
        if self.case.runner == "fit":
            timer = _StepTimer()
            self.model.fit(self.dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                           callbacks=[timer])
            return timer.end - timer.start
        else:
            done, per_call = 0, self.case.steps_per_loop
            while done < steps:
                n = min(per_call, steps - done)
                sums, _ = self.loop(self.iterator, tf.constant(n), tf.constant(0.0))
                float(sums["loss"][0])  # waits for the steps
                self.waited += float(sums[distributed.INPUT_WAIT][0])
                done += n
        return time.perf_counter() - start


class _StepTimer(keras.callbacks.Callback):
    """fit()'s time from the first step's start to the last step's end: the per-call
    setup (data adapter, callbacks) is left out, as our loop's iterator is built once."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.end = time.perf_counter()


CASE_KEYS = ("ours", "fit", "pipeline", "stream", "input", "loop1", "precision", "xla")


def cases(precision: str, jit: bool, steps_per_loop: int,
          keys=CASE_KEYS) -> list[Case]:
    """The cases named by `keys`; "ours" (the baseline of every ratio) always runs."""
    other = "float32" if precision != "float32" else "mixed_bfloat16"
    every = [
        Case("ours", "ours", "ours", precision, jit, steps_per_loop),
        Case("fit", "model.fit", "fit", precision, jit),
        Case("pipeline", "ours, real input pipeline", "ours", precision, jit,
             steps_per_loop, "pipeline"),
        Case("stream", "ours, streaming input pipeline", "ours", precision, jit,
             steps_per_loop, "stream"),
        Case("input", "streaming input alone, no step", "input", precision, jit,
             steps_per_loop, "stream"),
        Case("loop1", "ours, steps_per_loop=1", "ours", precision, jit, 1),
        Case("precision", f"ours, {other}", "ours", other, jit, steps_per_loop),
        Case("xla", f"ours, XLA {'off' if jit else 'on'}", "ours", precision, not jit,
             steps_per_loop),
    ]
    return [case for case in every if case.key == "ours" or case.key in keys]


def runnable(chosen: list[Case], replicas: int, streamable: bool = True) -> list[Case]:
    """XLA steps fail on several logical CPU devices (trainer.strategy.resolve_jit);
    the input alone is one pipeline (one replica's); data without record files
    (generated, mocked) cannot stream."""
    return [case for case in chosen if not (case.jit and replicas > 1)
            and not (case.runner == "input" and replicas > 1)
            and (streamable or case.data != "stream")]


def measure(args) -> dict:
    spec = build.model_input_spec(sources.get_spec(args.dataset, args.data_dir), args.model)
    size = args.image_size or spec.image_shape[0]
    shape = (size, size, spec.image_shape[2])
    precision = strategy_lib.resolve_precision(args.precision, "cpu")
    chosen = cases(precision, args.jit_compile == "true", args.steps_per_loop, args.cases)
    streamable = sources.record_files(spec, spec.train_split, args.data_dir) is not None
    runners = [Runner(c, args, spec, shape)
               for c in runnable(chosen, len(args.devices), streamable)]
    for runner in runners:  # trace, fill caches and warm up before timing
        runner.run(max(2, runner.case.steps_per_loop))
    seconds = {r.case.name: [] for r in runners}
    for runner in runners:
        runner.waited = 0.0  # the timed rounds' only
    for _ in range(args.rounds):
        for runner in runners:
            seconds[runner.case.name].append(runner.run(args.steps))
    config = Config(model=args.model, model_size=args.model_size, dataset=args.dataset,
                    image_size=shape[0])
    flops = training_flops_per_image(
        lambda: build.build_model(config.group(ModelSettings), shape,
                                  build.make_task(config, spec)), shape)
    peaks = {p: peak_flops(p, args.peak_size)
             for p in {precision, "float32", "mixed_bfloat16"}}
    rows = []
    for runner in runners:
        rate = args.steps * args.batch_size / statistics.median(seconds[runner.case.name])
        rows.append({**dataclasses.asdict(runner.case), "images_per_second": rate,
                     "achieved_flops": rate * flops,
                     "fraction_of_peak": rate * flops / peaks[runner.case.precision],
                     "input_wait_fraction": runner.waited / sum(seconds[runner.case.name]),
                     "seconds_per_round": seconds[runner.case.name]})
    return {"model": args.model, "dataset": args.dataset, "image_shape": shape,
            "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
            "training_flops_per_image": flops, "peak_flops": peaks, "rows": rows}


def markdown(result: dict) -> str:
    base = result["rows"][0]["images_per_second"]
    lines = [f"{result['model']}, batch {result['batch_size']}, "
             f"{result.get('replicas', 1)} replica(s), "
             f"{result['image_shape'][0]}x{result['image_shape'][1]}: "
             f"{result['training_flops_per_image'] / 1e6:.0f} MFLOP per training image; "
             "peak " + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s"
                                 for p, v in sorted(result["peak_flops"].items())),
             "", "| case | precision | XLA | steps/loop | img/s | vs ours | GFLOP/s | "
             "of peak | input wait |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        step = row["runner"] != "input"  # the input alone has no FLOPs
        flops = (f"{row['achieved_flops'] / 1e9:.0f} | {100 * row['fraction_of_peak']:.0f}%"
                 if step else "- | -")
        lines.append(f"| {row['name']} | {row['precision']} | "
                     f"{'on' if row['jit'] else 'off'} | "
                     f"{row['steps_per_loop'] if row['runner'] == 'ours' else '-'} | "
                     f"{row['images_per_second']:,.0f} | "
                     f"{row['images_per_second'] / base:.2f} | {flops} | {_wait(row)} |")
    return "\n".join(lines)


def _wait(row: dict) -> str:
    if row["runner"] != "ours":
        return "-"
    return f"{100 * row['input_wait_fraction']:.0f}%"


def define_flags() -> None:
    """The benchmark's flags (cli.define_flag: in a process that also loaded
    trainer.main, as the tests do, the names they share are trainer.main's)."""
    cli.import_user_code(FLAGS, sys.argv)
    define = functools.partial(cli.define_flag, FLAGS)
    define(flags.DEFINE_string, "model", "cifar_cnn", f"Model: {'|'.join(models.names())}.")
    define(flags.DEFINE_enum, "model_size", "full", "tiny: the test variant.",
           enum_values=["full", "tiny"])
    define(flags.DEFINE_string, "dataset", "cifar10", "Dataset, as trainer.main's --dataset.")
    define(flags.DEFINE_integer, "batch_size", 1024, "Global batch size.")
    define(flags.DEFINE_integer, "image_size", 0, "Square image size (0: the dataset's).")
    define(flags.DEFINE_string, "precision", "auto",
           "auto|float32|mixed_bfloat16|mixed_float16.")
    define(flags.DEFINE_enum, "jit_compile", "false", "XLA for every case.",
           enum_values=["true", "false"])
    define(flags.DEFINE_integer, "steps_per_loop", 10, "Steps per tf.function call (ours).")
    define(flags.DEFINE_integer, "steps", 10, "Steps per timed round.")
    define(flags.DEFINE_integer, "rounds", 3, "Timed rounds (the table shows the median).")
    define(flags.DEFINE_integer, "cpu_replicas", 1, "Split the CPU into N devices and run "
           "N replicas (MirroredStrategy) for every case.")
    define(flags.DEFINE_string, "data_dir", None, "TFDS data dir.")
    define(flags.DEFINE_integer, "peak_size", 2048, "Matmul size for the peak FLOP/s.")
    define(flags.DEFINE_list, "cases", list(CASE_KEYS), "Subset of " + ",".join(CASE_KEYS)
           + " (ours always runs: it is the baseline).")
    define(flags.DEFINE_string, "output", "", "JSON file to write.")


def main(argv: list[str]) -> None:
    del argv
    unknown = set(FLAGS.cases) - set(CASE_KEYS)
    if unknown:
        print(f"error: unknown --cases {', '.join(sorted(unknown))}; valid: "
              f"{','.join(CASE_KEYS)}", file=sys.stderr)
        sys.exit(2)
    devices = (strategy_lib.split_cpu(FLAGS.cpu_replicas) if FLAGS.cpu_replicas > 1
               else ["/cpu:0"])
    args = types.SimpleNamespace(**{name: FLAGS[name].value for name in (
        "model", "model_size", "dataset", "batch_size", "image_size", "precision",
        "jit_compile", "steps_per_loop", "steps", "rounds", "data_dir", "peak_size",
        "cases")}, devices=devices)
    result = measure(args)
    result["replicas"] = len(devices)
    print(markdown(result))
    if FLAGS.output:
        files.write_json(FLAGS.output, result)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
