"""Faults: a non-finite loss, preemption (SIGTERM), kill -9 and exact resume."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import CPUS, mirrored, classification, step_loop
from test_main import ROOT, TINY, _main
from test_step import _batch
from trainer import faults, optimizers, step


def _linear_model() -> keras.Model:
    """No ReLU: a NaN in the input reaches the loss (fused conv+ReLU kernels can
    turn a NaN into 0)."""
    init = keras.initializers.GlorotUniform(seed=3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(5, kernel_initializer=init)(x))


def _train(strategy, batches):
    with strategy.scope():
        model = _linear_model()
        # SGD: its update does not read the step count (Adam's bias correction does,
        # and a skipped step is still a step), so the weights must match exactly.
        optimizer = optimizers.create("sgd", 0.01, model.trainable_variables, momentum=0.0)
    dataset = tf.data.Dataset.from_tensor_slices(
        {key: tf.stack([b[key] for b in batches]) for key in batches[0]}).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    options = step.StepOptions(batch_size=8)
    loop, _ = step_loop(strategy, model, optimizer, classification(), options)
    sums, _ = loop(iterator, tf.constant(len(batches)), tf.constant(0.0))
    return model, optimizer, tf.nest.map_structure(lambda t: float(t), sums)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_non_finite_update_is_dropped_on_every_replica_and_counted(replicas):
    strategy = mirrored() if replicas == 2 else tf.distribute.OneDeviceStrategy(CPUS[0])
    good_1, good_2 = _batch(), {**_batch(), "image": _batch()["image"] * 0.5}
    images = _batch()["image"].numpy()
    images[-1, 0, 0, 0] = np.nan  # one example, on the last replica's slice only
    bad = {**_batch(), "image": tf.constant(images)}
    skipped_model, opt, sums = _train(strategy, [good_1, bad, good_2])
    clean_model, clean_opt, clean = _train(strategy, [good_1, good_2])
    # (skipped steps, steps) summed over replicas: one of three steps was dropped.
    assert sums["skipped"][0] / sums["skipped"][1] == pytest.approx(1 / 3)
    assert clean["skipped"][0] == 0
    # The skipped step's examples are not counted; its loss does not poison the sum.
    assert sums["loss"][1] == 16 and np.isfinite(sums["loss"][0])
    # The optimizer counts its real updates only (Adam's bias correction), so the
    # skipped step did not advance optimizer.iterations (the run's step counter,
    # what the schedule and the data position read, advances: test below) ...
    assert int(opt.iterations.numpy()) == 2 and int(clean_opt.iterations.numpy()) == 2
    # ... while the weights are exactly those of the two good updates alone.
    for a, b in zip(skipped_model.get_weights(), clean_model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.long(14)  # seconds, with -n 2
def test_skip_step_keeps_schedule_and_data_position_together(tmp_path):
    """A run with skipped updates: the learning rate logged at each step is the
    schedule's value at that step, and the run resumes from the data position of
    its step count."""
    from trainer import loop
    from trainer.config import Config
    config = Config(model="cifar_cnn", model_size="tiny", dataset="synthetic",
                    model_dir=str(tmp_path / "run"), batch_size=16, train_steps=6,
                    steps_per_loop=1, log_every=1, eval_every=6, checkpoint_every=3,
                    precision="float32", shuffle_buffer=64, on_nan="skip_step",
                    learning_rate=1e30, optimizer="sgd", momentum=0.0,
                    lr_schedule="linear", warmup_epochs=0.0)
    metrics = loop.train_and_evaluate(config)
    assert metrics["skipped_steps"] >= 1 and metrics["steps"] == 6
    with open(os.path.join(config.model_dir, "metrics.json")) as f:
        history = json.load(f)["train_history"]
    from trainer import build, config as config_lib, schedules
    plan = build.Plan.make(config.group(config_lib.LoopSettings), 1, 10_000, 2_000, 1)
    schedule = config.group(schedules.ScheduleSettings).make(plan.total_steps,
                                                             plan.steps_per_epoch)
    for record in history:  # the LR of the next step, at every step, skipped or not
        assert record["learning_rate"] == pytest.approx(float(schedule(record["step"])))
    assert tf.train.latest_checkpoint(config.model_dir).endswith("ckpt-6")


@pytest.mark.long(11)  # seconds, with -n 2
def test_diverging_run_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, run):
    model_dir = str(tmp_path / "run")
    status, log = run(*TINY, f"--model_dir={model_dir}", "--checkpoint_every=2",
                      "--optimizer=sgd", "--momentum=0")
    assert status == 0, log[-2000:]
    files = {f: os.path.getmtime(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
             if f.startswith("ckpt-4")}
    status, log = run(*TINY, f"--model_dir={model_dir}", "--train_steps=40",
                      "--learning_rate=1e12", "--optimizer=sgd", "--momentum=0",
                      "--resume_with_changes")
    assert status == 3, log[-2000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: non-finite loss or gradient")
    assert "is kept" in errors[0]
    for name, mtime in files.items():  # the last good checkpoint is untouched
        assert os.path.getmtime(os.path.join(model_dir, name)) == mtime


def _sha(model_dir: str) -> str:
    """The checksum of the final weights that the run wrote into metrics.json."""
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["weights_sha256"]


RESUME = [*TINY, "--batch_size=64", "--train_steps=48", "--checkpoint_every=12",
          "--steps_per_loop=1", "--eval_every=48", "--deterministic",
          "--shuffle_buffer=4096"]
# A task that reads no labels (classification, with mixup and CutMix, is killed
# repeatedly in tests/test_multi_worker.py).
AUTOENCODER = ["--task=autoencoder", "--model=conv_autoencoder", "--optimizer=adam",
               "--learning_rate=2e-3"]


def _start(model_dir, *extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, "-m", "trainer.main", *RESUME, *extra,
                             f"--model_dir={model_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(model_dir, proc, at_least: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        ckpt = tf.train.latest_checkpoint(model_dir)
        if ckpt and int(ckpt.rsplit("-", 1)[1]) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint >= {at_least}: {proc.communicate()[0][-2000:]}")


@pytest.mark.long(70)  # seconds, with -n 2
def test_kill_9_at_a_random_step_then_resume_is_bitwise_identical(tmp_path,
                                                                   generated_records):
    # Two replicas: the harder case (one replica is the in-process resume tests').
    # Streamed from TFRecord files (--cache=none), 1.5 epochs: the order of every
    # epoch, the windows skipped on resume and the decode are all in the check.
    # Checkpoints written in the background (--async_checkpoints): a kill during a
    # write leaves the one before it listed (direct writes: test_multi_worker.py).
    extra = ["--cpu_replicas=2", *AUTOENCODER, f"--dataset={generated_records}",
             "--cache=none", "--shuffle_buffer=500", "--async_checkpoints"]
    reference = _main(*RESUME, *extra, f"--model_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed_dir = str(tmp_path / "killed")
    proc = _start(killed_dir, *extra)
    _wait_for_checkpoint(killed_dir, proc, random.Random().choice([12, 24]))
    time.sleep(random.random() * 0.2)  # mid-step, between checkpoints
    assert proc.poll() is None, "the run ended before the kill; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = _main(*RESUME, *extra, f"--model_dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open(os.path.join(killed_dir, "metrics.json")) as f:
        assert 0 < json.load(f)["resumed_from_step"] < 48
    assert _sha(killed_dir) == _sha(str(tmp_path / "ref"))


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (Linux's
    /proc/PID/status SigCgt): Python catches only SIGINT at its start; SIGTERM is
    caught once trainer/__init__.py's first line has run."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signum - 1) & 1)


def _wait_until_ours(proc) -> None:
    """Until the program runs our handlers (whatever the machine's load)."""
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        time.sleep(0.005)


@pytest.mark.long(30)  # seconds, with -n 2
def test_ctrl_c_in_a_long_loop_says_so_at_once_saves_the_next_step_and_resumes(tmp_path,
                                                                               run):
    """SIGINT (Ctrl-C) as SIGTERM and SIGHUP (test_stop_signals_...) in an in-graph
    loop of 100000 steps: the line that says what will happen comes before the
    loop ends, the checkpoint is of the next step boundary, exit 75, no
    traceback; the same command resumes there. (What happened, not how long it
    took: docs/results.md has the seconds.)"""
    model_dir = str(tmp_path / "run")
    proc = _start(model_dir, "--train_steps=100000", "--checkpoint_every=100000",
                  "--steps_per_loop=100000", "--log_every=100000", "--eval_every=100000")
    while "Tracing the step" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, "the run ended before training"
    proc.send_signal(signal.SIGINT)  # during the first call: tracing, then steps
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == faults.STOPPED_EXIT_CODE, output[-2000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    said = output.index("SIGINT: stopping after the current step")
    stopped = re.search(r"stopped: stopped by SIGINT: saved a checkpoint at step (\d+)",
                        output)
    assert stopped and said < stopped.start(), output[-2000:]
    step = int(stopped.group(1))
    # The loop was asked for one epoch's steps per call: it ended at a boundary
    # inside it (the steps done by then), not at the call's end.
    assert 1 <= step < 10_000 // 64, output[-2000:]  # (synthetic: 10,000 examples)
    assert tf.train.latest_checkpoint(model_dir).endswith(f"ckpt-{step}")
    status, log = run(*RESUME, f"--model_dir={model_dir}", f"--train_steps={step + 2}")
    assert status == 0 and f"at step {step}" in log, log[-2000:]


@pytest.mark.long(45)  # seconds, with -n 2
def test_a_stop_signal_at_any_moment_of_start_up_is_one_line_and_75(tmp_path):
    """SIGTERM, SIGINT and SIGHUP in turn at once (before Python may have run our
    first line), then at 8 moments counted from our handlers being in place
    (TensorFlow loading, flags, building, tracing) and once after the first
    steps, two programs at a time: each exits 75 with one `stopped:` line and no
    traceback, never trains on (issue 31: 5 of 12 swallowed), leaves no lock or
    temporary, and has a checkpoint only of the step its line names. Only the
    first may see the signal's default action, with nothing written."""
    import concurrent.futures
    from test_nothing_lost import _leftovers
    moments = ["at once", 0.0, 0.3, 0.7, 1.2, 2.0, 3.0, 4.5, 6.0, "after step 2"]
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]

    def stopped_at(index: int) -> tuple[int, str, str]:
        model_dir = str(tmp_path / f"run{index}")
        proc = _start(model_dir, "--train_steps=100000", "--checkpoint_every=100000")
        moment = moments[index]
        if moment == "after step 2":
            while "step 2/" not in (line := proc.stdout.readline()):
                assert line or proc.poll() is None, "the run ended before training"
        elif moment != "at once":
            _wait_until_ours(proc)
            time.sleep(moment)
        proc.send_signal(signals[index % 3])
        return proc.wait(timeout=120), proc.communicate()[0], model_dir

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(stopped_at, range(len(moments))))
    in_training = 0
    for index, (status, output, model_dir) in enumerate(results):
        name = signal.Signals(signals[index % 3]).name
        where = f"moment {moments[index]}, {name}: {output[-1500:]}"
        if moments[index] == "at once" and status == -signals[index % 3]:
            # Python had not reached our first line: the signal's default action
            # (SIGTERM's), before anything was written.
            assert not os.path.exists(model_dir), where
            continue
        lines = [line for line in output.splitlines() if line.startswith("stopped:")]
        assert status == faults.STOPPED_EXIT_CODE and len(lines) == 1, where
        assert name in lines[0] and "Traceback" not in output, where
        assert not _leftovers(model_dir), where
        saved = re.search(r"saved a checkpoint at step (\d+)", lines[0])
        steps = sorted(int(path.split("-")[-1].split(".")[0]) for path in
                       tf.io.gfile.glob(f"{model_dir}/ckpt-*.index"))
        assert steps == ([int(saved.group(1))] if saved else []), where
        in_training += bool(saved)
    assert "during start-up" in " ".join(results[1][1].splitlines()[-1:])
    assert in_training >= 1  # (the last moment at least)


