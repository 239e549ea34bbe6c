"""Model repository layouts (parsed with the serving engines' own protos) and atomic publishing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from google.protobuf import text_format
from ovms_schema import check_ovms_config

from services.artifacts import Artifact
from services.errors import RepositoryConflict
from services.repository import LocalModelRepository, publish_version, read_manifest
from services.repository.layouts import OVMS_F32, ServedModel, ovms_config_json, tfserving_models_config
from services.repository.publish import triton_max_batch_size
from services.repository.triton_config import TritonModel, preferred_batch_sizes, triton_config_pbtxt
from services.runners import TensorSpec


def _triton(text: str):
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_triton_config_parses_with_triton_proto() -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    text = triton_config_pbtxt(
        TritonModel(
            "cnn",
            inputs=[TensorSpec("input", "float32", (None, 3, 32, 32)), TensorSpec("ids", "int64", (None, 7))],
            outputs=[TensorSpec("output", "float16", (None, 10))],
            platform="onnxruntime_onnx",
            max_batch_size=8,
            preferred_batch_sizes=[4, 8],
            instance_kind="KIND_GPU",
        )
    )
    cfg = _triton(text)
    assert cfg.name == "cnn" and cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 8
    assert list(cfg.input[0].dims) == [3, 32, 32]  # batch axis owned by Triton
    assert list(cfg.input[1].dims) == [7] and list(cfg.output[0].dims) == [10]
    assert cfg.input[1].data_type == mc.TYPE_INT64
    assert cfg.output[0].data_type == mc.TYPE_FP16
    assert cfg.HasField("dynamic_batching") and list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, mc.ModelInstanceGroup.KIND_GPU)]


def test_triton_config_without_batching_keeps_all_dims_and_dynamic() -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = _triton(
        triton_config_pbtxt(
            TritonModel(
                "ov",
                inputs=[TensorSpec("x", "float32", (1, None, 8))],
                outputs=[TensorSpec("y", "float32", ())],
                backend="openvino",
                parameters={"NUM_STREAMS": "1"},
            )
        )
    )
    assert cfg.backend == "openvino" and cfg.max_batch_size == 0
    assert not cfg.HasField("dynamic_batching")
    assert list(cfg.input[0].dims) == [1, -1, 8]
    assert list(cfg.output[0].dims) == [1] and cfg.output[0].HasField("reshape")
    assert list(cfg.output[0].reshape.shape) == []
    assert cfg.parameters["NUM_STREAMS"].string_value == "1"
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


@pytest.mark.parametrize(
    ("shapes", "triton", "requested", "limit", "expected"),
    [
        ([(None, 3), (None, 2)], {}, None, None, 8),  # open batch axis, nothing asked: the default
        ([(None, 3), (None, 2)], {}, None, 4, 4),  # the spec's input profiles allow at most 4
        ([(None, 3), (None, 2)], {}, 32, None, 32),  # asked for
        ([(None, 3), (None, 2)], {}, 0, None, 0),  # batching turned off
        ([(None, 3), (None, 2)], {"max_batch_size": 16}, None, None, 16),  # a TensorRT profile's bound
        ([(None, 3), (None, 2)], {"max_batch_size": 16}, 64, None, 16),  # never above the engine's
        ([(1, 3), (1, 2)], {}, 8, None, 0),  # fixed batch axis: Triton cannot own it
        ([(None, 3), (1, 2)], {}, None, None, 0),  # an output with a fixed first axis
        ([(None, 3), (None, 2)], {"batching": False}, 8, None, 0),  # the exporter says no
    ],
)
def test_triton_max_batch_size(shapes, triton, requested, limit, expected) -> None:
    inputs = [TensorSpec("x", "float32", shapes[0])]
    outputs = [TensorSpec("y", "float32", shapes[1])]
    assert triton_max_batch_size(triton, inputs, outputs, requested, limit) == expected


def test_preferred_batch_sizes_keep_those_near_the_best_throughput() -> None:
    bench = [
        {"batch_size": 1, "throughput": 100.0},
        {"batch_size": 2, "throughput": 200.0},
        {"batch_size": 4, "throughput": 380.0},
        {"batch_size": 8, "throughput": 400.0},
        {"batch_size": 16, "throughput": 450.0},
    ]
    assert preferred_batch_sizes(bench, 8) == [4, 8]  # 16 is above the limit; 2 is 50% under 8's; 1 is no batch
    assert preferred_batch_sizes(bench, 16) == [16]  # 400 < 0.9 * 450
    assert preferred_batch_sizes(bench[:1], 8) == []


def test_tfserving_and_ovms_configs() -> None:
    from tensorflow_serving.config import model_server_config_pb2

    models = [
        ServedModel("b", "/models/b", plugin_config={"INFERENCE_PRECISION_HINT": "f32"}),
        ServedModel("a", "s3://bucket/a"),
    ]
    cfg = text_format.Parse(tfserving_models_config(models), model_server_config_pb2.ModelServerConfig())
    assert [c.name for c in cfg.model_config_list.config] == ["a", "b"]
    assert cfg.model_config_list.config[0].base_path == "s3://bucket/a"
    assert cfg.model_config_list.config[0].model_platform == "tensorflow"
    ovms = json.loads(ovms_config_json(models))
    check_ovms_config(ovms)
    assert [m["config"]["name"] for m in ovms["model_config_list"]] == ["a", "b"]
    assert "plugin_config" not in ovms["model_config_list"][0]["config"]
    assert ovms["model_config_list"][1]["config"]["plugin_config"] == {"INFERENCE_PRECISION_HINT": "f32"}


def _export_artifact(tmp: Path, target: str = "onnxruntime", serving: dict | None = None, shape=(None, 3)) -> Artifact:
    root = tmp / f"export-{target}"
    root.mkdir(parents=True, exist_ok=True)
    entry = {"tfserving": "saved_model.pb", "tflite": "model.tflite"}.get(target, "model.onnx")
    (root / entry).write_bytes(b"model-bytes")
    return Artifact(
        root=root,
        kind="onnx",
        entry=entry,
        meta={
            "target": target,
            "format": "onnx",
            "precision": "fp32",
            "io": {
                "inputs": [{"name": "input", "dtype": "float32", "shape": list(shape)}],
                "outputs": [{"name": "output", "dtype": "float32", "shape": [shape[0], 2]}],
            },
            "benchmark": [
                {"batch_size": 1, "throughput": 100.0},
                {"batch_size": 4, "throughput": 390.0},
                {"batch_size": 8, "throughput": 400.0},
            ],
            "serving": serving or {"triton": {"platform": "onnxruntime_onnx"}, "ovms": OVMS_F32},
        },
    ).save()


def test_publish_layout_versions_and_manifest(tmp_path: Path) -> None:
    repo = LocalModelRepository(tmp_path / "repo")
    art = _export_artifact(tmp_path)
    v1 = publish_version(repo, art, name="m", version=None, manifest={"route": "onnx ⇒ onnxruntime"}, max_batch_size=4)
    root = tmp_path / "repo"
    cfg = _triton((root / "triton" / "m" / "config.pbtxt").read_text())
    assert cfg.max_batch_size == 4 and list(cfg.input[0].dims) == [3]
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4]  # 8 is above max_batch_size
    v2 = publish_version(repo, art, name="m", version=None, manifest={})
    assert (v1.version, v2.version) == (1, 2)
    assert v2.uri == str(root / "triton" / "m" / "2")
    assert (root / "triton" / "m" / "1" / "model.onnx").read_bytes() == b"model-bytes"
    assert not (root / "triton" / "m" / "1" / "kiln-artifact.json").exists()
    assert read_manifest(repo, "m", 1)["route"] == "onnx ⇒ onnxruntime"
    cfg = _triton((root / "triton" / "m" / "config.pbtxt").read_text())  # last publish wins
    assert cfg.max_batch_size == 8 and list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    ovms = json.loads((root / "ovms" / "config.json").read_text())
    check_ovms_config(ovms)
    assert ovms["model_config_list"][0]["config"]["name"] == "m"
    assert ovms["model_config_list"][0]["config"]["base_path"] == str(root / "triton" / "m")
    assert ovms["model_config_list"][0]["config"]["plugin_config"] == {"INFERENCE_PRECISION_HINT": "f32"}
    assert repo.versions("triton/m") == [1, 2]
    assert not any(p.name.startswith(".tmp") for p in (root / "triton" / "m").iterdir())
    with pytest.raises(RepositoryConflict):
        publish_version(repo, art, name="m", version=2, manifest={})
    other = _export_artifact(tmp_path, target="openvino")
    with pytest.raises(RepositoryConflict, match="holds onnxruntime"):
        publish_version(repo, other, name="m", version=None, manifest={})
    tfs = _export_artifact(tmp_path, target="tfserving", serving={"tfserving": True, "ovms": OVMS_F32})
    with pytest.raises(RepositoryConflict, match="holds onnxruntime"):  # names are unique across roots
        publish_version(repo, tfs, name="m", version=None, manifest={})


def test_each_server_gets_its_own_root(tmp_path: Path) -> None:
    """Triton's root holds only models with a config.pbtxt; SavedModels and TFLite files live elsewhere."""
    from tensorflow_serving.config import model_server_config_pb2

    repo = LocalModelRepository(tmp_path / "repo")
    publish_version(repo, _export_artifact(tmp_path), name="ort", version=None, manifest={})
    publish_version(
        repo,
        _export_artifact(
            tmp_path, "openvino", {"triton": {"backend": "openvino", "batching": False}, "ovms": OVMS_F32}
        ),
        name="ov",
        version=None,
        manifest={},
    )
    tfs = _export_artifact(tmp_path, "tfserving", {"tfserving": True, "ovms": OVMS_F32})
    publish_version(repo, tfs, name="sm", version=None, manifest={})
    publish_version(
        repo, _export_artifact(tmp_path, "tflite", {"ovms": OVMS_F32}), name="lite", version=None, manifest={}
    )
    root = tmp_path / "repo"
    assert sorted(p.name for p in (root / "triton").iterdir()) == ["ort", "ov"]
    for model in (root / "triton").iterdir():
        cfg = _triton((model / "config.pbtxt").read_text())  # every model in Triton's root has a config
        assert cfg.name == model.name
    assert _triton((root / "triton" / "ov" / "config.pbtxt").read_text()).max_batch_size == 0  # see openvino.SERVING
    assert list(_triton((root / "triton" / "ov" / "config.pbtxt").read_text()).input[0].dims) == [-1, 3]
    assert (root / "tfserving" / "sm" / "1" / "saved_model.pb").is_file()
    assert (root / "tflite" / "lite" / "1" / "model.tflite").is_file()
    tf_cfg = text_format.Parse(
        (root / "tfserving" / "models.config").read_text(), model_server_config_pb2.ModelServerConfig()
    )
    assert [(c.name, c.base_path) for c in tf_cfg.model_config_list.config] == [("sm", str(root / "tfserving" / "sm"))]
    ovms = json.loads((root / "ovms" / "config.json").read_text())
    check_ovms_config(ovms)
    assert {m["config"]["name"]: m["config"]["base_path"] for m in ovms["model_config_list"]} == {
        "lite": str(root / "tflite" / "lite"),
        "ort": str(root / "triton" / "ort"),
        "ov": str(root / "triton" / "ov"),
        "sm": str(root / "tfserving" / "sm"),
    }
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "ovms",
        "tflite",
        "tfserving",
        "triton",
    ]
    assert read_manifest(repo, "lite", 1)["name"] == "lite"


