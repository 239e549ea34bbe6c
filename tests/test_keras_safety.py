"""Keras files carrying Python code are refused with UNSAFE_INPUT, and the code never runs."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from kiln_testing.tf_models import keras_cnn
from services.errors import UnsafeInput
from services.formats.keras_safety import check_keras_file, find_code_payloads, read_keras_config
from services.pipeline import compile_model
from services.spec import load_spec


def _lambda_model(dest: Path, marker: Path, fmt: str) -> Path:
    """Save a model whose Lambda writes ``marker`` whenever its function runs; remove the marker."""
    import keras

    # The path is a literal inside the lambda's bytecode, so running the stored code writes it.
    payload = eval(f"lambda t: (open({str(marker)!r}, 'w').write('payload ran'), t)[1]")
    inp = keras.Input((4,), name="x")
    hidden = keras.layers.Lambda(payload, name="payload")(inp)
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(hidden), name=f"lambda_{fmt}")
    path = dest / f"lambda.{fmt}"
    model.save(path)
    # Building the model traced the lambda once, in this (trusted) process: start clean.
    assert marker.exists()
    marker.unlink()
    return path


@pytest.fixture(scope="module")
def lambda_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("lambda")
    marker = d / "PAYLOAD_RAN"
    return _lambda_model(d, marker, "keras"), _lambda_model(d, marker, "h5"), marker


def test_config_walk_finds_lambda_in_both_formats(lambda_files: tuple[Path, Path, Path]) -> None:
    keras_file, h5_file, marker = lambda_files
    for path in (keras_file, h5_file):
        with pytest.raises(UnsafeInput) as exc:
            check_keras_file(path)
        assert exc.value.code == "UNSAFE_INPUT"
        assert f"Lambda layer lambda_{path.suffix[1:]}/payload" in exc.value.message
        assert "register_keras_serializable" in exc.value.hint and "SavedModel" in exc.value.hint
    assert not marker.exists()


def test_clean_model_passes(tmp_path: Path) -> None:
    cnn = keras_cnn(tmp_path / "cnn.keras")
    config = check_keras_file(cnn)
    assert config["class_name"] == "Functional"
    assert find_code_payloads(read_keras_config(cnn)) == []


def test_legacy_marshalled_function_is_found() -> None:
    # tf.keras 2.x wrote Lambda functions as [base64 bytecode, defaults, closure] + function_type.
    legacy = {
        "class_name": "Sequential",
        "config": {
            "name": "seq",
            "layers": [
                {
                    "class_name": "Wrapper",
                    "config": {"name": "w", "function": ["4wEAAAAA", None, None], "function_type": "lambda"},
                }
            ],
        },
    }
    assert find_code_payloads(legacy) == ["marshalled Python function in seq/w"]


def test_compile_refuses_and_payload_never_runs(
    lambda_files: tuple[Path, Path, Path], tmp_path: Path, store, repository
) -> None:
    keras_file, h5_file, marker = lambda_files
    spec = load_spec({"targets": ["tflite", "onnxruntime"], "optimize": False})
    for path in (keras_file, h5_file):
        result = compile_model(path, spec, store=store, repository=repository)
        assert not result.ok
        assert "reference" not in result.steps  # the job failed at its first step
        for target in result.targets.values():
            assert target.status == "failed"
            assert target.error is not None and target.error["code"] == "UNSAFE_INPUT"
        assert not marker.exists(), "the Lambda's code ran"
    assert repository.model_names() == []


def test_safe_mode_is_the_second_line(lambda_files: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the config walk disabled (fault injected), Keras safe mode still refuses, still as UNSAFE_INPUT."""
    import services.runners.tensorflow as tf_runners

    keras_file, _, marker = lambda_files
    monkeypatch.setattr(tf_runners, "check_keras_file", lambda path: {})
    with pytest.raises(UnsafeInput) as exc:
        tf_runners.load_keras_model(keras_file)
    assert "safe mode" in exc.value.message
    assert not marker.exists()


def test_tampered_archive_is_caught_before_loading(tmp_path: Path) -> None:
    """A Lambda smuggled into an otherwise clean .keras archive's config.json is found."""
    clean = keras_cnn(tmp_path / "cnn.keras")
    tampered = tmp_path / "tampered.keras"
    with zipfile.ZipFile(clean) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "config.json":
                config = json.loads(data)
                layer = config["config"]["layers"][2]
                layer["config"]["activation"] = {"class_name": "__lambda__", "config": {"code": "4wEAAAAA"}}
                data = json.dumps(config).encode()
            dst.writestr(item, data)
    with pytest.raises(UnsafeInput) as exc:
        check_keras_file(tampered)
    assert "Python lambda bytecode" in exc.value.message


def test_the_payload_is_live_when_loaded_unsafely(lambda_files: tuple[Path, Path, Path]) -> None:
    # The control for the tests above: the same files, loaded the unsafe way in another
    # process, do run the stored code (so "the marker never appeared" means Kiln stopped it).
    import subprocess
    import sys

    keras_file, h5_file, marker = lambda_files
    script = (
        "import sys, numpy as np, keras\n"
        "model = keras.saving.load_model(sys.argv[1], safe_mode=False)\n"
        "model(np.zeros((1, 4), np.float32))\n"
    )
    for path in (keras_file, h5_file):
        proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert marker.read_text() == "payload ran", path
        marker.unlink()
