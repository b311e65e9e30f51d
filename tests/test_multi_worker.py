"""Several workers on localhost: MultiWorkerMirroredStrategy via trainer.launch."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from test_faults import _sha
from test_main import ROOT

# No batch-norm, no dropout, no shuffle or augmentation: global batch k holds the
# same examples however the workers split it, so 1 and 2 workers must agree.
EXACT = ["--model=convnet", "--model_size=tiny", "--dataset=synthetic",
         "--image_size=32", "--batch_size=16", "--train_steps=6", "--steps_per_loop=2",
         "--checkpoint_every=3", "--eval_every=6", "--precision=float32",
         "--shuffle_buffer=0", "--augment=none", "--optimizer=sgd",
         "--learning_rate=0.05", "--eval_batch_size=256"]


def _launch(*args, workers=2):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, "-m", "trainer.tools.launch",
                             f"--workers={workers}", "--", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _weights(checkpoint_dir: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoint_dir))
    """Every variable in the latest checkpoint: weights and optimizer state."""
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.endswith("VARIABLE_VALUE") and not name.startswith("save_counter")}


@pytest.mark.long(39)  # seconds, with -n 2
def test_two_workers_agree_with_each_other_and_with_one_worker(tmp_path, run):
    two = str(tmp_path / "two")
    proc = _launch(*EXACT, f"--model_dir={two}")
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "[worker 0]" in output and "[worker 1]" in output
    assert "MultiWorkerMirroredStrategy" in output
    chief = _weights(two)
    other = _weights(os.path.join(two, ".worker_tmp", "worker_1"))
    assert chief.keys() == other.keys() and len(chief) >= 10
    for name in chief:  # the same weights on both workers, bit for bit
        np.testing.assert_array_equal(chief[name], other[name], err_msg=name)
    one = str(tmp_path / "one")
    status, log = run(*EXACT, f"--model_dir={one}")  # one worker: in this process
    assert status == 0, log[-2000:]
    for name, value in _weights(one).items():
        np.testing.assert_allclose(chief[name], value, rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    assert os.path.exists(os.path.join(two, "metrics.json"))
    assert not os.path.exists(os.path.join(two, ".worker_tmp", "worker_1",
                                           "metrics.json"))


@pytest.mark.long(105)  # seconds, with -n 2
def test_a_dead_worker_stops_the_others_and_the_rerun_ends_bitwise_like_no_kill(
        tmp_path, generated_records):
    """The short version of `trainer.tools.kill_resume` (BUILD.md runs it on real
    CIFAR-10 with five kills): a kill -9 at a random moment of a random worker. The
    launcher stops the other worker (exit 4, one error line). Then SIGTERM (a
    preemption) to the launcher or a worker: every worker saves the same step and
    exits 75 (a worker's SIGTERM was ignored until faults.StopSignals took the
    handler back from the coordination service). The
    last rerun resumes and ends with the uninterrupted run's weights. The data
    streams from 8 files (--cache=none), each worker reading its own 4."""
    from trainer.tools import kill_resume
    args = ["--model=cifar_cnn", "--model_size=tiny", f"--dataset={generated_records}",
            "--cache=none",
            "--batch_size=64", "--train_steps=48", "--steps_per_loop=1",
            "--checkpoint_every=10", "--eval_every=48", "--deterministic",
            "--shuffle_buffer=1024", "--mixup_alpha=0.2", "--cutmix_alpha=1.0"]
    said = []
    kills, reference, killed = kill_resume.run(2, 2, str(tmp_path), args, max_wait=0.5,
                                               seed=None, say=said.append,
                                               signals=("KILL", "TERM"))
    assert len(kills) == 2, said
    kill, stop = kills
    log = (tmp_path / "logs" / "killed_1.log").read_text()
    saved = re.search(r"stopped: stopped by SIGTERM: saved a checkpoint at step (\d+)", log)
    assert stop.launcher_exit == 75 and saved, (said, log[-3000:])
    assert int(saved.group(1)) == stop.checkpoint_after >= stop.checkpoint_at_kill, said
    assert kill.checkpoint_at_kill > kill.resumed_from_step
    # The others were stopped, soon, saying which worker died (or, if worker 0 saw
    # the lost peer first, saying that), and no worker process is left.
    log = (tmp_path / "logs" / "killed_0.log").read_text()
    assert kill.launcher_exit != 0 and kill.stopped_after < 60, (kill, log[-3000:])
    assert (f"error: worker {kill.worker} died (killed by signal 9); stopped the others"
            in log or "error: lost another worker" in log or "stopped answering" in log), (
        log[-3000:])
    for pid in re.findall(r"\[launch\] worker \d+: pid (\d+)", log):
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(
            f"/proc/{pid}/status").read(), f"worker pid {pid} still runs"
    assert reference == killed, said
    assert not kill_resume.leftovers(str(tmp_path / "killed"))  # no temporary, no lock


class _Launched:
    """A 2-worker launch whose lines are read as they come (its workers' pids)."""

    def __init__(self, *args):
        import threading
        self.proc = _launch(*args)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                         daemon=True).start()

    def pid(self, worker: int) -> int:
        while True:
            for line in list(self.lines):
                found = re.match(rf"\[launch\] worker {worker}: pid (\d+)", line)
                if found:
                    return int(found.group(1))
            assert self.proc.poll() is None, "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def finish(self) -> tuple[int, str]:
        status = self.proc.wait(timeout=400)
        time.sleep(0.2)  # (the reader's last lines)
        return status, "".join(self.lines)


