"""Model repository layouts (parsed with the serving engines' own protos) and atomic publishing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from google.protobuf import text_format

from services.artifacts import Artifact
from services.errors import RepositoryConflict
from services.repository import LocalModelRepository, publish_version, read_manifest
from services.repository.layouts import ServedModel, ovms_config_json, tfserving_models_config, triton_config_pbtxt
from services.runners import TensorSpec


def _triton(text: str):
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_triton_config_parses_with_triton_proto() -> None:
    text = triton_config_pbtxt(
        "cnn",
        inputs=[TensorSpec("input", "float32", (None, 3, 32, 32)), TensorSpec("ids", "int64", (None, 7))],
        outputs=[TensorSpec("output", "float16", (None, 10))],
        platform="onnxruntime_onnx",
        max_batch_size=8,
    )
    cfg = _triton(text)
    assert cfg.name == "cnn" and cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 8
    assert list(cfg.input[0].dims) == [3, 32, 32]  # batch axis owned by Triton
    from tritonclient.grpc import model_config_pb2 as mc

    assert cfg.input[1].data_type == mc.TYPE_INT64
    assert cfg.output[0].data_type == mc.TYPE_FP16


def test_triton_config_without_batching_keeps_all_dims_and_dynamic() -> None:
    cfg = _triton(
        triton_config_pbtxt(
            "ov",
            inputs=[TensorSpec("x", "float32", (1, None, 8))],
            outputs=[TensorSpec("y", "float32", ())],
            backend="openvino",
        )
    )
    assert cfg.backend == "openvino" and cfg.max_batch_size == 0
    assert list(cfg.input[0].dims) == [1, -1, 8]
    assert list(cfg.output[0].dims) == [1] and list(cfg.output[0].reshape.shape) == []


def test_tfserving_and_ovms_configs() -> None:
    from tensorflow_serving.config import model_server_config_pb2

    models = [ServedModel("b", "/models/b"), ServedModel("a", "s3://bucket/a")]
    cfg = text_format.Parse(tfserving_models_config(models), model_server_config_pb2.ModelServerConfig())
    assert [c.name for c in cfg.model_config_list.config] == ["a", "b"]
    assert cfg.model_config_list.config[0].base_path == "s3://bucket/a"
    assert cfg.model_config_list.config[0].model_platform == "tensorflow"
    ovms = json.loads(ovms_config_json(models))
    assert [m["config"]["name"] for m in ovms["model_config_list"]] == ["a", "b"]


def _export_artifact(tmp: Path, target: str = "onnxruntime") -> Artifact:
    root = tmp / f"export-{target}"
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(b"onnx-bytes")
    return Artifact(
        root=root,
        kind="onnx",
        entry="model.onnx",
        meta={
            "target": target,
            "format": "onnx",
            "precision": "fp32",
            "io": {
                "inputs": [{"name": "input", "dtype": "float32", "shape": [None, 3]}],
                "outputs": [{"name": "output", "dtype": "float32", "shape": [None, 2]}],
            },
            "serving": {"triton": {"platform": "onnxruntime_onnx"}, "ovms": True},
        },
    ).save()


def test_publish_layout_versions_and_manifest(tmp_path: Path) -> None:
    repo = LocalModelRepository(tmp_path / "repo")
    art = _export_artifact(tmp_path)
    v1 = publish_version(repo, art, name="m", version=None, manifest={"route": "onnx ⇒ onnxruntime"}, max_batch_size=4)
    v2 = publish_version(repo, art, name="m", version=None, manifest={})
    assert (v1.version, v2.version) == (1, 2)
    root = tmp_path / "repo"
    assert (root / "m" / "1" / "model.onnx").read_bytes() == b"onnx-bytes"
    assert not (root / "m" / "1" / "kiln-artifact.json").exists()
    assert read_manifest(repo, "m", 1)["route"] == "onnx ⇒ onnxruntime"
    assert _triton((root / "m" / "config.pbtxt").read_text()).max_batch_size == 0  # last publish wins
    assert json.loads((root / "config.json").read_text())["model_config_list"][0]["config"]["name"] == "m"
    assert repo.versions("m") == [1, 2]
    assert not any(p.name.startswith(".tmp") for p in (root / "m").iterdir())
    with pytest.raises(RepositoryConflict):
        publish_version(repo, art, name="m", version=2, manifest={})
    other = _export_artifact(tmp_path, target="openvino")
    with pytest.raises(RepositoryConflict, match="holds onnxruntime"):
        publish_version(repo, other, name="m", version=None, manifest={})


def test_concurrent_publishers_get_distinct_versions(tmp_path: Path) -> None:
    repo = LocalModelRepository(tmp_path / "repo")
    art = _export_artifact(tmp_path)
    got: list[int] = []

    def worker() -> None:
        got.append(
            publish_version(LocalModelRepository(tmp_path / "repo"), art, name="m", version=None, manifest={}).version
        )

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert repo.versions("m") == [1, 2, 3, 4, 5, 6]
