"""Kill or stop a multi-worker run again and again; the resumed run must end with
bitwise the same weights as an uninterrupted one.

    python -m trainer.tools.kill_resume --workers=2 --kills=5 --work_dir=/tmp/kr \\
        --signals=KILL,INT -- --model=cifar_cnn --dataset=cifar10 --deterministic \\
        --epochs=4 --checkpoint_every=10

First runs `trainer.tools.launch --workers=N -- FLAGS` uninterrupted into
WORK_DIR/reference. Then into WORK_DIR/killed, --kills times: start the same launch
command, wait until it has written a new checkpoint, wait a random further 0 to
--max_wait seconds, and send the next of --signals in turn: SIGKILL to a random worker
(the launcher then stops the others, exit 4), or a stop signal (INT: Ctrl-C, TERM,
HUP) to the launcher or a random worker (every worker saves the same step, exit
75); then once more to the end. Prints every kill (time, signal, whom, the step it
resumed from), both runs' weights_sha256 and what temporaries or locks the killed
run left: SAME and none (exit 0), else exit 1. Each
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
import threading
import time

from absl import flags
import tensorflow as tf

from data import files
from trainer import checkpoints, cli, locks

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    cli.define_flag(flag_values, flags.DEFINE_integer, "workers", 2, "Worker processes.",
                    lower_bound=2)
    cli.define_flag(flag_values, flags.DEFINE_integer, "kills", 5, "Kills before the run "
                    "may finish.", lower_bound=1)
    cli.define_flag(flag_values, flags.DEFINE_string, "work_dir", None, "Empty directory for "
                    "the two runs and their logs.")
    cli.define_flag(flag_values, flags.DEFINE_float, "max_wait", 20.0, "Longest random wait "
                    "after a new checkpoint before a kill, in seconds.")
    cli.define_flag(flag_values, flags.DEFINE_list, "signals", ["KILL"], "Signals to "
                    "send, in turn, one per kill: KILL (to a random worker), INT, TERM, "
                    "HUP (to the launcher or a random worker).")
    cli.define_flag(flag_values, flags.DEFINE_integer, "seed", None, "Seed of the kill "
                    "schedule (default: random; printed).")
    flags.mark_flag_as_required("work_dir", flag_values)


SIGNALS = {"KILL": signal.SIGKILL, "INT": signal.SIGINT, "TERM": signal.SIGTERM,
           "HUP": signal.SIGHUP}
# The launcher's status after each: a lost worker; stopped, a checkpoint saved.
EXPECTED_STATUS = {"KILL": 4, "INT": 75, "TERM": 75, "HUP": 75}


@dataclasses.dataclass
class Kill:
    seconds_into_segment: float
    signal: str              # KILL, INT, TERM or HUP
    worker: int              # who got it: a worker, or -1 for the launcher
    resumed_from_step: int   # where the segment that was killed had started
    checkpoint_at_kill: int  # the newest checkpoint when the signal was sent
    launcher_exit: int       # the launcher's exit status after the kill (4: a worker died)
    stopped_after: float     # seconds from the kill until the launcher had ended
    checkpoint_after: int    # the newest checkpoint then (a stop signal saves one)


def _latest_step(model_dir: str) -> int:
    path = tf.train.latest_checkpoint(model_dir)
    return checkpoints.step_of(path) if path else 0


class _Launch:
    """One `trainer.tools.launch` run; its output copied to log_path (any file
    system) by a thread that also notes the workers' pids."""

    def __init__(self, workers: int, trainer_args: list[str], model_dir: str,
                 log_path: str):
        self.log_path, self.workers, self.pids = log_path, workers, {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.tools.launch", f"--workers={workers}", "--",
             *trainer_args, f"--model_dir={model_dir}"], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            text=True)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        with tf.io.gfile.GFile(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()  # (whole if this tool stops on an error)
                match = re.match(r"\[launch\] worker (\d+): pid (\d+)", line)
                if match:
                    self.pids[int(match.group(1))] = int(match.group(2))

    def wait_for_pids(self, deadline: float) -> dict[int, int]:
        while len(self.pids) < self.workers and time.time() < deadline:
            time.sleep(0.1)
        if len(self.pids) < self.workers:
            raise RuntimeError(f"the launcher did not start {self.workers} workers; see "
                               f"{self.log_path}")
        return dict(self.pids)

    def wait(self, timeout: float | None = None) -> int:
        status = self.proc.wait(timeout=timeout)
        self._copier.join(timeout=10)
        return status


def _sha(model_dir: str) -> str:
    with tf.io.gfile.GFile(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["weights_sha256"]


def run(workers: int, kills: int, work_dir: str, trainer_args: list[str],
        max_wait: float, seed: int, say=print, signals: tuple[str, ...] = ("KILL",)
        ) -> tuple[list[Kill], str, str]:
    """Returns (the kills, reference sha, killed run's sha). RuntimeError if the
    launcher's status after a kill is not the one expected for its signal."""
    rng = random.Random(seed)
    logs = os.path.join(work_dir, "logs")
    tf.io.gfile.makedirs(logs)
    reference, killed = (os.path.join(work_dir, name) for name in ("reference", "killed"))
    say(f"reference run: {reference}")
    if _Launch(workers, trainer_args, reference, os.path.join(logs, "reference.log")
               ).wait() != 0:
        raise RuntimeError(f"the reference run failed; see {logs}/reference.log")
    done: list[Kill] = []
    for segment in range(kills + 1):
        log_path = os.path.join(logs, f"killed_{segment}.log")
        start_step, started = _latest_step(killed), time.time()
        launch = _Launch(workers, trainer_args, killed, log_path)
        if segment == kills:  # the last segment runs to the end
            if launch.wait() != 0:
                raise RuntimeError(f"the final segment failed; see {log_path}")
            say(f"final segment: resumed from step {start_step}, ran to the end")
            break
        pids = launch.wait_for_pids(time.time() + 120)
        while _latest_step(killed) <= start_step and launch.proc.poll() is None:
            time.sleep(0.05)  # no kill before this segment has saved once: progress
        time.sleep(rng.uniform(0.0, max_wait))
        if launch.proc.poll() is not None:
            raise RuntimeError(f"the run ended before kill {segment + 1}; train longer "
                               f"or lower --max_wait (see {log_path})")
        name = signals[segment % len(signals)]
        worker = rng.randrange(workers) if name == "KILL" else rng.randrange(-1, workers)
        os.kill(launch.proc.pid if worker < 0 else pids[worker], SIGNALS[name])
        killed_at, checkpoint_at_kill = time.time(), _latest_step(killed)
        # The launcher stops the others; a stop signal waits for the workers' loop.
        status = launch.wait(timeout=300)
        kill = Kill(killed_at - started, name, worker, start_step, checkpoint_at_kill,
                    status, time.time() - killed_at, _latest_step(killed))
        done.append(kill)
        whom = "the launcher" if worker < 0 else f"worker {worker}"
        say(f"kill {segment + 1}: SIG{name} to {whom} after "
            f"{kill.seconds_into_segment:.1f} s (segment resumed from step {start_step}; "
            f"newest checkpoint then: step {checkpoint_at_kill}); the launcher exited "
            f"{status} {kill.stopped_after:.1f} s later, the newest checkpoint then: step "
            f"{kill.checkpoint_after}")
        if status != EXPECTED_STATUS[name]:
            raise RuntimeError(f"the launcher exited {status} after SIG{name}, not "
                               f"{EXPECTED_STATUS[name]}; see {log_path}")
    return done, _sha(reference), _sha(killed)


def main(argv: list[str]) -> None:
    trainer_args = argv[1:]
    if tf.io.gfile.exists(FLAGS.work_dir) and tf.io.gfile.listdir(FLAGS.work_dir):
        print(f"error: --work_dir={FLAGS.work_dir} is not empty; choose a new directory",
              file=sys.stderr)
        sys.exit(2)
    signals = [name.upper().removeprefix("SIG") for name in FLAGS.signals]
    unknown = [name for name in signals if name not in SIGNALS]
    if unknown or not signals:
        print(f"error: --signals={','.join(FLAGS.signals)}: {', '.join(unknown) or 'none'}"
              f" is not one of {', '.join(SIGNALS)}; e.g. --signals=KILL,INT",
              file=sys.stderr)
        sys.exit(2)
    seed = FLAGS.seed if FLAGS.seed is not None else random.randrange(2**31)
    print(f"kill schedule seed {seed}")
    try:
        _, reference, killed = run(FLAGS.workers, FLAGS.kills, FLAGS.work_dir,
                                   trainer_args, FLAGS.max_wait, seed,
                                   signals=tuple(signals))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    same = reference == killed
    left = leftovers(os.path.join(FLAGS.work_dir, "killed"))
    print(f"weights_sha256 uninterrupted {reference}\nweights_sha256 killed        "
          f"{killed}\n{'SAME' if same else 'DIFFERENT'}\ntemporaries and locks left in "
          f"the killed run: {', '.join(left) or 'none'}")
    sys.exit(0 if same and not left else 1)


def leftovers(directory: str) -> list[str]:
    """Writers' temporaries and locks anywhere under `directory` (a run that ended
    leaves none, however often it was killed)."""
    return sorted(os.path.join(root, name) for root, dirs, names in
                  tf.io.gfile.walk(directory) for name in [*dirs, *names]
                  if files.is_temporary(name) or name == locks.LOCK_FILE)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