def test_serving_root_makes_configs_relative_to_the_mount(tmp_path: Path) -> None:
    """A repository mounted at /models: base paths name /models/<root>/<name>, and the root is remembered."""
    repo = LocalModelRepository(tmp_path / "repo", serving_root="/srv/ignored")
    tfs = _export_artifact(tmp_path, "tfserving", {"tfserving": True, "ovms": OVMS_F32})
    publish_version(repo, tfs, name="sm", version=None, manifest={}, serving_root="/models/")
    publish_version(repo, _export_artifact(tmp_path), name="ort", version=None, manifest={})  # no root asked
    root = tmp_path / "repo"
    assert "/models/tfserving/sm" in (root / "tfserving" / "models.config").read_text()
    ovms = json.loads((root / "ovms" / "config.json").read_text())
    assert sorted(m["config"]["base_path"] for m in ovms["model_config_list"]) == [
        "/models/tfserving/sm",
        "/models/triton/ort",
    ]
    assert json.loads((root / "kiln-repository.json").read_text()) == {"serving_root": "/models"}
    fresh = LocalModelRepository(tmp_path / "other", serving_root="/mnt/repo")  # the setting, nothing recorded
    publish_version(fresh, tfs, name="sm", version=None, manifest={})
    assert '"/mnt/repo/tfserving/sm"' in (tmp_path / "other" / "tfserving" / "models.config").read_text()


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
    assert repo.versions("triton/m") == [1, 2, 3, 4, 5, 6]


