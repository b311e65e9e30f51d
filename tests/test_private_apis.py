"""Every private Keras or TensorFlow API the project leans on, one test each: if an
upgrade renames, moves or changes one, its test fails here, loudly, instead of the
framework going wrong quietly. (`_all_reduce_sum_gradients`, the worst of them, is
tests/test_optimizers.py's.)"""
import inspect
import io

import keras
import numpy as np
import tensorflow as tf

from conftest import CPUS, mirrored
from models import layers
from trainer import checkpoints, optimizers
from trainer import strategy as strategy_lib


def test_in_multi_worker_mode_tells_one_process_from_a_job():
    """trainer/strategy.py: strategy.extended._in_multi_worker_mode() (True under a
    TF_CONFIG job: tests/test_multi_worker.py's runs depend on it)."""
    for strategy in (tf.distribute.OneDeviceStrategy(CPUS[0]), mirrored()):
        assert strategy.extended._in_multi_worker_mode() is False  # noqa: SLF001
        assert strategy_lib.is_multi_worker(strategy) is False


def test_get_variable_index_is_the_build_order_of_the_variables():
    """trainer/optimizers.py: optimizer._get_variable_index(variable), the index of
    the per-variable learning-rate multipliers."""
    variables = [keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones(2, np.float32))]
    optimizer = optimizers.create("sgd", 1.0, variables, momentum=0.0)
    assert [optimizer._get_variable_index(v) for v in variables] == [0, 1]  # noqa: SLF001
    optimizer.set_lr_multipliers([1.0, 3.0])
    optimizer.apply([tf.ones(3), tf.ones(2)], variables)
    np.testing.assert_allclose(variables[0].numpy(), 0.0)
    np.testing.assert_allclose(variables[1].numpy(), -2.0)  # 1 - 3 x 1


def test_strategy_supports_no_merge_call_is_false_in_a_cpu_replica_context():
    """trainer/optimizers.py: tf.__internal__.distribute.strategy_supports_no_merge_call
    picks apply_or_skip's path; on CPUs it must be the merge_call one."""
    check = tf.__internal__.distribute.strategy_supports_no_merge_call
    strategy = mirrored()
    values = strategy.run(lambda: tf.constant(float(check())))
    assert [float(v) for v in strategy.experimental_local_results(values)] == [0.0, 0.0]


def test_keras_weights_writer_takes_a_bytes_buffer():
    """trainer/checkpoints.py: keras.src.saving.saving_lib.H5IOStore(BytesIO) and
    _save_state(model, weights_store=, assets_store=, inner_path=,
    visited_saveables=) make model.save_weights' file in memory."""
    from keras.src.saving import saving_lib
    assert {"weights_store", "assets_store", "inner_path", "visited_saveables"} <= set(
        inspect.signature(saving_lib._save_state).parameters)  # noqa: SLF001
    saving_lib.H5IOStore(io.BytesIO(), mode="w").close()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    data = checkpoints.weights_h5_bytes(model)
    assert data.startswith(b"\x89HDF\r\n\x1a\n")  # an HDF5 file


def test_flatten_layers_reaches_a_layer_inside_a_nested_model():
    """models/layers.py: model._flatten_layers(include_self=False) finds the layers
    initialised from data however deep they sit."""
    inner = keras.Sequential([keras.Input((8, 8, 3)), layers.PatchWhitening(name="whiten")])
    outer = keras.Sequential([keras.Input((8, 8, 3)), inner, keras.layers.Flatten()])
    assert "whiten" in [layer.name for layer in  # noqa: SLF001
                        outer._flatten_layers(include_self=False)]
    assert layers.needs_data(outer)
    assert layers.init_from_data(outer, np.random.rand(16, 8, 8, 3).astype(np.float32)) == [
        "whiten"]


def test_is_op_determinism_enabled_follows_enable_op_determinism():
    """trainer/distributed.py: tensorflow.python.framework.config
    .is_op_determinism_enabled() decides whether the train loop may time its input
    (timestamps fail under op determinism); run in a fresh process, since enabling
    it is for the whole process."""
    import subprocess
    import sys
    code = ("import tensorflow as tf; from trainer import distributed as d; "
            "before = d.determinism_enabled(); tf.config.experimental.enable_op_determinism(); "
            "print(before, d.determinism_enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.split() == ["False", "True"], out.stderr[-1000:]


def test_get_function_gives_the_graph_of_a_called_tf_function():
    """trainer/flops.py: graph._get_function(name).graph, the body of a tf.function
    called inside the traced forward pass (its matmuls count)."""
    from trainer import flops
    inner = tf.function(lambda x: tf.matmul(x, tf.ones((6, 7))))
    traced = tf.function(lambda x: inner(x)).get_concrete_function(
        tf.TensorSpec((1, 6), tf.float32))
    call = next(op for op in traced.graph.get_operations() if "PartitionedCall" in op.type)
    body = traced.graph._get_function(call.get_attr("f").name).graph  # noqa: SLF001
    assert "MatMul" in [op.type for op in body.get_operations()]
    assert flops._graph_flops(traced.graph) == (2 * 6 * 7, 0)  # noqa: SLF001


def test_the_coordination_service_takes_the_configuration_the_strategy_would_make():
    """trainer/strategy.py's _coordinate_workers: TensorFlow's private
    multi_worker_util (normalize_cluster_spec, coordination_leader),
    coordination_config_pb2.CoordinatedJob and context().configure_coordination_
    service(..., heartbeat_timeout_in_ms=), which MultiWorkerMirroredStrategy
    itself calls, and which it skips once a configuration is there (the 2-worker
    SIGSTOP test, tests/test_multi_worker.py, shows the timeout taking effect)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as car
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2)
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    spec = multi_worker_util.normalize_cluster_spec(
        {"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    assert multi_worker_util.coordination_leader(spec) == "/job:worker/replica:0/task:0"
    assert coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=2).num_tasks == 2
    parameters = inspect.signature(context.Context.configure_coordination_service).parameters
    assert {"service_type", "service_leader", "coordinated_jobs",
            "heartbeat_timeout_in_ms"} <= set(parameters)
    # The strategy configures the service only if none is: ours then stands.
    assert "context.context().coordination_service is None" in inspect.getsource(
        car.CollectiveAllReduceExtended._initialize_multi_worker)


def test_convert_variables_to_constants_v2_freezes_a_keras_models_variables():
    """trainer/serving/tflite.py: tensorflow.python.framework.convert_to_constants
    .convert_variables_to_constants_v2(concrete_function) makes a Keras 3 model's
    variables constants (TFLite's converter leaves them VAR_HANDLE ops whose values
    the file lacks: NaN out), the outputs flat, in tf.nest's order."""
    from tensorflow.python.framework import convert_to_constants
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    function = tf.function(lambda x: {"b": model(x) + 1.0, "a": model(x)}).get_concrete_function(
        tf.TensorSpec((1, 3), tf.float32))
    frozen = convert_to_constants.convert_variables_to_constants_v2(function)
    assert not frozen.graph.variables and not any(
        op.type in ("VarHandleOp", "ReadVariableOp") for op in frozen.graph.get_operations())
    x = tf.ones((1, 3))
    flat = frozen(x)
    expected = function(x)
    np.testing.assert_allclose(tf.nest.pack_sequence_as(function.structured_outputs, flat)["b"],
                               expected["b"])
    np.testing.assert_allclose(flat[0], expected["a"])  # (sorted keys: "a" first)
