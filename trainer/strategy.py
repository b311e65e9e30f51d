"""Which devices run the step: strategy selection, TPU fallback, precision and XLA.

The automatic choices, and the measurements behind them (2-core x86 CPU with
AVX512-BF16, TF 2.21, see BUILD.md "Defaults and the evidence"):
- XLA: compiled on TPU (always) and GPU; not on the CPU, where jit_compile made the
  seed convnet's step 4-5x slower than the default oneDNN kernels.
- Precision: mixed_bfloat16 on TPU (native MXU format); on GPU mixed_bfloat16 from
  Ampere (compute capability 8) on, mixed_float16 with loss scaling on Volta/Turing;
  on a CPU with native bf16 instructions mixed_bfloat16 (about 2x faster on the
  seed convnet here), otherwise float32.
"""
import dataclasses
import functools
import os

from absl import logging
import keras
import tensorflow as tf

from trainer import settings

STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")
PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")

_ = settings.section("devices")  # (--help's heading of each field below)


@dataclasses.dataclass(frozen=True)
class DeviceSettings:
    """Which devices a run uses and how it computes there (flags of the same
    names); a resumed run may change all of them but the precision."""
    tpu: str | None = _(None, "TPU name, grpc:// address, or 'local' (TPU VM). If none "
                        "is found the run falls back to GPU/CPU with a warning.",
                        resume=True)
    require_tpu: bool = _(False, "Fail instead of falling back when no TPU is found.",
                          resume=True)
    strategy: str = _("auto", f"{'|'.join(STRATEGIES)}; auto: a TPU if reachable, else "
                      "all GPUs (Mirrored), else the CPU.", choices=STRATEGIES, resume=True)
    cpu_replicas: int = _(1, "Split the host CPU into N logical devices and run N "
                          "replicas with MirroredStrategy (debug distribution on a "
                          "laptop).", low=0, low_open=True, resume=True)
    jit_compile: str = _("auto", "auto|true|false: XLA-compile the step. auto: on TPU "
                         "and GPU, not on the CPU (measured 1.6-7x slower there).",
                         choices=("auto", "true", "false"), resume=True)
    precision: str = _("auto", f"{'|'.join(PRECISIONS)}. auto: bf16 on TPU, bf16/fp16 "
                       "on GPU by generation, bf16 on CPUs with native bf16, else "
                       "float32.", choices=PRECISIONS)
    worker_timeout: int = _(60, "Multi-worker runs: seconds a worker may stop answering "
                            "(paused by a VM migration, swapping, a long GC) before the "
                            "run ends, naming it; the others wait for it until then.",
                            low=1, resume=True)


