"""Try multi-worker training on one machine:

    python -m trainer.tools.launch --workers=2 -- --model=cifar_cnn --epochs=1

Starts N `trainer.main --strategy=multi_worker` processes on free localhost ports,
each with its TF_CONFIG (worker 0 is the chief), prefixes every output line with
its worker, and watches every worker: when one exits with an error (any index),
it stops the others within GRACE_SECONDS (so none waits forever in a collective)
and exits with that status if it is one of trainer.main's (2 bad settings, 3
diverged, 5 a write failed, 75 stopped), else 4 (a worker died: killed, or
crashed) with one line naming the worker. A stop signal to the launcher (SIGTERM,
Ctrl-C's SIGINT, SIGHUP) is passed on to every worker once: they save a checkpoint
of the same step and exit 75 (again: at once). On a real cluster, set
TF_CONFIG on each machine yourself and run trainer.main there.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from trainer import cli  # not trainer.main: the launcher starts without TensorFlow

FLAGS = flags.FLAGS
GRACE_SECONDS = 10  # SIGTERM first (a checkpoint may be saved), then SIGKILL
LOST_WORKER_EXIT_CODE = 4  # trainer.main's status for a lost worker
# trainer.main's statuses that mean the same for the whole job: bad settings, the
# loss diverged, a file could not be written, preempted.
PASSED_ON = (2, 3, 5, 75)


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on 127.0.0.1 (held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports: list[int], index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _stream(index: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[worker {index}] {line}")
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen], stopping_anyway: bool = False) -> None:
    """SIGTERM, then SIGKILL after GRACE_SECONDS. stopping_anyway: the workers are
    ending by themselves (a stop signal reached each, and they save the same step):
    first GRACE_SECONDS to do so, since another signal would stop them at once."""
    if stopping_anyway:
        deadline = time.time() + GRACE_SECONDS
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.time() + GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _paused(procs: list[subprocess.Popen]) -> list[int]:
    """The workers whose process is stopped (SIGSTOP, a debugger): Linux's
    /proc/PID/status State T or t."""
    paused = []
    for index, proc in enumerate(procs):
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                state = next(line for line in f if line.startswith("State:")).split()[1]
        except (OSError, StopIteration, IndexError):
            continue
        if state in ("T", "t"):
            paused.append(index)
    return paused


def launch(workers: int, trainer_args: list[str], program: list[str] | None = None
           ) -> int:
    """Runs the workers to the end; returns 0, or the exit status for the first
    failing worker (see the module's docstring). program: what each worker runs
    (default trainer.main with --strategy=multi_worker), before trainer_args."""
    program = program or [sys.executable, "-m", "trainer.main", "--strategy=multi_worker"]
    ports = free_ports(workers)
    procs = []
    for index in range(workers):
        env = dict(os.environ, TF_CONFIG=tf_config(ports, index))
        # A session of its own: a terminal's Ctrl-C (or its closing) reaches the
        # launcher only, which passes it on once (twice would be "stop at once").
        procs.append(subprocess.Popen(
            [*program, *trainer_args], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True))
    for index, proc in enumerate(procs):
        print(f"[launch] worker {index}: pid {proc.pid}, 127.0.0.1:{ports[index]}",
              file=sys.stderr, flush=True)
    threads = [threading.Thread(target=_stream, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for thread in threads:
        thread.start()
    # A stop signal to the launcher (a preemption's SIGTERM, Ctrl-C, a closed
    # terminal) reaches every worker: each saves the same step and exits 75.
    previous = {signum: signal.signal(signum, lambda signum, _: [
        p.send_signal(signum) for p in procs if p.poll() is None])
        for signum in cli.STOP_SIGNALS}
    while True:
        states = [p.poll() for p in procs]  # every worker, each time
        failed = [(i, code) for i, code in enumerate(states) if code not in (None, 0)]
        if failed or all(code is not None for code in states):
            break
        time.sleep(0.2)
    status = 0
    if failed:
        index, code = failed[0]
        status = code if code in PASSED_ON else LOST_WORKER_EXIT_CODE
        # A worker that exits 4 is the one that noticed a peer stop answering: the
        # peer is the culprit (a stopped process, if one is).
        paused = _paused(procs) if code == LOST_WORKER_EXIT_CODE else []
        if code in PASSED_ON:
            print(f"[launch] worker {index} exited with status {code}; stopping the "
                  f"others", file=sys.stderr, flush=True)
        _stop(procs, stopping_anyway=code == cli.STOPPED_EXIT_CODE)
        if code == LOST_WORKER_EXIT_CODE:
            culprit = (f"worker {paused[0]} stopped answering (its process was paused, "
                       f"e.g. by SIGSTOP, for longer than --worker_timeout)" if paused
                       else "another worker stopped answering (see its lines above)")
            print(f"error: {culprit}; worker {index} noticed it and stopped; stopped "
                  f"the others: rerun the same command to resume from the last "
                  f"checkpoint", file=sys.stderr, flush=True)
        elif code not in PASSED_ON:
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            print(f"error: worker {index} died ({how}); stopped the others: rerun the "
                  f"same command to resume from the last checkpoint", file=sys.stderr,
                  flush=True)
    for thread in threads:
        thread.join(timeout=5)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    return status


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """launch's one flag (defining twice is a no-op); trainer.main's flags go after
    `--`, where absl stops parsing."""
    cli.define_flag(flag_values, flags.DEFINE_integer, "workers", 2, "Worker processes.",
                    lower_bound=1)


def _strategy_flag(arg: str) -> bool:
    return arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] == "strategy"


def main(argv: list[str]) -> None:
    trainer_args = argv[1:]  # trainer.main's flags, given after `--`
    if any(_strategy_flag(a) for a in trainer_args):
        print("error: the launcher sets --strategy=multi_worker; drop --strategy",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(FLAGS.workers, trainer_args))


if __name__ == "__main__":
    define_flags()
    cli.run(main, FLAGS)
