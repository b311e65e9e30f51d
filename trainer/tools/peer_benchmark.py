"""airbench's own PyTorch code against ours, side by side on this machine: the same
CIFAR-10 (our TFDS copy), the same seeds, one run at a time, alternating.

    pip install -e ".[peer]"   # torch, torchvision, airbench: only for this command
    python -m trainer.tools.peer_benchmark --model=airbench_small --seeds=0,1,2 \\
        --work_dir=/tmp/peer [--profile] [--peer_python=PATH]

For each seed, the peer (trainer/tools/airbench_torch.py, whose docstring lists
every change made to airbench for the CPU) and `python -m trainer.main
--model=MODEL --seed=S`, the first of the two alternating from seed to seed so
that a drift of the machine's speed falls on both. Prints a Markdown table (test
accuracy with each side's test-time augmentation, training seconds without
evaluation, images/s), the means and their spread, and the ratios; writes it to
WORK_DIR/peer_benchmark.json. --profile then profiles 20 steps of each
(PyTorch's profiler; ours --profile_steps and trainer.tools.profile_summary) and
prints both op tables. --model=airbench runs airbench94's full recipe (widths
64:256:256; the peer's 9.9 epochs against our recipe's 10).
"""
import io
import json
import os
import statistics
import subprocess
import sys

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files  # noqa: E402

FLAGS = flags.FLAGS
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "airbench_torch.py")
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(PEER_SCRIPT)))
# Our model -> the peer's widths and epochs (airbench94's own 9.9 for the full one).
PEER_RECIPES = {"airbench_small": ("32:64:128", 5.0), "airbench": ("64:256:256", 9.9)}


def define_flags() -> None:
    cli.define_flag(FLAGS, flags.DEFINE_enum, "model", "airbench_small",
                    "Our model (its recipe) and the peer's match.",
                    enum_values=list(PEER_RECIPES))
    cli.define_flag(FLAGS, flags.DEFINE_list, "seeds", ["0", "1", "2"], "Seeds, each side.")
    cli.define_flag(FLAGS, flags.DEFINE_string, "work_dir", None, "A local directory "
                    "(the peer's torch reads it) for the data export, both sides' runs "
                    "and logs, and peer_benchmark.json.")
    cli.define_flag(FLAGS, flags.DEFINE_string, "peer_python", sys.executable,
                    "The Python with torch, torchvision and airbench.")
    cli.define_flag(FLAGS, flags.DEFINE_string, "data_dir", None, "TFDS data dir "
                    "(default: TFDS_DATA_DIR).")
    cli.define_flag(FLAGS, flags.DEFINE_list, "sides", ["peer", "ours"], "Which sides "
                    "to run (e.g. --sides=ours after a change on our side).")
    cli.define_flag(FLAGS, flags.DEFINE_bool, "profile", False, "Also profile 20 steps "
                    "of each side and print both op tables.")
    cli.define_flag(FLAGS, flags.DEFINE_list, "ours_flags", [], "More flags for our "
                    "side, e.g. --ours_flags=--precision=float32 (comma-separated).")
    flags.mark_flag_as_required("work_dir")


def export_cifar10(path: str, data_dir: str | None) -> None:
    """Our TFDS cifar10, train and test in TFDS's order, as uint8 arrays (the peer
    reads them into its own loader's files)."""
    if tf.io.gfile.exists(path):
        return
    import numpy as np
    import tensorflow_datasets as tfds
    arrays = {}
    for split in ("train", "test"):
        data = tfds.as_numpy(tfds.load("cifar10", split=split, batch_size=-1,
                                       data_dir=data_dir, download=False))
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = data["image"], data["label"]
    builder = tfds.builder("cifar10", data_dir=data_dir)
    arrays["classes"] = np.array(builder.info.features["label"].names)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    files.write_atomically(path, buffer.getvalue())


def _run(command: list[str], log_path: str, env: dict | None = None) -> str:
    """Runs a side to its end, its output kept in log_path; returns the output."""
    result = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT, env=env)
    files.write_atomically(log_path, result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed (exit "
                           f"{result.returncode}); see {log_path}")
    return result.stdout


def run_peer(seed: int, work_dir: str, profile_steps: int = 0) -> dict:
    widths, epochs = PEER_RECIPES[FLAGS.model]
    name = f"peer_s{seed}{'_profile' * bool(profile_steps)}.log"
    out = _run([FLAGS.peer_python, PEER_SCRIPT, f"--data={work_dir}/cifar10.npz",
                f"--work_dir={work_dir}/peer", f"--seed={seed}", f"--epochs={epochs}",
                f"--widths={widths}", f"--profile_steps={profile_steps}"],
               os.path.join(work_dir, "logs", name))
    tag = "PEER_PROFILE " if profile_steps else "PEER_RESULT "
    line = [line for line in out.splitlines() if line.startswith(tag)][-1]
    return json.loads(line[len(tag):])


def run_ours(seed: int, work_dir: str, extra: list[str] = ()) -> dict:
    model_dir = os.path.join(work_dir, f"ours_s{seed}{'_profile' * bool(extra)}")
    env = dict(os.environ)
    if FLAGS.data_dir:
        env["TFDS_DATA_DIR"] = FLAGS.data_dir
    _run([sys.executable, "-m", "trainer.main", f"--model={FLAGS.model}", f"--seed={seed}",
          f"--model_dir={model_dir}", *FLAGS.ours_flags, *extra],
         os.path.join(work_dir, "logs", os.path.basename(model_dir) + ".log"), env)
    metrics = files.read_json(os.path.join(model_dir, "metrics.json"))
    return {"tta_accuracy": metrics["test_accuracy"], "train_seconds": metrics["train_seconds"],
            "steps": metrics["steps"], "images_per_second": metrics["images_per_second"],
            "model_dir": model_dir}


def _mean_spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4g} ± {spread:.2g}"


