"""Kill a random worker of a multi-worker run again and again; the resumed run must
end with bitwise the same weights as an uninterrupted one.

    python -m trainer.tools.kill_resume --workers=2 --kills=5 --work_dir=/tmp/kr -- \\
        --model=cifar_cnn --dataset=cifar10 --deterministic --epochs=4 --checkpoint_every=10

First runs `trainer.tools.launch --workers=N -- FLAGS` uninterrupted into
WORK_DIR/reference. Then into WORK_DIR/killed, --kills times: start the same launch
command, wait until it has written a new checkpoint, wait a random further 0 to
--max_wait seconds, SIGKILL a random worker (the launcher then stops the others);
then once more to the end. Prints every kill (time, worker, the step it resumed
from) and both runs' weights_sha256: SAME (exit 0) or DIFFERENT (exit 1). Each
launch's output is kept in WORK_DIR/logs. Use --deterministic: without it the
weights differ from run to run anyway.
"""
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

from absl import app, flags

from trainer import cli

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    cli.define(flag_values, flags.DEFINE_integer, "workers", 2, "Worker processes.",
               lower_bound=2)
    cli.define(flag_values, flags.DEFINE_integer, "kills", 5, "Kills before the run "
               "may finish.", lower_bound=1)
    cli.define(flag_values, flags.DEFINE_string, "work_dir", None, "Empty directory for "
               "the two runs and their logs.")
    cli.define(flag_values, flags.DEFINE_float, "max_wait", 20.0, "Longest random wait "
               "after a new checkpoint before a kill, in seconds.")
    cli.define(flag_values, flags.DEFINE_integer, "seed", None, "Seed of the kill "
               "schedule (default: random; printed).")
    flags.mark_flag_as_required("work_dir", flag_values)


@dataclasses.dataclass
class Kill:
    seconds_into_segment: float
    worker: int
    resumed_from_step: int   # where the segment that was killed had started
    checkpoint_at_kill: int  # the newest checkpoint when the worker died


def _latest_step(model_dir: str) -> int:
    index = os.path.join(model_dir, "checkpoint")
    if not os.path.exists(index):
        return 0
    match = re.search(r'model_checkpoint_path: ".*?ckpt-(\d+)"', open(index).read())
    return int(match.group(1)) if match else 0


def _launch(workers: int, trainer_args: list[str], model_dir: str, log_path: str):
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.tools.launch", f"--workers={workers}", "--",
         *trainer_args, f"--model_dir={model_dir}"], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), text=True)
    return proc, log


def _pids(log_path: str, workers: int, deadline: float) -> dict[int, int]:
    """The workers' pids, from the launcher's '[launch] worker i: pid P' lines."""
    while time.time() < deadline:
        found = {int(m.group(1)): int(m.group(2)) for m in re.finditer(
            r"\[launch\] worker (\d+): pid (\d+)", open(log_path).read())}
        if len(found) == workers:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"the launcher did not start {workers} workers; see {log_path}")


def _sha(model_dir: str) -> str:
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["weights_sha256"]


def run(workers: int, kills: int, work_dir: str, trainer_args: list[str],
        max_wait: float, seed: int, say=print) -> tuple[list[Kill], str, str]:
    """Returns (the kills, reference sha, killed run's sha)."""
    rng = random.Random(seed)
    logs = os.path.join(work_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    reference, killed = (os.path.join(work_dir, name) for name in ("reference", "killed"))
    say(f"reference run: {reference}")
    proc, log = _launch(workers, trainer_args, reference, os.path.join(logs, "reference.log"))
    if proc.wait() != 0:
        raise RuntimeError(f"the reference run failed; see {logs}/reference.log")
    log.close()
    done: list[Kill] = []
    for segment in range(kills + 1):
        log_path = os.path.join(logs, f"killed_{segment}.log")
        start_step, started = _latest_step(killed), time.time()
        proc, log = _launch(workers, trainer_args, killed, log_path)
        if segment == kills:  # the last segment runs to the end
            if proc.wait() != 0:
                raise RuntimeError(f"the final segment failed; see {log_path}")
            say(f"final segment: resumed from step {start_step}, ran to the end")
            break
        pids = _pids(log_path, workers, time.time() + 120)
        while _latest_step(killed) <= start_step and proc.poll() is None:
            time.sleep(0.05)  # no kill before this segment has saved once: progress
        time.sleep(rng.uniform(0.0, max_wait))
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before kill {segment + 1}; train longer "
                               f"or lower --max_wait (see {log_path})")
        worker = rng.randrange(workers)
        os.kill(pids[worker], signal.SIGKILL)
        kill = Kill(time.time() - started, worker, start_step, _latest_step(killed))
        proc.wait(timeout=120)  # the launcher stops the other workers
        log.close()
        done.append(kill)
        say(f"kill {segment + 1}: worker {worker} after {kill.seconds_into_segment:.1f} s "
            f"(segment resumed from step {start_step}; newest checkpoint then: step "
            f"{kill.checkpoint_at_kill})")
    return done, _sha(reference), _sha(killed)


def main(argv: list[str]) -> None:
    trainer_args = argv[1:]
    if os.path.exists(FLAGS.work_dir) and os.listdir(FLAGS.work_dir):
        print(f"error: --work_dir={FLAGS.work_dir} is not empty; choose a new directory",
              file=sys.stderr)
        sys.exit(2)
    seed = FLAGS.seed if FLAGS.seed is not None else random.randrange(2**31)
    print(f"kill schedule seed {seed}")
    try:
        _, reference, killed = run(FLAGS.workers, FLAGS.kills, FLAGS.work_dir,
                                   trainer_args, FLAGS.max_wait, seed)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    same = reference == killed
    print(f"weights_sha256 uninterrupted {reference}\nweights_sha256 killed        "
          f"{killed}\n{'SAME' if same else 'DIFFERENT'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
