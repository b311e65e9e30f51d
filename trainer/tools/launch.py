"""Try multi-worker training on one machine:

    python -m trainer.tools.launch --workers=2 -- --model=cifar_cnn --epochs=1

Starts N `trainer.main --strategy=multi_worker` processes on free localhost ports,
each with its TF_CONFIG (worker 0 is the chief), prefixes every output line with
its worker, and if one worker fails, stops the others (so none waits forever in a
collective) and exits with the failed worker's status. On a real cluster, set
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

from absl import app, flags

from trainer import main as main_lib

FLAGS = flags.FLAGS
GRACE_SECONDS = 10  # SIGTERM first (a checkpoint may be saved), then SIGKILL


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


def _stop(procs: list[subprocess.Popen]) -> None:
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


def launch(workers: int, trainer_args: list[str]) -> int:
    """Runs the workers to the end; returns 0 or the first failing worker's status."""
    ports = free_ports(workers)
    procs = []
    for index in range(workers):
        env = dict(os.environ, TF_CONFIG=tf_config(ports, index))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainer.main", "--strategy=multi_worker",
             *trainer_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1))
    for index, proc in enumerate(procs):
        print(f"[launch] worker {index}: pid {proc.pid}, 127.0.0.1:{ports[index]}",
              file=sys.stderr, flush=True)
    threads = [threading.Thread(target=_stream, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for thread in threads:
        thread.start()
    # SIGTERM to the launcher (a preemption) reaches every worker.
    signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM)
                                              for p in procs if p.poll() is None])
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [(i, p.returncode) for i, p in enumerate(procs)
                      if p.returncode not in (None, 0)]
            if failed:
                index, status = failed[0]
                print(f"[launch] worker {index} exited with status {status}; stopping "
                      f"the others", file=sys.stderr, flush=True)
                _stop(procs)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for thread in threads:
        thread.join(timeout=5)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """launch's one flag (defining twice is a no-op); trainer.main's flags go after
    `--`, where absl stops parsing."""
    main_lib.define_flag(flag_values, flags.DEFINE_integer, "workers", 2, "Worker processes.",
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
    app.run(main, flags_parser=main_lib.parse_flags)