def test_a_stop_request_ends_an_in_graph_loop_at_the_next_step_boundary():
    """The loop reads the stop flag before every step: set by another thread while
    a call of 100000 steps runs (as the signal watcher does), the call returns
    after the step in flight, reports the steps it ran, and its sums are theirs."""
    import threading
    strategy = mirrored()
    steps_seen = tf.Variable(0, dtype=tf.int64)  # (on the host, read by the thread)
    stop_flag = tf.Variable(0.0)

    def replica_step(batch):
        if tf.distribute.get_replica_context().replica_id_in_sync_group == 0:
            steps_seen.assign_add(1)
        return {"examples": (tf.cast(tf.shape(batch)[0], tf.float32), 1.0)}

    from trainer import distributed
    loop = distributed.make_train_loop(strategy, replica_step)
    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(tf.zeros([8, 2])).repeat()))

    def stop_after_a_few() -> None:
        while int(steps_seen.numpy()) < 5:
            time.sleep(0.001)
        stop_flag.assign(1.0)
    thread = threading.Thread(target=stop_after_a_few)
    thread.start()
    sums, stopping = loop(iterator, tf.constant(100000), stop_flag)
    thread.join()
    done = int(sums[distributed.STEPS_DONE][0])
    assert float(stopping) > 0 and 5 <= done < 100000, (float(stopping), done, int(steps_seen.numpy()))
    assert done == int(steps_seen.numpy())  # the flag is read between steps only
    assert float(sums["examples"][0]) == 8 * done  # (4 per replica, 2 replicas)
    # Without a request, a call runs all of its steps.
    stop_flag.assign(0.0)
    sums, stopping = loop(iterator, tf.constant(7), stop_flag)
    assert int(sums[distributed.STEPS_DONE][0]) == 7 and float(stopping) == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_skipped_step_leaves_batch_norm_statistics_as_they_were(replicas):
    strategy = mirrored() if replicas == 2 else tf.distribute.OneDeviceStrategy(CPUS[0])

    def bn_model():
        inputs = keras.Input((8, 8, 3))
        x = keras.layers.BatchNormalization()(inputs)
        x = keras.layers.Flatten()(x)
        return keras.Model(inputs, keras.layers.Dense(
            5, kernel_initializer=keras.initializers.GlorotUniform(seed=3))(x))

    images = _batch()["image"].numpy()
    images[-1, 0, 0, 0] = np.nan
    bad = {**_batch(), "image": tf.constant(images)}
    with strategy.scope():
        model = bn_model()
        optimizer = optimizers.create("sgd", 0.01, model.trainable_variables, momentum=0.0)
    options = step.StepOptions(batch_size=8)
    loop, _ = step_loop(strategy, model, optimizer, classification(), options)
    good = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(_batch()).repeat()))
    loop(good, tf.constant(1), tf.constant(0.0))
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    poisoned = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(bad).repeat()))
    sums, _ = loop(poisoned, tf.constant(1), tf.constant(0.0))
    assert float(sums["skipped"][0]) > 0
    for a, b in zip(before, [v.numpy() for v in model.non_trainable_variables]):
        np.testing.assert_array_equal(a, b)  # no NaN moved into the moving statistics
    assert np.all(np.isfinite(model.predict(_batch()["image"], verbose=0)))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signals_stop_start_up_at_once_and_training_at_the_next_save(signum):
    """Before training: StoppedAtStartUp, which `except Exception` (AutoGraph's
    fallback, a library's retry) does not swallow. In training: a flag."""
    with faults.StopSignals() as stop:
        with pytest.raises(faults.StoppedAtStartUp, match=signal.Signals(signum).name):
            try:
                os.kill(os.getpid(), signum)
                time.sleep(1)  # (the handler runs at the next bytecode)
            except Exception:  # noqa: BLE001 (what must not catch it)
                pytest.fail("a stop signal was caught as an Exception")

        def seen(count: int) -> None:  # by the watcher thread
            deadline = time.time() + 60
            while stop.signals_seen < count and time.time() < deadline:
                time.sleep(0.01)
        # (a real program ends at StoppedAtStartUp; this one goes on, once the
        # watcher has read that signal, as it would before any training)
        seen(1)
        stop.stopped_at_start_up = None  # (or training would not start: next test)
        with stop.while_training():
            assert float(stop.flag.numpy()) == 0.0
            os.kill(os.getpid(), signum)
            seen(2)  # answered by the watcher, whatever the main thread does
            assert stop.requested and stop.signal == signal.Signals(signum).name
            assert float(stop.flag.numpy()) == 1.0  # what the in-graph loop reads
    assert signal.getsignal(signum) is not stop._handle  # the previous one is back


