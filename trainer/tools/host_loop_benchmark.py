"""What our loop costs a step beyond the step itself: steps per second of a tiny
model (cifar_cnn --model_size=tiny, Adam 1e-3, float32, batch 8, the in-memory
synthetic data), three ways, each in a process of its own, alternating:

- bare: a `tf.function` loop over `strategy.run` (forward, the loss summed over the
  replica's examples / the global batch, the gradient's all-reduce, Adam), N steps a
  call, fed our training pipeline (the same batches);
- fit: Keras `model.fit` with `steps_per_execution` = N, the same model and batches;
- ours: `python -m trainer.main`, the whole command, its outer loop included.

    python -m trainer.tools.host_loop_benchmark [--steps_per_loop=1,100]
        [--cpu_replicas=1,2] [--rounds=3] [--steps=1000] [--warmup_steps=200]

Each process times the steps after its first `warmup_steps` (start-up, tracing and
the first calls left out): the bare loop and fit from inside, ours from the
timestamps of its own log lines at the two steps (`--log_every`). Prints a Markdown
table of medians and the ratios ours/bare and ours/fit; --output writes the JSON.
A benchmark, not a test: run it on a quiet machine.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402
from trainer import build, inputs  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
from trainer.config import Config, ModelSettings  # noqa: E402
from trainer.output import startup  # noqa: E402

FLAGS = flags.FLAGS
CASES = ("bare", "fit", "ours")
# The run every case trains: what the "tiny step" means.
RUN_FLAGS = ("--model=cifar_cnn", "--model_size=tiny", "--dataset=synthetic",
             "--batch_size=8", "--optimizer=adam", "--learning_rate=0.001",
             "--precision=float32", "--jit_compile=false")
_LOG_TIME = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\bstep (\d+)/\d+ ")


def define_flags() -> None:
    define = lambda *args, **kwargs: cli.define_flag(FLAGS, *args, **kwargs)  # noqa: E731
    define(flags.DEFINE_list, "steps_per_loop", ["1", "100"], "Steps a call (each value).")
    define(flags.DEFINE_list, "cpu_replicas", ["1", "2"], "CPU replicas (each value).")
    define(flags.DEFINE_list, "cases", list(CASES), "Subset of " + ",".join(CASES))
    define(flags.DEFINE_integer, "rounds", 3, "Processes per case and setting.")
    define(flags.DEFINE_integer, "steps", 1000, "Timed steps a process.")
    define(flags.DEFINE_integer, "warmup_steps", 200, "Steps before the timing starts.")
    define(flags.DEFINE_list, "startup_models", [], "Instead: the time from the command "
           "to the first step, ours against a bare loop, for these models (e.g. "
           "xception,airbench,resnet50: batch 8, streamed data, see STARTUP_RUNS).")
    define(flags.DEFINE_string, "output", "", "JSON file to write.")
    define(flags.DEFINE_string, "model", "", "Internal: the start-up child's model.")
    # (one process's case: what the parent runs)
    define(flags.DEFINE_string, "child", "", "Internal: run one case, print its rate.")


def _child(case: str, steps_per_loop: int, replicas: int, warmup: int, steps: int) -> float:
    """One case in this process; returns the timed steps per second."""
    keras.utils.set_random_seed(0)
    devices = strategy_lib.split_cpu(replicas) if replicas > 1 else ["/cpu:0"]
    strategy = (strategy_lib.mirrored(tuple(devices)) if replicas > 1
                else tf.distribute.OneDeviceStrategy("/cpu:0"))
    config = Config(model="cifar_cnn", model_size="tiny", dataset="synthetic",  # RUN_FLAGS
                    image_size=32, batch_size=8, optimizer="adam", learning_rate=1e-3,
                    precision="float32", train_steps=warmup + steps)
    data = build.run_data(config)
    plan = build.plan(config, data.spec, replicas)
    task = build.make_task(config, data.spec)
    shape = data.image_shape
    batch = config.batch_size
    with strategy.scope():
        model = build.build_model(config.group(ModelSettings), shape, task)
        optimizer = keras.optimizers.Adam(1e-3)
    if case == "fit":
        train = inputs.train_input_fn(data, plan.train_examples, 0, warmup + steps + 1)(
            tf.distribute.InputContext()).map(lambda b: (b["image"], b["label"]))
        with strategy.scope():
            model.compile(optimizer=optimizer, steps_per_execution=steps_per_loop,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        marks = {}

        class Timer(keras.callbacks.Callback):
            def on_train_batch_end(self, index, logs=None):
                done = index + 1  # (called every steps_per_loop steps)
                if done >= warmup and "start" not in marks:
                    marks["start"], marks["from"] = time.perf_counter(), done
                marks["end"], marks["to"] = time.perf_counter(), done

        model.fit(train, steps_per_epoch=warmup + steps, epochs=1, verbose=0, shuffle=False,
                  callbacks=[Timer()])
        return (marks["to"] - marks["from"]) / (marks["end"] - marks["start"])
    pipelines = inputs.distribute(strategy, data, plan.train_examples, 0, warmup + steps)
    iterator = iter(pipelines.train)
    with strategy.scope():
        optimizer.build(model.trainable_variables)

    def step(batch):
        with tf.GradientTape() as tape:
            logits = model(batch["image"], training=True)
            loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
                batch["label"], logits, from_logits=True)) / batch_size
        gradients = tape.gradient(loss, model.trainable_variables)
        gradients = tf.distribute.get_replica_context().all_reduce("sum", gradients)
        optimizer.apply(gradients, model.trainable_variables)
        return loss

    batch_size = batch

    @tf.function
    def loop(iterator, n):
        for _ in tf.range(n):
            strategy.run(step, args=(next(iterator),))
        return tf.identity(optimizer.iterations)

    done = 0
    while done < warmup:
        loop(iterator, tf.constant(steps_per_loop)).numpy()
        done += steps_per_loop
    start, timed = time.perf_counter(), 0
    while timed < steps:
        loop(iterator, tf.constant(steps_per_loop)).numpy()
        timed += steps_per_loop
    return timed / (time.perf_counter() - start)


# Start-up: each model's run, at batch 8, its data streamed from the record files
# (no cache to fill: the bare loop has none either).
STARTUP_RUNS = {
    "xception": ("--dataset=tf_flowers", "--image_size=192"),
    "resnet50": ("--dataset=tf_flowers", "--image_size=224"),
    "airbench": ("--dataset=cifar10",),
    "cifar_cnn": ("--dataset=cifar10",),
}
_FIRST_STEPS = re.compile(r"Steps 1-1 done ([\d.]+) s after the command started: (.*)$")


def _startup_bare(model_name: str) -> dict:
    """A bare loop's start-up in this process: the model built as ours builds it,
    Adam, one in-memory batch of 8; the process's age when the first step is done."""
    imported = startup.process_age()
    flag_values = dict(f.split("=", 1) for f in STARTUP_RUNS[model_name])
    size = int(flag_values.get("--image_size", 32))
    config = Config(model=model_name, dataset=flag_values["--dataset"], image_size=size,
                    batch_size=8, precision="float32")
    data = build.run_data(config)
    task = build.make_task(config, data.spec)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = build.build_model(config.group(ModelSettings), data.image_shape, task)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    built = startup.process_age()
    images = tf.random.normal((8, *data.image_shape))
    labels = tf.zeros((8,), tf.int32)

    def step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            if isinstance(logits, dict):
                logits = logits["logits"] if "logits" in logits else next(iter(logits.values()))
            loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True)) / 8
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss

    @tf.function
    def one_step():
        return strategy.run(step, args=(images, labels))

    one_step().numpy()
    first_step = startup.process_age()
    return {"seconds": first_step, "phases": {
        "loading Python and TensorFlow": imported, "building": built - imported,
        "tracing and the first step": first_step - built}}


