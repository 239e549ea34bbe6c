"""One contract for every runner and every exporter, run against each registered format and target.

The contract classes hold the tests (as tests/test_storage_contract.py does for storage);
a format adds only a fixtures class that writes the contract model in that format. The
model is the same everywhere: inputs ``x`` and ``y`` (float32, batch x 4), outputs
``z_sum = x + y`` then ``a_prod = x * y``, declared in that order, which is not
alphabetical, so a runner that sorts its outputs is caught. Feeding 1e30 overflows the
product to +inf, and inf + -inf gives NaN: non-finite values must come back as they are.

``test_every_format_and_target_has_a_contract`` fails when a descriptor registers a
runner or a target without a fixtures class here, so a new engine runs the same suite.
An engine that cannot run on this machine (TensorRT: NVIDIA's index only) is in the suite
and skips with the reason; on a machine with it, the same tests run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from services.descriptors import registry
from services.formats import Format
from services.runners import ModelRunner, TensorSpec, open_runner

BATCH = 3
FEATURES = 4
OUTPUTS = ("z_sum", "a_prod")


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
        "y": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
    }


def _nonfinite_feeds() -> dict[str, np.ndarray]:
    x = np.ones((BATCH, FEATURES), np.float32)
    y = np.ones((BATCH, FEATURES), np.float32)
    x[0, 0] = y[0, 0] = 1e30  # product overflows: +inf
    x[1, 1], y[1, 1] = np.inf, -np.inf  # sum: NaN; product: -inf
    return {"x": x, "y": y}


def _expected(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x, y = feeds["x"], feeds["y"]
    with np.errstate(over="ignore", invalid="ignore"):
        return {"z_sum": x + y, "a_prod": x * y}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- the contract model


def contract_onnx(path: Path) -> Path:
    """Write the contract model as ONNX (opset 17, dynamic batch)."""
    import onnx
    from onnx import TensorProto, helper

    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", FEATURES])

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z_sum"]), helper.make_node("Mul", ["x", "y"], ["a_prod"])],
        "contract",
        [vi("x"), vi("y")],
        [vi("z_sum"), vi("a_prod")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _keras_model() -> Any:
    import keras

    x = keras.Input((FEATURES,), name="x")
    y = keras.Input((FEATURES,), name="y")
    z_sum = keras.layers.Add(name="z_sum")([x, y])
    a_prod = keras.layers.Multiply(name="a_prod")([x, y])
    return keras.Model({"x": x, "y": y}, [z_sum, a_prod])


# --------------------------------------------------------------------------- runners


class RunnerContract:
    """What every ModelRunner promises; a subclass gives ``fmt`` and the ``model`` fixture."""

    fmt: ClassVar[str]
    #: Output names as the format stores them, in the model's order (formats that rename say so).
    output_names: ClassVar[tuple[str, ...]] = OUTPUTS
    #: Formats whose stored order is not the model's (a signature map) set this False.
    ordered: ClassVar[bool] = True

    @pytest.fixture
    def runner(self, model: Path) -> Any:
        r = open_runner(Format(self.fmt), model)
        yield r
        r.close()

    def _by_model_name(self, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(OUTPUTS, (out[n] for n in self.output_names), strict=True))

    def test_tensor_specs(self, runner: ModelRunner) -> None:
        assert all(isinstance(t, TensorSpec) for t in [*runner.inputs, *runner.outputs])
        assert sorted(t.name for t in runner.inputs) == ["x", "y"]
        assert sorted(t.name for t in runner.outputs) == sorted(self.output_names)
        for t in [*runner.inputs, *runner.outputs]:
            assert t.dtype == "float32", t
            assert len(t.shape) == 2 and t.shape[1] == FEATURES and t.shape[0] in (None, BATCH), t
        io = runner.io_contract()
        assert [d["name"] for d in io["inputs"]] == [t.name for t in runner.inputs]
        assert [d["name"] for d in io["outputs"]] == [t.name for t in runner.outputs]

    def test_outputs_in_declared_order_with_the_right_values(self, runner: ModelRunner) -> None:
        feeds = _feeds()
        out = runner.run(feeds)
        assert list(out) == [t.name for t in runner.outputs]  # run() keeps self.outputs' order
        if self.ordered:
            assert [t.name for t in runner.outputs] == list(self.output_names)
        got = self._by_model_name(out)
        for name, want in _expected(feeds).items():
            assert got[name].shape == (BATCH, FEATURES) and got[name].dtype == np.float32
            np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)

    def test_nonfinite_outputs_come_back_as_they_are(self, runner: ModelRunner) -> None:
        feeds = _nonfinite_feeds()
        got = self._by_model_name(runner.run(feeds))
        want = _expected(feeds)
        assert got["a_prod"][0, 0] == np.inf and got["a_prod"][1, 1] == -np.inf
        assert np.isnan(got["z_sum"][1, 1])
        for name in OUTPUTS:
            np.testing.assert_array_equal(np.isfinite(got[name]), np.isfinite(want[name]))

    def test_runs_again_after_a_run_and_closes_twice(self, model: Path) -> None:
        r = open_runner(Format(self.fmt), model)
        first = r.run(_feeds())
        second = r.run(_feeds())
        for name in first:
            np.testing.assert_array_equal(first[name], second[name])
        r.close()
        r.close()  # idempotent: exporters close in finally blocks that may run twice


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return contract_onnx(tmp_path_factory.mktemp("contract") / "model.onnx")


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
        feeds = _feeds()
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
        feeds = _feeds()
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
    not _importable("tensorrt"), reason="TensorRT is not installable here: wheels only on NVIDIA's index"
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


@pytest.fixture(scope="module")
def compiled(onnx_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Compile the contract model for every target this machine can build, in one job."""
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    targets = [t for t in registry().targets if t not in ExporterContract.cannot_run_here()]
    root = tmp_path_factory.mktemp("contract-compile")
    spec = load_spec({"targets": targets, "name": "contract", "benchmark": False})
    return compile_model(
        onnx_model, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
    )


