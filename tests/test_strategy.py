"""Device selection and the automatic precision/XLA choices."""
import pytest

from trainer import strategy as strategy_lib


def test_cpu_replicas_give_a_mirrored_strategy_with_that_many_replicas():
    runtime = strategy_lib.create("auto", cpu_replicas=2)
    assert type(runtime.strategy).__name__ == "MirroredStrategy"
    assert runtime.num_replicas == 2 and runtime.device_kind == "cpu"
    assert "2 replica(s)" in runtime.describe()


def test_auto_on_a_plain_cpu_is_one_device():
    runtime = strategy_lib.create("auto")
    assert type(runtime.strategy).__name__ == "OneDeviceStrategy"


def test_too_many_cpu_replicas_after_start_is_a_clear_error():
    with pytest.raises(strategy_lib.DeviceError, match="cannot make 5"):
        strategy_lib.create("auto", cpu_replicas=5)


def test_local_tpu_missing_falls_back_or_fails_when_required():
    runtime = strategy_lib.create("auto", tpu="local")
    assert runtime.device_kind == "cpu"
    with pytest.raises(strategy_lib.DeviceError, match="no TPU found at --tpu=local"):
        strategy_lib.create("auto", tpu="local", require_tpu=True)


def test_multi_worker_without_tf_config_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(strategy_lib.DeviceError, match="needs TF_CONFIG"):
        strategy_lib.create("multi_worker")


@pytest.mark.parametrize("device,expected", [("tpu", True), ("gpu", True), ("cpu", False)])
def test_auto_jit_compiles_except_on_cpu(device, expected):
    assert strategy_lib.resolve_jit("auto", device) is expected
    assert strategy_lib.resolve_jit("false", device) is False


def test_xla_on_several_cpu_replicas_is_a_clear_error():
    with pytest.raises(strategy_lib.DeviceError, match="several CPU replicas"):
        strategy_lib.resolve_jit("true", "cpu", num_replicas=2)


def test_precision_auto_and_explicit():
    assert strategy_lib.resolve_precision("auto", "tpu") == "mixed_bfloat16"
    assert strategy_lib.resolve_precision("float32", "tpu") == "float32"
    assert strategy_lib.resolve_precision("auto", "cpu") in ("mixed_bfloat16", "float32")


def test_deterministic_runs_use_float32_on_cpu_by_default():
    assert strategy_lib.resolve_precision("auto", "cpu", deterministic=True) == "float32"
    assert strategy_lib.resolve_precision("auto", "tpu", deterministic=True) == (
        "mixed_bfloat16")
    # An explicit choice is kept (with a warning in the log).
    assert strategy_lib.resolve_precision("mixed_bfloat16", "cpu", True) == (
        "mixed_bfloat16")