def test_onnxruntime_on_gpu_when_the_spec_asks(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    from services.pipeline import compile_model
    from services.spec import load_spec

    for name, device, kind in (
        ("cpu", "cpu", mc.ModelInstanceGroup.KIND_CPU),
        ("gpu", "gpu", mc.ModelInstanceGroup.KIND_GPU),
    ):
        spec = load_spec(
            {"targets": ["onnxruntime"], "name": name, "benchmark": False, "serving": {"onnxruntime_device": device}}
        )
        assert compile_model(cnn_onnx, spec, store=store, repository=repository).ok
        cfg = _triton((repo_dir / "triton" / name / "config.pbtxt").read_text())
        assert [g.kind for g in cfg.instance_group] == [kind]
        # No benchmark, open batch axis: the default limit, and no preferred sizes to offer.
        assert cfg.max_batch_size == 8 and list(cfg.dynamic_batching.preferred_batch_size) == []


@pytest.mark.parametrize("root", ["models", "./models", ""])
def test_a_relative_serving_root_is_refused(root: str) -> None:
    from services.errors import InvalidSpec
    from services.spec import load_spec

    with pytest.raises(InvalidSpec, match=r"serving\.root"):
        load_spec({"targets": ["onnxruntime"], "serving": {"root": root}})
    assert load_spec({"targets": ["onnxruntime"], "serving": {"root": "s3://b/p"}}).serving.root == "s3://b/p"


def test_tuned_serving_settings_reach_each_backend_under_its_own_keys(tmp_path: Path) -> None:
    """serving.triton: instances, preferred batch and engine parameters, each backend with the keys it reads."""
    from tritonclient.grpc import model_config_pb2 as mc

    from services.spec import TritonServingSpec

    repo = LocalModelRepository(tmp_path / "repo")
    tuned = TritonServingSpec(
        instance_count=4,
        preferred_batch_sizes=[16],
        threads=1,
        onnxruntime_optimization="basic",
        openvino_streams=2,
        openvino_hint="THROUGHPUT",
    )
    publish_version(repo, _export_artifact(tmp_path), name="ort", version=None, manifest={}, triton_serving=tuned)
    cfg = _triton((tmp_path / "repo" / "triton" / "ort" / "config.pbtxt").read_text())
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(4, mc.ModelInstanceGroup.KIND_CPU)]
    # 16 was measured: it raises the default bound of 8 and is the one preferred size (not the benchmark's 4, 8).
    assert cfg.max_batch_size == 16 and list(cfg.dynamic_batching.preferred_batch_size) == [16]
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {"intra_op_thread_count": "1"}
    assert cfg.optimization.graph.level == -1  # the onnxruntime backend's ORT_ENABLE_BASIC

    ov_art = _export_artifact(
        tmp_path, target="openvino", serving={"triton": {"backend": "openvino", "batching": False}}
    )
    publish_version(repo, ov_art, name="ov", version=None, manifest={}, triton_serving=tuned)
    cfg = _triton((tmp_path / "repo" / "triton" / "ov" / "config.pbtxt").read_text())
    assert cfg.backend == "openvino" and cfg.instance_group[0].count == 4
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "INFERENCE_NUM_THREADS": "1",
        "NUM_STREAMS": "2",
        "PERFORMANCE_HINT": "THROUGHPUT",
    }
    # Batching stays off for OpenVINO (its backend fixes the batch at max_batch_size): no preferred sizes.
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert not cfg.HasField("optimization")


def test_tuned_batch_above_the_specs_max_batch_size_is_dropped(tmp_path: Path) -> None:
    from services.spec import TritonServingSpec

    repo = LocalModelRepository(tmp_path / "repo")
    tuned = TritonServingSpec(preferred_batch_sizes=[4, 16])
    publish_version(
        repo, _export_artifact(tmp_path), name="m", version=None, manifest={}, max_batch_size=8, triton_serving=tuned
    )
    cfg = _triton((tmp_path / "repo" / "triton" / "m" / "config.pbtxt").read_text())
    assert cfg.max_batch_size == 8 and list(cfg.dynamic_batching.preferred_batch_size) == [4]
    assert cfg.instance_group[0].count == 1 and not cfg.parameters and not cfg.HasField("optimization")