def table(rows: list[dict]) -> str:
    lines = ["| side | seed | test accuracy (TTA) | training s | steps | img/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['side']} | {row['seed']} | {100 * row['tta_accuracy']:.2f}% | "
                     f"{row['train_seconds']:.1f} | {row['steps']} | "
                     f"{row['images_per_second']:,.0f} |")
    sides = {}
    for row in rows:
        sides.setdefault(row["side"], []).append(row)
    for side, runs in sides.items():
        lines.append(f"| **{side}, mean** | {len(runs)} | "
                     f"{_mean_spread([100 * r['tta_accuracy'] for r in runs])}% | "
                     f"{_mean_spread([r['train_seconds'] for r in runs])} | | "
                     f"{_mean_spread([r['images_per_second'] for r in runs])} |")
    if {"peer", "ours"} <= set(sides):
        peer, ours = (statistics.mean(r["images_per_second"] for r in sides[s])
                      for s in ("peer", "ours"))
        accuracy = (statistics.mean(r["tta_accuracy"] for r in sides["ours"])
                    - statistics.mean(r["tta_accuracy"] for r in sides["peer"]))
        lines.append(f"\nours/peer images per second: {ours / peer:.2f}; ours - peer test "
                     f"accuracy: {100 * accuracy:+.2f} points")
    return "\n".join(lines)


def peer_ops(profile: dict, top: int = 15) -> str:
    total = sum(op["self_cpu_seconds"] for op in profile["ops"])
    lines = [f"peer: {profile['step_seconds']:.3f} s per step (profiled)",
             "| op | self CPU s per step | share |", "| --- | ---: | ---: |"]
    for op in sorted(profile["ops"], key=lambda op: -op["self_cpu_seconds"])[:top]:
        lines.append(f"| {op['name']} | {op['self_cpu_seconds']:.4f} | "
                     f"{100 * op['self_cpu_seconds'] / total:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    work_dir = FLAGS.work_dir
    tf.io.gfile.makedirs(os.path.join(work_dir, "logs"))
    if not set(FLAGS.sides) <= {"peer", "ours"}:
        print(f"error: --sides={','.join(FLAGS.sides)}: the sides are peer and ours",
              file=sys.stderr)
        sys.exit(2)
    probe = subprocess.run([FLAGS.peer_python, "-c", "import torch, torchvision, airbench"],
                           capture_output=True, text=True)
    if probe.returncode != 0 and ("peer" in FLAGS.sides or FLAGS.profile):
        print(f"error: {FLAGS.peer_python} cannot import torch, torchvision and airbench "
              f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''}); "
              f"pip install -e \".[peer]\" there, or give --peer_python", file=sys.stderr)
        sys.exit(2)
    export_cifar10(os.path.join(work_dir, "cifar10.npz"), FLAGS.data_dir)
    rows = []
    try:
        for index, seed in enumerate(int(s) for s in FLAGS.seeds):
            order = ("peer", "ours") if index % 2 == 0 else ("ours", "peer")
            for side in (side for side in order if side in FLAGS.sides):
                result = (run_peer if side == "peer" else run_ours)(seed, work_dir)
                rows.append({"side": side, "seed": seed, **result})
                print(f"{side} seed {seed}: {100 * result['tta_accuracy']:.2f}% in "
                      f"{result['train_seconds']:.1f} s", flush=True)
        report = table(rows)
        if FLAGS.profile:
            report += "\n\n" + peer_ops(run_peer(0, work_dir, profile_steps=20))
            ours = run_ours(0, work_dir, ["--profile_steps=20,40", "--train_steps=40"])
            report += "\n\nours:\n" + _run(
                [sys.executable, "-m", "trainer.tools.profile_summary",
                 f"--logdir={ours['model_dir']}"],
                os.path.join(work_dir, "logs", "ours_profile_summary.log"))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    files.write_json(os.path.join(work_dir, "peer_benchmark.json"),
                     {"model": FLAGS.model, "rows": rows, "report": report})
    print(report)


if __name__ == "__main__":
    define_flags()
    cli.run(main, FLAGS)
