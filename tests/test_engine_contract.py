"""The engine contract (tests/engine_contract.py) run against every built-in format and target.

Each class adds only how to write the contract model in its format; the tests are the
contract's. ``test_every_format_and_target_has_a_contract`` fails when a descriptor registers
a runner or a target that no test file gives a contract class, so a new engine runs the same
suite. An engine that cannot run on this machine (TensorRT: NVIDIA's index only) is in the
suite and skips with the reason; on a machine with it, the same tests run.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from engine_contract import BATCH, FEATURES, ExporterContract, RunnerContract, importable, sample_feeds

from services.descriptors import registry

TESTS = Path(__file__).resolve().parent


def _keras_model() -> Any:
    import keras

    x = keras.Input((FEATURES,), name="x")
    y = keras.Input((FEATURES,), name="y")
    z_sum = keras.layers.Add(name="z_sum")([x, y])
    a_prod = keras.layers.Multiply(name="a_prod")([x, y])
    return keras.Model({"x": x, "y": y}, [z_sum, a_prod])


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("keras")
    path = tmp_path_factory.mktemp("contract-keras") / "model.keras"
    _keras_model().save(path)
    return path


@pytest.fixture(scope="module")
def savedmodel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    path = tmp_path_factory.mktemp("contract-savedmodel") / "saved"
    model = _keras_model()
    spec = {n: tf.TensorSpec([None, FEATURES], tf.float32, name=n) for n in ("x", "y")}

    @tf.function(input_signature=[spec])
    def serve(inputs: dict[str, Any]) -> dict[str, Any]:
        z_sum, a_prod = model(inputs)
        return {"z_sum": z_sum, "a_prod": a_prod}

    tf.saved_model.save(model, str(path), signatures={"serving_default": serve})
    return path


class TestOnnxRunner(RunnerContract):
    fmt = "onnx"

    @pytest.fixture
    def model(self, onnx_model: Path) -> Path:
        return onnx_model


class TestOpenVINORunner(RunnerContract):
    fmt = "openvino_ir"

    @pytest.fixture
    def model(self, onnx_model: Path, tmp_path: Path) -> Path:
        ov = pytest.importorskip("openvino")
        path = tmp_path / "model.xml"
        ov.save_model(ov.convert_model(onnx_model), path, compress_to_fp16=False)
        return path


class TestKerasRunner(RunnerContract):
    fmt = "keras"

    @pytest.fixture
    def model(self, keras_file: Path) -> Path:
        return keras_file


class TestSavedModelRunner(RunnerContract):
    fmt = "savedmodel"
    ordered = False  # a signature's outputs are a map; the runner's order is its own, kept consistently

    @pytest.fixture
    def model(self, savedmodel_dir: Path) -> Path:
        return savedmodel_dir


class TestTFLiteRunner(RunnerContract):
    fmt = "tflite"
    ordered = False  # the converter stores a signature map too

    @pytest.fixture
    def model(self, savedmodel_dir: Path, tmp_path: Path) -> Path:
        import tensorflow as tf

        path = tmp_path / "model.tflite"
        path.write_bytes(tf.lite.TFLiteConverter.from_saved_model(str(savedmodel_dir)).convert())
        return path


class _TorchContract:
    @staticmethod
    def module() -> Any:
        import torch

        class Contract(torch.nn.Module):
            def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return x + y, x * y

        return Contract().eval()


class TestTorchScriptRunner(RunnerContract):
    fmt = "torchscript"
    output_names = ("output_0", "output_1")  # TorchScript stores no output names; position is the contract

    @pytest.fixture
    def model(self, tmp_path: Path) -> Path:
        torch = pytest.importorskip("torch")
        path = tmp_path / "model.pt"
        feeds = sample_feeds()
        torch.jit.trace(_TorchContract.module(), (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"]))).save(
            str(path)
        )
        return path


class TestExportedProgramRunner(RunnerContract):
    fmt = "torch_export"
    output_names = ("output_0", "output_1")

    @pytest.fixture
    def model(self, tmp_path: Path) -> Path:
        torch = pytest.importorskip("torch")
        path = tmp_path / "model.pt2"
        feeds = sample_feeds()
        batch = torch.export.Dim("batch", min=2)
        program = torch.export.export(
            _TorchContract.module(),
            (torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])),
            dynamic_shapes={"x": {0: batch}, "y": {0: batch}},
        )
        torch.export.save(program, str(path))
        return path


@pytest.mark.tensorrt
@pytest.mark.skipif(
    not importable("tensorrt"), reason="TensorRT is not installable here: wheels only on NVIDIA's index"
)
class TestTensorRTRunner(RunnerContract):
    fmt = "tensorrt_plan"

    @pytest.fixture
    def model(self, onnx_model: Path, tmp_path: Path) -> Path:
        import onnx

        from services.spec import Precision, load_spec
        from services.tensorrt.builder import BuildOptions, build_plan
        from services.tensorrt.profiles import derive_profile

        path = tmp_path / "model.plan"
        shapes = {"min": [1, FEATURES], "opt": [BATCH, FEATURES], "max": [8, FEATURES]}
        spec = load_spec({"targets": ["tensorrt"], "inputs": {"x": shapes, "y": shapes}})
        profile = derive_profile(onnx.load(onnx_model), spec)
        build_plan(onnx_model, path, BuildOptions(precision=Precision.FP32, profiles=(profile,), workspace_mb=256))
        return path


# --------------------------------------------------------------------------- exporters


class TestOnnxRuntimeExporter(ExporterContract):
    target = "onnxruntime"


class TestOpenVINOExporter(ExporterContract):
    target = "openvino"


class TestTFLiteExporter(ExporterContract):
    target = "tflite"
    ordered = False


class TestTFServingExporter(ExporterContract):
    target = "tfserving"
    ordered = False


@pytest.mark.tensorrt
class TestTensorRTExporter(ExporterContract):
    target = "tensorrt"


# --------------------------------------------------------------------------- coverage


def _contract_classes() -> dict[str, set[str]]:
    """Return the ``fmt`` of every RunnerContract subclass and the ``target`` of every ExporterContract one."""
    found: dict[str, set[str]] = {"RunnerContract": set(), "ExporterContract": set()}
    for path in [*TESTS.glob("test_*.py"), *TESTS.glob("contract_*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                kind = base.id if isinstance(base, ast.Name) else None
                if kind not in found:
                    continue
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and isinstance(stmt.targets[0], ast.Name)
                        and stmt.targets[0].id in ("fmt", "target")
                        and isinstance(stmt.value, ast.Constant)
                    ):
                        found[kind].add(str(stmt.value.value))
    return found


def test_every_format_and_target_has_a_contract() -> None:
    found = _contract_classes()
    assert found["RunnerContract"] == {f.name for f in registry().formats.values() if f.runner}
    assert found["ExporterContract"] == set(registry().targets)