@pytest.mark.long(210)  # seconds, with -n 3 in .ci/run
def test_worker_1_alone_stopped_while_it_writes_a_checkpoint_or_paused_for_15_s(tmp_path):
    """Two of worker 1's troubles, each against an uninterrupted 2-worker run:
    SIGTERM to worker 1 alone while it writes a checkpoint (its ckpt-N_temp is
    there before and after the signal): both workers save one step and exit 75,
    and the resumed run ends with the same weights, bit for bit. SIGSTOP to
    worker 1 for 15 s (more than TensorFlow's 10-s heartbeat, which ended the run
    before --worker_timeout), then SIGCONT: the run goes on and ends the same."""
    import signal
    args = ["--model=cifar_cnn", "--dataset=synthetic", "--batch_size=64",
            "--train_steps=40", "--steps_per_loop=1", "--checkpoint_every=2",
            "--eval_every=40", "--deterministic", "--shuffle_buffer=1024"]
    reference = str(tmp_path / "reference")
    status, output = _Launched(*args, f"--model_dir={reference}").finish()
    assert status == 0, output[-3000:]

    stopped = str(tmp_path / "stopped")
    run = _Launched(*args, f"--model_dir={stopped}")
    worker_1 = run.pid(1)
    own_dir = os.path.join(stopped, ".worker_tmp", "worker_1")
    writing = lambda: [name for name in os.listdir(own_dir)  # noqa: E731
                       if name.endswith("_temp")] if os.path.isdir(own_dir) else []
    while True:  # until a signal lands inside a write (a temporary before and after)
        assert run.proc.poll() is None, "the run ended before a signal hit a write"
        if writing():
            os.kill(worker_1, signal.SIGTERM)
            if writing():
                break
            os.kill(worker_1, signal.SIGTERM)  # (missed: a second stops it at once)
            raise AssertionError("the signal came after the write; run again")
        time.sleep(0.0005)
    status, output = run.finish()
    assert status == 75, output[-3000:]
    saved = re.findall(r"\[worker (\d)\] stopped: stopped by (.+?): saved a checkpoint "
                       r"at step (\d+)", output)
    assert sorted(worker for worker, _, _ in saved) == ["0", "1"], output[-3000:]
    assert len({step for _, _, step in saved}) == 1, saved  # one step, both workers
    assert {(worker, who) for worker, who, _ in saved} == {
        ("1", "SIGTERM"), ("0", "another worker's signal")}, saved
    status, output = _Launched(*args, f"--model_dir={stopped}").finish()
    assert status == 0, output[-3000:]
    assert _sha(stopped) == _sha(reference)

    paused = str(tmp_path / "paused")
    run = _Launched(*args, f"--model_dir={paused}")
    worker_1 = run.pid(1)
    while not tf.io.gfile.glob(os.path.join(paused, "ckpt-10.index")):
        assert run.proc.poll() is None, "".join(run.lines)[-3000:]
        time.sleep(0.05)
    os.kill(worker_1, signal.SIGSTOP)
    time.sleep(15)
    os.kill(worker_1, signal.SIGCONT)
    status, output = run.finish()
    assert status == 0, output[-3000:]
    assert _sha(paused) == _sha(reference)
