"""Freezing TensorFlow functions without rebuilding them, and the garbage collection around
tf2onnx's optimizers (issue 11 item 9: the compile's time and peak memory)."""

from __future__ import annotations

import gc
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from kiln_testing.tf_models import keras_cnn
from services.converters import tensorflow_to_onnx, tf_freezing
from services.converters.tf_freezing import freeze_function


def _run_graph_def(frozen: tf_freezing.FrozenGraph, feed: np.ndarray) -> list[np.ndarray]:
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(frozen.graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        return sess.run(frozen.outputs, {frozen.inputs[0]: feed})


@pytest.fixture(scope="module")
def cnn_function(tmp_path_factory: pytest.TempPathFactory):
    import tensorflow as tf

    from services.runners.tensorflow import keras_serving_function, load_keras_model

    model = load_keras_model(keras_cnn(tmp_path_factory.mktemp("freeze") / "cnn.keras"))
    fn, signature = keras_serving_function(model)
    return model, tf.function(fn, input_signature=signature).get_concrete_function()


@pytest.mark.parametrize("aggressive", [False, True])
def test_frozen_graph_computes_what_the_model_does(cnn_function, aggressive: bool) -> None:
    model, concrete = cnn_function
    frozen = freeze_function(concrete, lower_control_flow=not aggressive, aggressive_inlining=aggressive)
    assert len(frozen.inputs) == 1, frozen.inputs  # the variables are constants, not inputs
    assert not [n.name for n in frozen.graph_def.node if n.op in ("VarHandleOp", "ReadVariableOp")]
    feed = np.random.default_rng(0).standard_normal((3, *model.inputs[0].shape[1:])).astype(np.float32)
    (got,) = _run_graph_def(frozen, feed)
    np.testing.assert_allclose(got, np.asarray(model(feed, training=False)), rtol=1e-5, atol=1e-6)


def test_falls_back_to_tensorflows_whole_function_when_its_internals_move(cnn_function) -> None:
    model, concrete = cnn_function
    from tensorflow.python.framework import convert_to_constants

    real = convert_to_constants._replace_variables_by_constants
    calls: list[dict] = []

    def renamed_keyword(**kwargs):  # as if a TensorFlow upgrade renamed its keyword: only Kiln's call breaks
        calls.append(kwargs)
        if len(calls) == 1:
            raise TypeError("_replace_variables_by_constants() got an unexpected keyword argument 'converter_data'")
        return real(**kwargs)

    with mock.patch.object(convert_to_constants, "_replace_variables_by_constants", renamed_keyword):
        with mock.patch.object(tf_freezing, "_whole", wraps=tf_freezing._whole) as whole:
            frozen = freeze_function(concrete)
    assert whole.call_count == 1 and len(calls) == 2
    feed = np.ones((2, *model.inputs[0].shape[1:]), np.float32)
    (got,) = _run_graph_def(frozen, feed)
    np.testing.assert_allclose(got, np.asarray(model(feed, training=False)), rtol=1e-5, atol=1e-6)


def test_each_tf2onnx_optimizer_runs_after_a_full_collection() -> None:
    from tf2onnx import optimizer

    names = list(optimizer._get_optimizers())
    collected = tensorflow_to_onnx._collected_optimizers()
    assert list(collected) == names  # the same optimizers, in tf2onnx's order

    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    try:
        made = [factory() for factory in collected.values()]
    finally:
        gc.callbacks.remove(count)
    assert len(full) >= len(names)
    assert [type(m) for m in made] == [type(f()) for f in optimizer._get_optimizers().values()]


def test_tf2onnx_conversion_leaves_the_collector_unfrozen(tmp_path: Path, store, repository) -> None:
    from services.pipeline import compile_model
    from services.spec import load_spec

    before = gc.get_freeze_count()
    result = compile_model(
        keras_cnn(tmp_path / "cnn.keras"),
        load_spec({"targets": ["onnxruntime"], "benchmark": False}),
        store=store,
        repository=repository,
    )
    assert result.ok, {t: r.error for t, r in result.targets.items()}
    assert gc.get_freeze_count() == before