def test_a_start_up_stop_mangled_or_swallowed_on_its_way_still_stops():
    """The handler's StoppedAtStartUp, raised inside C code, came out of
    TensorFlow's tracing as `SystemError: bad argument to internal function`
    (.ci/run, a SIGHUP 6 s into start-up): leaving the watcher's block, such an
    error is the stop again; one a library swallowed is raised again as training
    would start."""
    def landed_in_c_code(stop):
        try:
            stop._handle(signal.SIGHUP, None)
        except BaseException as err:  # noqa: BLE001 (what C code does with it)
            raise SystemError("bad argument to internal function") from err

    with pytest.raises(faults.StoppedAtStartUp, match="SIGHUP during start-up"):
        with faults.StopSignals() as stop:
            landed_in_c_code(stop)
    with pytest.raises(faults.StoppedAtStartUp, match="SIGTERM during start-up"):
        with faults.StopSignals() as stop:
            try:
                stop._handle(signal.SIGTERM, None)
            except BaseException:  # noqa: BLE001 (a library's catch-all)
                pass
            with stop.while_training():
                pytest.fail("training started after a stop signal")
    with pytest.raises(ValueError):  # (any other error stays itself)
        with faults.StopSignals():
            raise ValueError("not a signal")


@pytest.mark.long(8)  # seconds, with -n 2
def test_a_stop_during_an_evaluation_ends_it_and_saves_that_step(tiny_config,
                                                                  monkeypatch):
    from trainer import evaluation, loop
    original = evaluation.evaluate
    calls = []

    def evaluate_and_be_stopped(*args, **kwargs):
        calls.append(kwargs.get("stop_requested") or args[-1])
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the evaluation starts
        time.sleep(0.1)
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", evaluate_and_be_stopped)
    config = tiny_config.replace(eval_every=2, checkpoint_every=4)
    with pytest.raises(faults.Preempted, match="stopped by SIGINT: saved a checkpoint "
                                               "at step 2"):
        loop.train_and_evaluate(config)
    assert tf.train.latest_checkpoint(config.model_dir).endswith("ckpt-2")
    assert len(calls) == 1  # stopped before its first step, not after the test set