def _startup_ours(model_name: str) -> dict:
    """`python -m trainer.main --train_steps=1`, stopped once its first step's line
    (its start-up split) is written."""
    with tempfile.TemporaryDirectory() as model_dir:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer.main", f"--model={model_name}",
             *STARTUP_RUNS[model_name], "--batch_size=8", "--precision=float32",
             "--cache=none", "--train_steps=2", "--steps_per_loop=1",
             f"--model_dir={model_dir}"], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            for line in process.stderr:
                found = _FIRST_STEPS.search(line.rstrip())
                if found:
                    return {"seconds": float(found.group(1)), "phases": {
                        name: float(value) for name, value in
                        re.findall(r"(.+?) (\d+\.\d) s(?:, |$)", found.group(2))}}
        finally:
            process.kill()
            process.wait()
    raise RuntimeError(f"trainer.main --model={model_name} ended before its first step")


def _startup(models: list[str]) -> None:
    rows = {name: {"bare": [], "ours": []} for name in models}
    for round_index in range(FLAGS.rounds):
        for name in models:
            for side in ("bare", "ours")[::(-1) ** round_index]:
                if side == "ours":
                    result = _startup_ours(name)
                else:
                    output = subprocess.run(
                        [sys.executable, "-m", "trainer.tools.host_loop_benchmark",
                         "--child=startup", f"--model={name}"],
                        check=True, capture_output=True, text=True).stdout
                    result = json.loads(output.strip().splitlines()[-1])
                rows[name][side].append(result)
                print(f"{name}, {side}: first step {result['seconds']:.1f} s after the "
                      f"command started", file=sys.stderr, flush=True)
    lines = ["| model | bare: s to the first step | ours | ours/bare | ours, by phase "
             "(median run) |", "| --- | ---: | ---: | ---: | --- |"]
    for name, sides in rows.items():
        median = {side: statistics.median(r["seconds"] for r in runs)
                  for side, runs in sides.items()}
        middle = sorted(sides["ours"], key=lambda r: r["seconds"])[len(sides["ours"]) // 2]
        split = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds
                          in middle["phases"].items())
        lines.append(f"| {name} | {median['bare']:.1f} | {median['ours']:.1f} | "
                     f"{median['ours'] / median['bare']:.2f} | {split} |")
    print("\n".join(lines))
    if FLAGS.output:
        files.write_json(FLAGS.output, {"startup": rows})