class DeviceError(RuntimeError):
    """The requested devices are not available; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    strategy: tf.distribute.Strategy
    device_kind: str  # "tpu", "gpu" or "cpu"
    precision: str = "float32"  # the Keras policy the run computes in (set_up)
    jit: bool = False           # whether the step is XLA-compiled (set_up)

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def name(self) -> str:
        """The public name (MultiWorkerMirroredStrategy's class is CollectiveAllReduce)."""
        name = type(self.strategy).__name__
        return "MultiWorkerMirroredStrategy" if "CollectiveAllReduce" in name else name

    def describe(self) -> str:
        devices = ", ".join(self.strategy.extended.worker_devices)
        return (f"{self.name} on {self.device_kind.upper()}, "
                f"{self.num_replicas} replica(s): {devices}")

    def about(self) -> dict:
        """What metrics.json says of the devices a run ran on."""
        return {"strategy": self.name, "replicas": self.num_replicas,
                "device": self.device_kind, "precision": self.precision,
                "jit_compile": self.jit}


def set_up(devices: DeviceSettings, deterministic: bool = False, seed: int = 0
           ) -> Runtime:
    """The run's devices, ready: the strategy (`create`), its precision (set as
    Keras' global policy) and XLA choice, Keras' seeds and, with `deterministic`,
    deterministic ops."""
    runtime = create(devices.strategy, devices.tpu, devices.require_tpu,
                     devices.cpu_replicas, devices.worker_timeout)
    precision = resolve_precision(devices.precision, runtime.device_kind, deterministic)
    jit = resolve_jit(devices.jit_compile, runtime.device_kind, runtime.num_replicas)
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    return dataclasses.replace(runtime, precision=precision, jit=jit)


def split_cpu(num_devices: int) -> list[str]:
    """Splits the host CPU into `num_devices` logical devices (before TF starts).

    If TensorFlow already runs with at least that many logical CPUs (a test process,
    say), those are reused.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError:
        pass  # already initialized; check below that there are enough
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < num_devices:
        raise DeviceError(
            f"TensorFlow already started with {len(devices)} CPU device(s), cannot "
            f"make {num_devices}: set --cpu_replicas before any TensorFlow op runs")
    return devices[:num_devices]


@functools.lru_cache(maxsize=None)
def mirrored(devices: tuple[str, ...] | None = None) -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy per device set and process.

    Two MirroredStrategy objects in one process (a notebook running two trainings, a
    test session) can reuse each other's collective keys and fail with "Shape mismatch
    in the collective instance"; sharing the object avoids that.
    """
    return tf.distribute.MirroredStrategy(devices=list(devices) if devices else None)


def _connect_tpu(tpu: str):
    """Returns a TPUClusterResolver for an initialized TPU system, or None."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        if tpu != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return resolver
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        logging.info("No TPU at %r: %s", tpu, str(err).splitlines()[0])
        return None


def _tpu_hinted() -> bool:
    """A TPU is announced locally; never probes the network."""
    return bool(os.environ.get("TPU_NAME") or tf.config.list_physical_devices("TPU"))


def create(strategy: str = "auto", tpu: str | None = None, require_tpu: bool = False,
           cpu_replicas: int = 1, worker_timeout: int = 60) -> Runtime:
    """Builds the distribution strategy. See the flag help in trainer/main.py."""
    cpu_devices = split_cpu(cpu_replicas) if cpu_replicas > 1 else ["/cpu:0"]
    if strategy == "tpu" or (strategy == "auto" and (tpu or _tpu_hinted())):
        name = tpu or os.environ.get("TPU_NAME") or "local"
        resolver = _connect_tpu(name)
        if resolver is not None:
            return Runtime(tf.distribute.TPUStrategy(resolver), "tpu")
        if require_tpu or strategy == "tpu":
            raise DeviceError(
                f"no TPU found at --tpu={name}; check the TPU name/address, or drop "
                f"--require_tpu/--strategy=tpu to fall back to GPUs/CPU")
        logging.warning("\n%s\n!! NO TPU FOUND at --tpu=%s: FALLING BACK TO GPU/CPU. "
                        "Pass --require_tpu to make this an error.\n%s",
                        "!" * 78, name, "!" * 78)
    gpus = tf.config.list_physical_devices("GPU")
    kind = "gpu" if gpus else "cpu"
    if strategy == "multi_worker":
        if "TF_CONFIG" not in os.environ:
            raise DeviceError("--strategy=multi_worker needs TF_CONFIG in the environment "
                              "(python -m trainer.tools.launch sets it up on one machine)")
        _coordinate_workers(worker_timeout)
        return Runtime(tf.distribute.MultiWorkerMirroredStrategy(), kind)
    if strategy == "one_device":
        return Runtime(tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0"),
                       kind)
    if gpus:
        return Runtime(mirrored(), kind)
    if strategy == "mirrored" or cpu_replicas > 1:
        return Runtime(mirrored(tuple(cpu_devices)), kind)
    return Runtime(tf.distribute.OneDeviceStrategy("/cpu:0"), kind)


def _coordinate_workers(timeout_seconds: int) -> None:
    """The coordination service MultiWorkerMirroredStrategy starts, as it would
    configure it, but with a worker declared lost after `timeout_seconds` without
    a heartbeat instead of TensorFlow's 10 s: a worker paused for 10 s (SIGSTOP, a
    VM migration) ended the run, and its healthy peer reported the loss. Through
    TensorFlow's private context and multi_worker_util, as the strategy itself
    does (tests/test_private_apis.py fails loudly if an upgrade changes them)."""
    from tensorflow.python.distribute import multi_worker_util
    # (the proto module the strategy itself imports: its path moves between versions)
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2)
    from tensorflow.python.eager import context
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster_spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    if resolver.task_type not in ("chief", "worker") or (
            context.context().coordination_service is not None):
        return  # (the strategy configures what it needs)
    jobs = [coordination_config_pb2.CoordinatedJob(name=job,
                                                   num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        coordinated_jobs=jobs, heartbeat_timeout_in_ms=timeout_seconds * 1000)


def _cpu_has_bf16() -> bool:
    try:
        # Line by line: /proc files report size 0, so a whole-file read() through
        # tf.io.gfile returns nothing.
        with tf.io.gfile.GFile("/proc/cpuinfo") as f:
            flags = "".join(f)
    except tf.errors.OpError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device_kind: str,
                      deterministic: bool = False) -> str:
    """The Keras mixed-precision policy name for `--precision` on this device.

    deterministic: on a CPU, auto means float32. Measured here: two identical
    --deterministic runs of the seed convnet in mixed_bfloat16 ended with different
    weights (oneDNN's bf16 kernels), in float32 with bitwise equal ones.
    """
    if precision != "auto":
        if deterministic and device_kind == "cpu" and precision != "float32":
            logging.warning("--deterministic with --precision=%s on a CPU is not bitwise "
                            "reproducible (oneDNN's reduced-precision kernels); use "
                            "float32", precision)
        return precision
    if deterministic and device_kind == "cpu":
        logging.info("--deterministic: float32 on the CPU (bf16 kernels here are not "
                     "bitwise reproducible)%s", "; TensorFlow's kernels, not oneDNN's"
                     if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" else "")
        return "float32"
    if device_kind == "tpu":
        return "mixed_bfloat16"
    if device_kind == "gpu":
        details = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0])
        major = details.get("compute_capability", (0, 0))[0]
        return "mixed_bfloat16" if major >= 8 else (
            "mixed_float16" if major >= 7 else "float32")
    return "mixed_bfloat16" if _cpu_has_bf16() else "float32"


def resolve_jit(jit_compile: str, device_kind: str, num_replicas: int = 1) -> bool:
    if jit_compile == "auto":
        return device_kind in ("tpu", "gpu")
    if jit_compile == "true" and device_kind == "cpu" and num_replicas > 1:
        # Measured: XLA-compiled steps on several logical CPU devices read a
        # variable copy of another device and fail.
        raise DeviceError("--jit_compile=true does not work with several CPU replicas; "
                          "drop --jit_compile or --cpu_replicas")
    return jit_compile == "true"


def worker_role(strategy: tf.distribute.Strategy) -> tuple[bool, int]:
    """(is_chief, task_id): the chief alone writes summaries, metrics and weights."""
    return _role(getattr(strategy, "cluster_resolver", None))


def _role(resolver) -> tuple[bool, int]:
    """(is_chief, task_id) of a cluster resolver: the "chief" task, or worker 0 in a
    cluster without one; every process outside a cluster."""
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True, 0
    task_type, task_id = resolver.task_type, resolver.task_id or 0
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return task_type == "chief" or (task_type == "worker" and task_id == 0
                                    and not has_chief), task_id


def is_chief_process(strategy: str) -> bool:
    """Whether this process is the chief, from TF_CONFIG, before a strategy exists
    (worker_role's rule): every process but the other workers of a multi_worker job."""
    if strategy != "multi_worker":
        return True
    try:
        return _role(tf.distribute.cluster_resolver.TFConfigClusterResolver())[0]
    except (ValueError, AttributeError, TypeError, KeyError):
        return True  # strategy.create names a bad TF_CONFIG


def leave_together(strategy: tf.distribute.Strategy) -> None:
    """In a multi-worker run, every worker waits here for the others: the chief
    hosts the coordination service the others still use, so it must not leave
    first."""
    if is_multi_worker(strategy):
        strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    return strategy.extended._in_multi_worker_mode()  # noqa: SLF001 (no public API)


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Processes that each feed their own input pipelines (1 unless multi-worker)."""
    if not is_multi_worker(strategy):
        return 1
    return max(1, strategy.num_replicas_in_sync // len(strategy.extended.worker_devices))