class _Metadata:
    """A stand-in for a Google Cloud VM's metadata server on 127.0.0.1: answers
    instance/maintenance-event and instance/preempted (only with the
    Metadata-Flavor header, as the real one), with an ETag, at once."""

    def __init__(self):
        import http.server
        import threading
        self.values = {"maintenance-event": "NONE", "preempted": "FALSE"}
        self.asked = 0
        metadata = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                key = self.path.split("?")[0].rsplit("/", 1)[-1]
                if self.headers.get("Metadata-Flavor") != "Google" or (
                        key not in metadata.values):
                    self.send_error(403 if key in metadata.values else 404)
                    return
                metadata.asked += 1
                value = metadata.values[key].encode()
                self.send_response(200)
                self.send_header("ETag", str(hash(value)))
                self.end_headers()
                self.wfile.write(value)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.long(20)  # seconds, with -n 2
def test_a_vms_maintenance_notice_stops_the_run_as_a_signal_does(tmp_path):
    """TERMINATE_ON_HOST_MAINTENANCE in the VM's metadata (what a Compute Engine
    or TPU VM says before a host maintenance stops it): the run says so, saves the
    next step and exits 75, as for SIGTERM."""
    metadata = _Metadata()
    model_dir = str(tmp_path / "run")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP=metadata.address)
    proc = subprocess.Popen([sys.executable, "-m", "trainer.main", *RESUME,
                             "--train_steps=100000", "--checkpoint_every=100000",
                             f"--model_dir={model_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while "step 2/" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, "the run ended before training"
    assert metadata.asked >= 2  # both notices watched, nothing noticed yet
    metadata.values["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
    output = proc.communicate(timeout=120)[0]
    metadata.server.shutdown()
    assert proc.returncode == faults.STOPPED_EXIT_CODE, output[-2000:]
    said = "maintenance-event TERMINATE_ON_HOST_MAINTENANCE (the VM's notice): stopping"
    assert said in output, output[-2000:]
    stopped = re.search(r"stopped: stopped by maintenance-event .*: saved a checkpoint "
                        r"at step (\d+)", output)
    assert stopped and "Traceback" not in output, output[-2000:]
    assert tf.train.latest_checkpoint(model_dir).endswith(f"ckpt-{stopped.group(1)}")