def _seconds(line: str) -> tuple[float, int] | None:
    match = _LOG_TIME.match(line)
    if not match:
        return None
    hours, minutes, seconds, step = match.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds), int(step)


def _ours(steps_per_loop: int, replicas: int, warmup: int, steps: int) -> float:
    """`python -m trainer.main`, whole; the steps between its log lines at `warmup`
    and `warmup + steps` over the seconds between them."""
    if steps % warmup:  # (checked before the run: ours logs every `warmup` steps)
        raise ValueError("--steps must be a multiple of --warmup_steps (ours logs there)")
    with tempfile.TemporaryDirectory() as model_dir:
        subprocess.run(
            [sys.executable, "-m", "trainer.main", *RUN_FLAGS,
             f"--steps_per_loop={steps_per_loop}", f"--cpu_replicas={replicas}",
             f"--train_steps={warmup + steps}", f"--log_every={warmup}",
             "--eval_every=1000000", "--checkpoint_every=1000000",
             f"--model_dir={model_dir}"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with tf.io.gfile.GFile(os.path.join(model_dir, "log.txt")) as log:
            marks = dict(reversed(t) for t in map(_seconds, log) if t)
    return steps / (marks[warmup + steps] - marks[warmup])


def _run(case: str, steps_per_loop: int, replicas: int) -> float:
    if case == "ours":
        return _ours(steps_per_loop, replicas, FLAGS.warmup_steps, FLAGS.steps)
    output = subprocess.run(
        [sys.executable, "-m", "trainer.tools.host_loop_benchmark", f"--child={case}",
         f"--steps_per_loop={steps_per_loop}", f"--cpu_replicas={replicas}",
         f"--steps={FLAGS.steps}", f"--warmup_steps={FLAGS.warmup_steps}"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])["steps_per_second"]


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    if FLAGS.child == "startup":
        print(json.dumps(_startup_bare(FLAGS.model)), flush=True)
        os._exit(0)
    if FLAGS.startup_models:
        _startup(FLAGS.startup_models)
        return
    if FLAGS.child:
        rate = _child(FLAGS.child, int(FLAGS.steps_per_loop[0]), int(FLAGS.cpu_replicas[0]),
                      FLAGS.warmup_steps, FLAGS.steps)
        print(json.dumps({"steps_per_second": rate}), flush=True)
        # (not TensorFlow's shutdown: it can wait minutes in the training input
        # iterator's destructor, as trainer.main's _leave says)
        os._exit(0)
    unknown = set(FLAGS.cases) - set(CASES)
    if unknown:
        print(f"error: unknown --cases {', '.join(sorted(unknown))}; valid: "
              f"{','.join(CASES)}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for replicas in map(int, FLAGS.cpu_replicas):
        for steps_per_loop in map(int, FLAGS.steps_per_loop):
            rates: dict[str, list[float]] = {case: [] for case in FLAGS.cases}
            for round_index in range(FLAGS.rounds):
                order = FLAGS.cases[round_index % len(FLAGS.cases):] + FLAGS.cases[
                    :round_index % len(FLAGS.cases)]  # (each case first in turn)
                for case in order:
                    if rates[case] and rates[case][-1] is None:
                        continue  # (it failed: it fails again)
                    try:
                        rates[case].append(_run(case, steps_per_loop, replicas))
                    except subprocess.CalledProcessError as err:  # (Keras' fit on 2
                        rates[case].append(None)  # CPU devices at 100 steps/loop)
                        print(f"replicas {replicas}, steps/loop {steps_per_loop}, {case}: "
                              f"failed: {_last_error(err.stderr)}", file=sys.stderr)
                        continue
                    print(f"replicas {replicas}, steps/loop {steps_per_loop}, {case}: "
                          f"{rates[case][-1]:.1f} steps/s", file=sys.stderr, flush=True)
            rows.append({"replicas": replicas, "steps_per_loop": steps_per_loop,
                         "steps_per_second": rates})
    print(markdown(rows))
    if FLAGS.output:
        files.write_json(FLAGS.output, {"rows": rows, "run_flags": RUN_FLAGS,
                                        "steps": FLAGS.steps,
                                        "warmup_steps": FLAGS.warmup_steps})


def _last_error(stderr: str | None) -> str:
    lines = [line for line in (stderr or "").splitlines() if "Error" in line]
    return lines[-1][:300] if lines else "(no error line)"


def markdown(rows: list[dict]) -> str:
    lines = ["| replicas | steps/loop | " + " | ".join(
        f"{case} steps/s" for case in rows[0]["steps_per_second"]) + " | ours/bare | ours/fit |",
        "| ---: | ---: |" + " ---: |" * (len(rows[0]["steps_per_second"]) + 2)]
    for row in rows:
        median = {case: statistics.median(r) for case, r in row["steps_per_second"].items()
                  if r and None not in r}
        ratio = lambda other: (f"{median['ours'] / median[other]:.2f}"  # noqa: E731
                               if "ours" in median and other in median else "-")
        lines.append(f"| {row['replicas']} | {row['steps_per_loop']} | " + " | ".join(
            f"{median[case]:.1f} ({', '.join(f'{r:.0f}' for r in rates)})"
            if case in median else "failed"
            for case, rates in row["steps_per_second"].items())
            + f" | {ratio('bare')} | {ratio('fit')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