class ExporterContract:
    """What every target's exporter promises for the contract model; a subclass names the target."""

    target: ClassVar[str]
    #: The artifact lists outputs in the source's order (TF signatures are maps: clients address them by name).
    ordered: ClassVar[bool] = True

    @staticmethod
    def cannot_run_here() -> dict[str, str]:
        """Return the targets whose engine this machine lacks, with the reason."""
        out = {}
        for name, t in registry().targets.items():
            missing = [m for m in registry().engines[t.engine].modules if not _importable(m)]
            if missing:
                out[name] = f"{', '.join(missing)} not installed here"
        return out

    @pytest.fixture
    def artifact(self, compiled: Any) -> Any:
        reason = self.cannot_run_here().get(self.target)
        if reason:
            pytest.skip(reason)
        result = compiled.targets[self.target]
        assert result.status == "succeeded", result.error
        plan = compiled.plan
        export_id = plan.route_options(self.target)[0].export
        return compiled.steps[export_id].artifact

    def test_io_keeps_the_source_names_and_order(self, artifact: Any) -> None:
        io = artifact.meta["io"]  # read from the artifact itself
        inputs, outputs = [t["name"] for t in io["inputs"]], [t["name"] for t in io["outputs"]]
        if self.ordered:
            assert (inputs, outputs) == (["x", "y"], list(OUTPUTS))
        else:  # names kept, order the signature's own (TF Serving lists inputs y, x)
            assert (sorted(inputs), sorted(outputs)) == (["x", "y"], sorted(OUTPUTS))
        assert all(t["dtype"] == "float32" for t in [*io["inputs"], *io["outputs"]])
        parity = artifact.meta["parity"]
        assert parity["passed"] is True and [o["name"] for o in parity["outputs"]] == list(OUTPUTS)

    def test_artifact_runs_on_its_format_runner(self, artifact: Any) -> None:
        fmt = Format(registry().targets[self.target].artifact_format)
        assert artifact.kind == fmt.value
        runner = open_runner(fmt, Path(artifact.root) / (artifact.entry or ""))
        try:
            feeds = _feeds()
            out = runner.run(feeds)
            assert list(out) == [t.name for t in runner.outputs]
            for name, want in _expected(feeds).items():
                np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5)
            feeds = _nonfinite_feeds()
            out = runner.run(feeds)
            for name, want in _expected(feeds).items():
                np.testing.assert_array_equal(np.isfinite(out[name]), np.isfinite(want))
            assert np.isnan(out["z_sum"][1, 1]) and out["a_prod"][0, 0] == np.inf
        finally:
            runner.close()
            runner.close()


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


class TestTensorRTExporter(ExporterContract):
    target = "tensorrt"


# --------------------------------------------------------------------------- coverage


def test_every_format_and_target_has_a_contract() -> None:
    formats = {c.fmt for c in RunnerContract.__subclasses__()}
    targets = {c.target for c in ExporterContract.__subclasses__()}
    assert formats == {f.name for f in registry().formats.values() if f.runner}
    assert targets == set(registry().targets)
