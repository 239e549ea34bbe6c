"""One load of the source model per job in one process (issue 11 item 9), and none kept after it."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

from kiln_testing.tf_models import keras_cnn
from services.pipeline import compile_model
from services.runners import tensorflow as tf_runner
from services.spec import load_spec
from services.steps.source_memo import job_memo, memoized


def test_loads_once_inside_a_job_and_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"one")
    loads: list[bytes] = []

    def load() -> bytes:
        loads.append(path.read_bytes())
        return loads[-1]

    with job_memo():
        first = memoized("raw", path, load)
        assert memoized("raw", path, load) is first
        assert memoized("other kind", path, load) == b"one"  # kinds never share
        with job_memo():  # a nested scope keeps the outer memo
            assert memoized("raw", path, load) is first
        path.write_bytes(b"two!")
        os.utime(path, ns=(1, 1))
        assert memoized("raw", path, load) == b"two!"
    assert loads == [b"one", b"one", b"two!"]
    memoized("raw", path, load)
    memoized("raw", path, load)
    assert len(loads) == 5  # outside a job nothing is kept


def test_a_keras_job_loads_and_traces_its_source_once(tmp_path: Path, store, repository) -> None:
    keras = keras_cnn(tmp_path / "cnn.keras")
    spec = load_spec({"targets": ["onnxruntime", "tfserving"], "benchmark": False})
    with (
        mock.patch.object(tf_runner, "_load_keras_model", wraps=tf_runner._load_keras_model) as load,
        mock.patch.object(tf_runner, "keras_serving_function", wraps=tf_runner.keras_serving_function) as trace,
    ):
        result = compile_model(keras, spec, store=store, repository=repository, use_cache=False)
    assert result.ok, {t: r.error for t, r in result.targets.items()}
    # reference, keras-to-savedmodel and keras-to-onnx all read the source
    assert {"reference", "keras-to-savedmodel", "keras-to-onnx"} <= set(result.steps)
    assert load.call_count == 1
    # one trace shared by the reference, the SavedModel and tf2onnx
    assert trace.call_count == 1
    assert tf_runner.load_keras_model(keras) is not tf_runner.load_keras_model(keras)  # job over: nothing kept
