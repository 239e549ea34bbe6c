"""The tfserving target: repository layout, models.config parsed by TF Serving's own proto, the
signature in the manifest, fp16/int8 weight storage, and the issue's CLI line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from jobs_support import KILN_CMD

from kiln_testing.tf_models import IMAGE, image_calibration, keras_cnn, keras_mlp, keras_two_inputs
from services.pipeline import compile_model
from services.repository.publish import read_manifest
from services.spec import load_spec


@pytest.fixture(scope="session")
def tf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "tf-models"
    path.mkdir(exist_ok=True)
    return path


def _spec(precision: str = "fp32", **extra):
    return load_spec({"targets": ["tfserving"], "precision": precision, "benchmark": False, "optimize": False, **extra})


def _parse_models_config(path: Path):
    from tensorflow_serving.config import model_server_config_pb2

    return text_format.Parse(path.read_text(), model_server_config_pb2.ModelServerConfig())


def test_layout_models_config_and_manifest(tf_dir: Path, store, repository, repo_dir: Path) -> None:
    cnn = compile_model(keras_cnn(tf_dir / "cnn.keras"), _spec(name="cnn"), store=store, repository=repository)
    two = compile_model(
        keras_two_inputs(tf_dir / "two_inputs.keras"), _spec(name="two"), store=store, repository=repository
    )
    for result in (cnn, two):
        assert result.targets["tfserving"].status == "succeeded", result.targets["tfserving"].error

    # <repo>/tfserving/<name>/<version>/saved_model.pb + variables/, as TF Serving's file system source expects.
    version = repo_dir / "tfserving" / "cnn" / "1"
    assert (version / "saved_model.pb").is_file()
    assert (version / "variables" / "variables.index").is_file()
    assert not (version / "kiln-artifact.json").exists()

    config = _parse_models_config(repo_dir / "tfserving" / "models.config")
    entries = {c.name: c for c in config.model_config_list.config}
    assert sorted(entries) == ["cnn", "two"]
    for name, entry in entries.items():
        assert entry.model_platform == "tensorflow"
        assert Path(entry.base_path) == (repo_dir / "tfserving" / name).resolve()
        assert entry.model_version_policy.WhichOneof("policy_choice") == "all"
    ovms = json.loads((repo_dir / "ovms" / "config.json").read_text())
    assert sorted(m["config"]["name"] for m in ovms["model_config_list"]) == ["cnn", "two"]

    manifest = read_manifest(repository, "cnn", 1)
    sig = manifest["engine_details"]["tfserving"]["signature"]
    assert sig == {
        "signature": "serving_default",
        "method": "tensorflow/serving/predict",
        "inputs": {"image": "serving_default_image:0"},
        "outputs": {"logits": "StatefulPartitionedCall:0"},
        "tags": ["serve"],
    }
    assert manifest["io"]["inputs"] == [{"name": "image", "dtype": "float32", "shape": [None, *IMAGE]}]
    assert manifest["route"] == "keras → savedmodel ⇒ tfserving"
    assert manifest["parity"]["outputs"][0]["max_abs"] == 0.0  # the same graph Keras ran


def test_published_savedmodel_serves_its_signature(tf_dir: Path, store, repository, repo_dir: Path) -> None:
    """The published directory, loaded as TF Serving would, answers like the Keras model."""
    import tensorflow as tf

    from services.runners.tensorflow import KerasRunner

    src = keras_two_inputs(tf_dir / "two_inputs.keras")
    result = compile_model(src, _spec(name="two"), store=store, repository=repository)
    assert result.targets["tfserving"].status == "succeeded"
    loaded = tf.saved_model.load(str(repo_dir / "tfserving" / "two" / "1"), tags=["serve"])
    fn = loaded.signatures["serving_default"]
    rng = np.random.default_rng(9)
    feeds = {
        "features": rng.standard_normal((3, 8)).astype("float32"),
        "extra": rng.standard_normal((3, 4)).astype("float32"),
    }
    served = fn(**{k: tf.constant(v) for k, v in feeds.items()})
    want = KerasRunner(src).run(feeds)
    for name in ("prob", "score"):
        np.testing.assert_allclose(served[name].numpy(), want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("precision", "ratio"), [("fp16", 0.5), ("int8", 0.25)])
def test_reduced_precision_stores_smaller_weights(
    precision: str, ratio: float, tf_dir: Path, store, repository, repo_dir: Path
) -> None:
    src = keras_mlp(tf_dir / "mlp.keras")
    fp32 = compile_model(src, _spec(name="mlp32"), store=store, repository=repository)
    low = compile_model(src, _spec(precision, name="mlplow"), store=store, repository=repository)
    for result in (fp32, low):
        assert result.targets["tfserving"].status == "succeeded", result.targets["tfserving"].error
    details = read_manifest(repository, "mlplow", 1)["engine_details"]["tfserving"][precision]
    assert details["compute"] == "float32" and details["frozen"] is True
    assert details["constants_compressed"] >= 3  # the three Dense kernels at least
    assert details["weight_bytes_stored"] / details["weight_bytes_fp32"] == pytest.approx(ratio, abs=0.02)

    def size(name: str) -> int:
        return sum(
            p.stat().st_size
            for p in (repo_dir / "tfserving" / name / "1").rglob("*")
            if p.is_file() and p.suffix != ".json"
        )

    assert size("mlplow") / size("mlp32") == pytest.approx(ratio, abs=0.06)
    parity = low.targets["tfserving"].parity["outputs"][0]
    assert parity["cosine"] > 0.999 and parity["top1"] >= 0.9  # weight-only: close to fp32
    assert (repo_dir / "tfserving" / "mlplow" / "1" / "variables").is_dir()  # TF Serving's loader wants it


def test_issue_cli_line(tf_dir: Path, tmp_path: Path) -> None:
    """`kiln compile model.keras --target tflite --target tfserving --precision int8 --calibration calib.npz --repo DIR --name NAME`"""
    model = tmp_path / "model.keras"
    model.write_bytes(keras_cnn(tf_dir / "cnn.keras").read_bytes())
    image_calibration(tmp_path / "calib.npz", "image", IMAGE)
    repo = tmp_path / "DIR"
    env = {**os.environ, "COLUMNS": "200", "KILN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [*KILN_CMD, "compile", "model.keras", "--target", "tflite", "--target", "tfserving", "--precision", "int8",
         "--calibration", "calib.npz", "--repo", str(repo), "--name", "NAME"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (repo / "tflite" / "NAME-tflite" / "1" / "model.tflite").is_file()
    assert (repo / "tfserving" / "NAME-tfserving" / "1" / "saved_model.pb").is_file()
    assert (repo / "tfserving" / "NAME-tfserving" / "1" / "variables").is_dir()
    config = _parse_models_config(repo / "tfserving" / "models.config")
    assert [c.name for c in config.model_config_list.config] == ["NAME-tfserving"]
    tflite = json.loads((repo / "tflite" / "NAME-tflite" / "1" / "kiln-manifest.json").read_text())
    assert tflite["precision"] == "int8" and tflite["engine_details"]["tflite"]["mode"] == "full-integer int8"
    assert [t["dtype"] for t in [*tflite["io"]["inputs"], *tflite["io"]["outputs"]]] == ["float32", "float32"]
    assert tflite["parity"]["passed"] is True and tflite["parity"]["inputs_from"] == "calibration"
    tfserving = json.loads((repo / "tfserving" / "NAME-tfserving" / "1" / "kiln-manifest.json").read_text())
    assert tfserving["precision"] == "int8" and tfserving["parity"]["passed"] is True
    assert tfserving["benchmark"] and tfserving["benchmark"][0]["p50_ms"] > 0
