"""The openvino target end to end, its converters (ONNX, SavedModel, TFLite) and its runner."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from jobs_support import KILN_CMD
from ovms_schema import check_ovms_config

from services.errors import KilnError
from services.formats import Format
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec
from services.validation.inputs import EXTRA_SHAPE_SAMPLES


def _spec(precision: str, **extra):
    return load_spec(
        {
            "targets": ["openvino"],
            "precision": precision,
            "name": "m",
            "benchmark": {"iterations": 5, "warmup": 1},
            **extra,
        }
    )


def _ir_layers(xml: Path) -> tuple[Counter[str], Counter[str]]:
    """Return (layer types, Const element types) counted in an IR's XML."""
    root = ET.parse(xml).getroot()
    types: Counter[str] = Counter()
    consts: Counter[str] = Counter()
    for layer in root.iter("layer"):
        types[layer.get("type", "")] += 1
        if layer.get("type") == "Const":
            data = layer.find("data")
            consts[data.get("element_type", "") if data is not None else ""] += 1
    return types, consts


def _save_ir(onnx_path: Path, xml: Path) -> Path:
    import openvino as ov

    ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=False)
    return xml


# --- the "done when": CNN and transformer at fp32, fp16, int8 -------------------------


@pytest.mark.parametrize("model_fixture", ["cnn_onnx", "transformer_onnx"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_openvino_precisions(model_fixture: str, precision: str, request, store, repository, repo_dir: Path) -> None:
    model = request.getfixturevalue(model_fixture)
    result = compile_model(model, _spec(precision, optimize=False), store=store, repository=repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["openvino"] == "onnx → openvino_ir ⇒ openvino"

    parity = target.parity
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    # 8 samples at the first shape, EXTRA_SHAPE_SAMPLES at the second (the open batch axis doubled).
    assert parity["passed"] is True and parity["samples_per_shape"] == [8, EXTRA_SHAPE_SAMPLES]
    for out in parity["outputs"]:
        assert out["cosine"] >= tol.min_cosine
        if tol.atol is not None:
            assert out["max_abs"] <= tol.atol + tol.rtol * 10  # outputs are O(1)
        if out["top1"] is not None:
            assert out["top1"] >= tol.min_top1
    worst = max(o["max_abs"] for o in parity["outputs"])
    if precision == "fp32":
        assert worst < 1e-5  # f32 inference: float rounding only, no bf16
    else:
        assert worst > 1e-6  # fp16 weights / int8 really change the numbers

    version_dir = repo_dir / "triton" / "m" / "1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["kiln-manifest.json", "model.bin", "model.xml"]
    types, consts = _ir_layers(version_dir / "model.xml")
    if precision == "fp32":
        assert types["FakeQuantize"] == 0 and consts["f16"] == 0 and consts["f32"] > 0
    elif precision == "fp16":
        assert types["FakeQuantize"] == 0 and consts["f16"] > 0 and types["Convert"] > 0
        assert (version_dir / "model.bin").stat().st_size < 0.6 * _fp32_bin_size(model, repo_dir.parent)
    else:
        assert types["FakeQuantize"] >= 3  # activations of every Conv / MatMul quantised
        assert consts["i8"] >= 3  # and their weights stored as int8

    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse((repo_dir / "triton" / "m" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.backend == "openvino" and cfg.platform == ""
    assert cfg.input[0].name == "input" and cfg.output[0].name == "output"
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32
    ovms = json.loads((repo_dir / "ovms" / "config.json").read_text())
    assert [c["config"]["name"] for c in ovms["model_config_list"]] == ["m"]
    check_ovms_config(ovms)
    assert ovms["model_config_list"][0]["config"]["base_path"] == str(repo_dir.resolve() / "triton" / "m")
    # OVMS would otherwise run bf16 on CPUs that have it; Kiln checked parity at f32.
    assert ovms["model_config_list"][0]["config"]["plugin_config"] == {"INFERENCE_PRECISION_HINT": "f32"}
    assert cfg.max_batch_size == 0  # see openvino.SERVING: the backend would pin the batch

    manifest = json.loads((version_dir / "kiln-manifest.json").read_text())
    assert manifest["precision"] == precision and manifest["target"] == "openvino"
    assert manifest["format"] == "openvino_ir"
    assert manifest["route"] == "onnx → openvino_ir ⇒ openvino"
    assert sorted(s["step"] for s in manifest["steps"]) == ["export:openvino", "onnx-to-openvino-ir", "reference"]
    assert manifest["parity"]["passed"] is True
    assert manifest["benchmark"][0]["p50_ms"] > 0 and manifest["benchmark"][0]["iterations"] == 5
    import openvino as ov

    assert manifest["tool_versions"]["openvino"] == metadata.version("openvino")
    assert manifest["tool_versions"]["nncf"] == metadata.version("nncf")
    details = manifest["engine_details"]
    assert details["openvino"] == ov.__version__
    assert details["parity_inference_precision"] == "f32"
    if precision == "int8":
        int8 = details["int8"]
        assert "generated samples" in int8["calibration_data"]
        assert int8["fake_quantize_ops"] == types["FakeQuantize"]
        # attention is detected in the transformer only, and picks NNCF's transformer scheme
        is_transformer = model_fixture == "transformer_onnx"
        assert int8["attention_detected"] is is_transformer
        assert int8["model_type"] == ("transformer" if is_transformer else "default")
        assert int8["preset"] == ("mixed" if is_transformer else "performance")


_FP32_SIZES: dict[str, int] = {}


def _fp32_bin_size(model: Path, scratch: Path) -> int:
    if model.name not in _FP32_SIZES:
        xml = _save_ir(model, scratch / f"fp32-{model.stem}.xml")
        _FP32_SIZES[model.name] = xml.with_suffix(".bin").stat().st_size
    return _FP32_SIZES[model.name]


def test_int8_with_calibration_file(cnn_onnx: Path, tmp_path: Path, store, repository, repo_dir: Path) -> None:
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).standard_normal((12, 3, 32, 32)).astype(np.float32))
    result = compile_model(
        cnn_onnx, _spec("int8", optimize=False, calibration=str(calib)), store=store, repository=repository
    )
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert target.parity["inputs_from"] == "calibration" and target.parity["samples_per_shape"][0] == 8
    # Rows 3, 7, 11 are held out for parity; 5 more are made from the rows to reach min_unseen_samples (8).
    evidence = target.parity["evidence"]
    assert (evidence["real"], evidence["synthesized"], evidence["unseen"]) == (3, 5, 8), evidence
    manifest = json.loads((repo_dir / "triton" / "m" / "1" / "kiln-manifest.json").read_text())
    assert manifest["engine_details"]["int8"]["calibration_data"] == "calibration file"
    assert manifest["engine_details"]["int8"]["subset_size"] == 9  # the other 9 rows calibrate


def test_parity_failure_is_reported_with_numbers(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    # fp16 weights cannot be bit-exact: an impossible bound must fail the target, with numbers.
    spec = _spec("fp16", optimize=False, tolerances={"atol": 0.0, "rtol": 0.0}, benchmark=False)
    target = compile_model(cnn_onnx, spec, store=store, repository=repository).targets["openvino"]
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED"
    assert target.parity["outputs"][0]["max_abs"] > 0
    assert not (repo_dir / "triton" / "m").exists()


def test_default_route_with_optimizer_and_json_cli(transformer_onnx: Path, tmp_path: Path) -> None:
    """`kiln compile --json` at int8 through the default route (ONNX passes on): stdout stays JSON."""
    repo = tmp_path / "repo"
    proc = subprocess.run(
        [
            *KILN_CMD,
            "compile",
            str(transformer_onnx),
            "-t",
            "openvino",
            "-p",
            "int8",
            "--repo",
            str(repo),
            "--name",
            "enc",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout)  # NNCF's progress bars and logs must not reach stdout
    assert "Traceback" not in proc.stderr
    text = json.dumps(body, ensure_ascii=False)
    assert "onnx → optimize → openvino_ir ⇒ openvino" in text
    manifest = json.loads((repo / "triton" / "enc" / "1" / "kiln-manifest.json").read_text())
    assert sorted(s["step"] for s in manifest["steps"]) == [
        "export:openvino",
        "optimize",
        "optimize/onnx-to-openvino-ir",
        "reference",
    ]
    assert manifest["passes"], "the optimizer's record reaches the manifest"
    assert manifest["parity"]["passed"] and manifest["parity"]["outputs"][0]["cosine"] >= 0.98
    # The optimiser fuses attention, which OpenVINO imports as one SDPA op; detection sees it.
    assert manifest["engine_details"]["int8"]["attention_detected"] is True
    assert manifest["engine_details"]["int8"]["model_type"] == "transformer"
    types, _ = _ir_layers(repo / "triton" / "enc" / "1" / "model.xml")
    assert types["FakeQuantize"] == manifest["engine_details"]["int8"]["fake_quantize_ops"] > 0


# --- the runner ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cnn_ir(cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_ir(cnn_onnx, tmp_path_factory.mktemp("ir") / "model.xml")


def test_runner_f32_by_default_and_engine_default_on_request(cnn_ir: Path, cnn_onnx: Path) -> None:
    from services.runners.onnx import OnnxRuntimeRunner
    from services.runners.openvino import OpenVINORunner

    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    want = OnnxRuntimeRunner(cnn_onnx).run({"input": x})["output"]
    f32 = OpenVINORunner(cnn_ir)
    assert f32.inference_precision == "f32"
    assert f32.inputs[0].shape == (None, 3, 32, 32) and f32.inputs[0].dtype == "float32"
    assert [o.name for o in f32.outputs] == ["output"]
    err_f32 = float(np.abs(f32.run({"input": x})["output"] - want).max())
    assert err_f32 < 1e-5
    engine = OpenVINORunner(cnn_ir, inference_precision="default")
    err_default = float(np.abs(engine.run({"input": x})["output"] - want).max())
    if engine.inference_precision == "bf16":  # this CPU's default: the reason f32 is forced for parity
        assert err_default > 100 * err_f32
    else:
        assert engine.inference_precision == "f32"


def test_runner_static_reshape_and_bad_feeds(cnn_ir: Path) -> None:
    from services.runners.openvino import OpenVINORunner

    r = OpenVINORunner(cnn_ir, shapes={"input": [2, 3, 32, 32]})
    assert r.inputs[0].shape == (2, 3, 32, 32) and r.outputs[0].shape == (2, 10)
    assert r.run({"input": np.zeros((2, 3, 32, 32), np.float32)})["output"].shape == (2, 10)
    with pytest.raises(KilnError) as bad:
        r.run({"image": np.zeros((2, 3, 32, 32), np.float32)})
    assert bad.value.code == "INVALID_SPEC" and "input" in bad.value.hint
    with pytest.raises(KilnError) as unknown:
        OpenVINORunner(cnn_ir, shapes={"nope": [1, 3, 32, 32]})
    assert unknown.value.code == "INVALID_SPEC"
    with pytest.raises(KilnError) as wrong:
        OpenVINORunner(cnn_ir, shapes={"input": [1, 5, 32, 32]})  # Conv wants 3 channels
    assert wrong.value.code == "INVALID_SPEC"
    with pytest.raises(KilnError) as hint:
        OpenVINORunner(cnn_ir, inference_precision="int4")
    assert hint.value.code == "INVALID_SPEC"


def test_runner_unnamed_ports_and_integer_types(tmp_path: Path) -> None:
    import openvino as ov
    import openvino.opset13 as ops

    from services.runners.openvino import OpenVINORunner

    a = ops.parameter([2, 3], ov.Type.i64)
    b = ops.parameter([-1], ov.Type.boolean)
    a.set_friendly_name("ids")  # no tensor name: the friendly name stands in
    total = ops.reduce_sum(a, ops.constant(np.array([1], np.int64)), keep_dims=False)
    model = ov.Model([total.output(0), ops.logical_not(b).output(0)], [a, b])
    xml = tmp_path / "m.xml"
    ov.save_model(model, str(xml))
    r = OpenVINORunner(xml)
    assert next((t.name, t.dtype, t.shape) for t in r.inputs) == ("ids", "int64", (2, 3))
    assert r.inputs[1].dtype == "bool" and r.inputs[1].shape == (None,)
    assert [t.dtype for t in r.outputs] == ["int64", "bool"]
    assert len({t.name for t in r.outputs}) == 2  # unnamed results still get distinct names
    out = r.run({r.inputs[0].name: np.arange(6).reshape(2, 3), r.inputs[1].name: np.array([True, False])})
    first, second = (out[t.name] for t in r.outputs)
    assert first.tolist() == [3, 12] and second.tolist() == [False, True]


def test_unreadable_ir_is_source_unreadable(tmp_path: Path) -> None:
    from services.runners.openvino import OpenVINORunner

    xml = tmp_path / "model.xml"
    xml.write_text('<?xml version="1.0"?><net name="x" version="11"><layers><layer id="0" type="Nope"/></layers></net>')
    with pytest.raises(KilnError) as err:
        OpenVINORunner(xml)
    assert err.value.code == "SOURCE_UNREADABLE"


def test_openvino_ir_source_is_checked_and_renamed(
    cnn_ir: Path, tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    """A submitted IR (any file names) goes straight to the exporter and lands as model.xml/.bin."""
    import shutil

    shutil.copy(cnn_ir, tmp_path / "net.xml")
    shutil.copy(cnn_ir.with_suffix(".bin"), tmp_path / "net.bin")
    result = compile_model(tmp_path / "net.xml", _spec("fp16", benchmark=False), store=store, repository=repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["openvino"] == "openvino_ir ⇒ openvino"
    assert target.parity["passed"] and 0 < target.parity["outputs"][0]["max_abs"] < 2e-2
    assert {p.name for p in (repo_dir / "triton" / "m" / "1").iterdir()} == {
        "kiln-manifest.json",
        "model.bin",
        "model.xml",
    }
    _, consts = _ir_layers(repo_dir / "triton" / "m" / "1" / "model.xml")
    assert consts["f16"] > 0


def test_attention_detection(cnn_ir: Path, transformer_onnx: Path) -> None:
    import openvino as ov

    from services.exporters.openvino import detect_attention

    assert detect_attention(ov.Core().read_model(str(cnn_ir))) is False
    assert detect_attention(ov.convert_model(str(transformer_onnx))) is True


def test_onnx_conversion_failure_is_conversion_failed(tmp_path: Path) -> None:
    from services.artifacts import Artifact
    from services.converters.openvino_ir import onnx_to_ir

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07" + b"\xff" * 64)  # ONNX magic, garbage body
    ctx = _context(tmp_path, Artifact(root=tmp_path, kind="onnx", entry=bad.name), "onnx-to-openvino-ir")
    with pytest.raises(KilnError) as err:
        onnx_to_ir(ctx)
    assert err.value.code == "CONVERSION_FAILED"
    assert err.value.details["tool"] == "openvino.convert_model" and err.value.details["output_tail"]


def _context(tmp_path: Path, model, step_id: str, **spec_extra):
    from services.formats import DetectedSource
    from services.graph.planner import PlanStep
    from services.steps.context import StepContext

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return StepContext(
        job_id="t",
        step=PlanStep(id=step_id, kind="convert", engine="openvino", entry="", options=dict(spec_extra)),
        spec=_spec("fp32", **spec_extra),
        source=DetectedSource(format=Format(model.kind), path=model.path, seen="test"),
        inputs={"model": model},
        out_dir=out,
        scratch=tmp_path,
    )


# --- direct routes from TensorFlow sources -----------------------------------------------------


@pytest.fixture(scope="module")
def keras_classifier():
    """A small Keras CNN classifier (Conv, pooling, Dense) with random weights."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3), name="image")
    x = keras.layers.Conv2D(8, 3, activation="relu")(inp)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(5, name="logits")(x)
    return keras.Model(inp, out)


@pytest.fixture(scope="module")
def savedmodel_dir(keras_classifier, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tf") / "classifier_savedmodel"
    keras_classifier.export(str(path), verbose=False)  # signatures: serve, serving_default
    return path


@pytest.fixture(scope="module")
def tflite_file(keras_classifier, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    path = tmp_path_factory.mktemp("tflite") / "classifier.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(keras_classifier).convert())
    return path


@pytest.mark.parametrize(
    ("source", "route", "converter"),
    [
        (Format.SAVEDMODEL, "savedmodel → openvino_ir ⇒ openvino", "savedmodel-to-openvino-ir"),
        (Format.TFLITE, "tflite → openvino_ir ⇒ openvino", "tflite-to-openvino-ir"),
    ],
)
def test_planner_takes_direct_tf_routes(source: Format, route: str, converter: str) -> None:
    # The direct edge (1.5) beats tf2onnx (3.0) + ONNX→IR (1.0); optimisation on or off.
    for optimize in (True, False):
        plan = plan_routes(source, _spec("fp32", optimize=optimize))
        assert plan.routes["openvino"] == route
        assert [s.id for s in plan.steps if s.kind == "convert" and not s.fallback] == [converter]
        assert not [s for s in plan.steps if s.kind == "optimize" and not s.fallback]


@pytest.mark.parametrize("source_fixture", ["savedmodel_dir", "tflite_file"])
def test_tf_sources_compile_directly(source_fixture: str, request, store, repository, repo_dir: Path) -> None:
    source = request.getfixturevalue(source_fixture)
    result = compile_model(source, _spec("fp32"), store=store, repository=repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    fmt = "savedmodel" if source_fixture == "savedmodel_dir" else "tflite"
    assert result.plan.routes["openvino"] == f"{fmt} → openvino_ir ⇒ openvino"
    assert target.parity["passed"] and target.parity["outputs"][0]["max_abs"] < 1e-4
    assert target.parity["outputs"][0]["top1"] == 1.0
    manifest = json.loads((repo_dir / "triton" / "m" / "1" / "kiln-manifest.json").read_text())
    assert manifest["source"]["format"] == fmt
    assert sorted(s["step"] for s in manifest["steps"]) == ["export:openvino", "reference", f"{fmt}-to-openvino-ir"]
    assert (repo_dir / "triton" / "m" / "1" / "model.bin").stat().st_size > 0


def test_savedmodel_other_signature_and_missing_one(savedmodel_dir: Path, tmp_path: Path) -> None:
    from services.artifacts import Artifact
    from services.converters.openvino_ir import savedmodel_to_ir

    model = Artifact(root=savedmodel_dir, kind="savedmodel")
    art = savedmodel_to_ir(_context(tmp_path, model, "savedmodel-to-openvino-ir", signature="serve"))
    assert art.meta["tf_signature"] == "serve" and "tf.saved_model.load" in art.meta["read_as"]
    assert art.meta["inputs"][0]["name"] == "image" and art.meta["inputs"][0]["shape"] == [None, 16, 16, 3]
    assert (tmp_path / "out" / "model.bin").stat().st_size > 0
    with pytest.raises(KilnError) as err:
        savedmodel_to_ir(_context(tmp_path, model, "savedmodel-to-openvino-ir", signature="predict"))
    assert err.value.code == "INVALID_SPEC" and "serving_default" in err.value.hint


_COUNT_TELEMETRY = """
import sys
from openvino_telemetry.utils.sender import TelemetrySender
sent = []
TelemetrySender.send = lambda self, backend, message: sent.append(message)  # count, never send
from cli.main import main
try:
    main(sys.argv[1:], standalone_mode=True)
except SystemExit as exc:
    assert not exc.code, exc.code
events = [e["name"] for m in sent for e in m.get("events", [])]
print("EVENTS", ",".join(events))
"""


@pytest.mark.parametrize("source", ["cnn_onnx", "cnn_ir"])
def test_conversions_send_no_openvino_telemetry(source: str, request, tmp_path: Path) -> None:
    # A fresh HOME has no consent file, in which case OpenVINO reports every convert_model
    # and NNCF call (without the opt-out, the ONNX job sent dozens of events). Only the event
    # that importing openvino.tools.ovc sends before Kiln can opt out is left. An IR source
    # converts nothing: its first OpenVINO tool is NNCF in the int8 export.
    home = tmp_path / "home"
    home.mkdir()
    model = request.getfixturevalue(source)
    args = [str(model), "--target", "openvino", "--precision", "int8", "--repo", str(tmp_path / "repo")]
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "KILN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_TELEMETRY, "compile", *args, "--name", "m", "--no-benchmark"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = proc.stdout.rsplit("EVENTS ", 1)[1].strip()
    assert events in ("", "import"), events


def test_a_path_with_a_comma_converts(cnn_onnx: Path, tmp_path: Path, repository) -> None:
    # OpenVINO's converter reads "a, b/model.onnx" as two files; the store's folder (any folder a
    # user picks for the cache) may have a comma in its name.
    from services.storage import LocalArtifactStore

    store = LocalArtifactStore(tmp_path / "cache (team a, models)")
    result = compile_model(cnn_onnx, _spec("fp32", benchmark=False), store=store, repository=repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"]
