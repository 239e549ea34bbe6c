"""The tflite target: precisions and what they store, int8 kinds, the LiteRT runner, MobileNetV2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln_testing.tf_models import keras_mlp, mobilenet_v2, tflite_without_signature
from services.errors import InvalidSpec
from services.exporters.tflite import representative_feeds
from services.pipeline import compile_model
from services.repository.publish import read_manifest
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec


@pytest.fixture(scope="session")
def tf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "tf-models"
    path.mkdir(exist_ok=True)
    return path


def _spec(targets: list[str], precision: str = "fp32", **extra):
    return load_spec({"targets": targets, "precision": precision, "name": "m", "benchmark": False, **extra})


def _published(result, target: str) -> Path:
    return Path(result.targets[target].published["uri"].removeprefix("file://"))


# --- calibration samples meet inputs by name ----------------------------------------------------


def test_representative_feeds_match_by_name_not_position() -> None:
    a, b = np.zeros((1, 2), np.float32), np.ones((1, 3), np.float32)
    feeds = [{"b": b, "a": a}]
    out = representative_feeds(feeds, ["a", "b"])
    assert list(out[0]) == ["a", "b"] and out[0]["a"] is not None and out[0]["a"].shape == (1, 2)
    # onnx2tf's sanitised names (':' -> '__') are the same inputs.
    assert representative_feeds([{"in:0": a}], ["in__0"])[0]["in__0"].shape == (1, 2)
    with pytest.raises(InvalidSpec) as exc:
        representative_feeds([{"a": a, "c": b}], ["a", "b"])
    assert "['a', 'c']" in exc.value.message and "['a', 'b']" in exc.value.message


# --- precisions: what is stored, and which int8 -------------------------------------------------


@pytest.fixture(scope="module")
def mlp_results(tf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    """The MLP compiled to tflite at fp32, fp16, dynamic-range int8 and full-integer int8."""
    from services.repository import LocalModelRepository
    from services.storage import LocalArtifactStore

    src = keras_mlp(tf_dir / "mlp.keras")
    work = tmp_path_factory.mktemp("tflite-precisions")
    calib = work / "calib.npz"
    np.savez(calib, x=np.random.default_rng(4).standard_normal((32, 64)).astype("float32"))
    store = LocalArtifactStore(work / "store")
    out = {}
    for label, precision, extra in [
        ("fp32", "fp32", {}),
        ("fp16", "fp16", {}),
        ("int8-dynamic", "int8", {}),
        ("int8-full", "int8", {"calibration": str(calib)}),
        ("int8-integer-io", "int8", {"calibration": str(calib), "integer_io": True}),
    ]:
        repo = LocalModelRepository(work / label)
        out[label] = (compile_model(src, _spec(["tflite"], precision, **extra), store=store, repository=repo), repo)
    return out


def test_precisions_pass_parity_and_shrink_the_file(mlp_results) -> None:
    sizes = {}
    for label, (result, repo) in mlp_results.items():
        target = result.targets["tflite"]
        assert target.status == "succeeded", (label, target.error)
        precision = Precision(label.split("-")[0])
        tol = DEFAULT_TOLERANCES[precision]
        out = target.parity["outputs"][0]
        assert out["cosine"] >= tol.min_cosine and out["top1"] >= tol.min_top1, (label, out)
        sizes[label] = (_published(result, "tflite") / "model.tflite").stat().st_size
        assert read_manifest(repo, "m", 1)["engine_details"]["tflite"]["size_bytes"] == sizes[label]
    assert mlp_results["fp32"][0].targets["tflite"].parity["outputs"][0]["max_abs"] < 1e-5
    # ~300k weights: fp16 halves the file, int8 quarters it (plus scales and graph).
    assert 0.45 < sizes["fp16"] / sizes["fp32"] < 0.55
    assert 0.2 < sizes["int8-dynamic"] / sizes["fp32"] < 0.3
    assert 0.2 < sizes["int8-full"] / sizes["fp32"] < 0.3


def test_int8_kind_follows_calibration_data(mlp_results) -> None:
    dynamic = read_manifest(mlp_results["int8-dynamic"][1], "m", 1)
    full = read_manifest(mlp_results["int8-full"][1], "m", 1)
    assert dynamic["engine_details"]["tflite"]["mode"] == "dynamic-range int8"
    assert "calibration_data" not in dynamic["engine_details"]["tflite"]
    assert dynamic["engine_details"]["tflite"]["quantized_io"] == {"inputs": [], "outputs": []}
    assert full["engine_details"]["tflite"]["mode"] == "full-integer int8"
    assert full["engine_details"]["tflite"]["io_contract"] == "float32 inputs and outputs"
    assert full["engine_details"]["tflite"]["calibration_data"] == "calibration file"
    assert full["engine_details"]["tflite"]["calibration_samples"] == 24  # 8 of 32 held out
    fp16 = read_manifest(mlp_results["fp16"][1], "m", 1)["engine_details"]["tflite"]
    assert fp16["mode"] == "float16 weights"


def _tflite_io(path: Path) -> dict[str, np.dtype]:
    """Return each signature tensor's dtype as the .tflite file declares it (read by LiteRT, not Kiln)."""
    from ai_edge_litert.interpreter import Interpreter

    raw = Interpreter(model_path=str(path)).get_signature_runner("serving_default")
    return {
        **{n: d["dtype"] for n, d in raw.get_input_details().items()},
        **{n: d["dtype"] for n, d in raw.get_output_details().items()},
    }


@pytest.mark.parametrize("label", ["fp32", "fp16", "int8-dynamic", "int8-full", "int8-integer-io"])
def test_io_contract_is_float_unless_integer_io_and_the_manifest_tells_the_truth(mlp_results, label: str) -> None:
    result, repo = mlp_results[label]
    manifest = read_manifest(repo, "m", 1)
    stored = _tflite_io(_published(result, "tflite") / "model.tflite")
    want = np.int8 if label == "int8-integer-io" else np.float32
    assert stored == {"x": want, "logits": want}
    # The manifest states the file's own dtypes, and the scale of a quantized tensor.
    io = {t["name"]: t for t in [*manifest["io"]["inputs"], *manifest["io"]["outputs"]]}
    assert {n: np.dtype(t["dtype"]) for n, t in io.items()} == stored
    assert all(("quantization" in t) == (want == np.int8) for t in io.values())
    if want == np.int8:
        assert io["x"]["quantization"]["scale"] > 0
        assert manifest["engine_details"]["tflite"]["quantized_io"] == {"inputs": ["x"], "outputs": ["logits"]}
        assert manifest["engine_details"]["tflite"]["io_contract"] == "int8 inputs and outputs"


def test_int8_fallback_is_a_visible_warning(mlp_results) -> None:
    dynamic_result, dynamic_repo = mlp_results["int8-dynamic"]
    warnings = dynamic_result.targets["tflite"].warnings
    assert len(warnings) == 1 and "fell back to dynamic-range int8" in warnings[0]
    assert read_manifest(dynamic_repo, "m", 1)["warnings"] == warnings
    for label in ("fp32", "int8-full", "int8-integer-io"):
        result, repo = mlp_results[label]
        assert result.targets["tflite"].warnings == [] and read_manifest(repo, "m", 1)["warnings"] == []


def test_integer_io_needs_int8_tflite_and_calibration(tf_dir: Path, store, repository) -> None:
    for bad in ({"targets": ["onnxruntime"], "precision": "int8"}, {"targets": ["tflite"], "precision": "fp16"}):
        with pytest.raises(InvalidSpec) as exc:
            load_spec({**bad, "integer_io": True})
        assert exc.value.details["errors"][0]["field"] == "integer_io"
    result = compile_model(
        keras_mlp(tf_dir / "mlp.keras"), _spec(["tflite"], "int8", integer_io=True), store=store, repository=repository
    )
    target = result.targets["tflite"]
    assert target.status == "failed" and target.error["code"] == "INVALID_SPEC"
    assert "calibration" in target.error["message"] and target.published is None


def test_runner_quantizes_int8_inputs_and_dequantizes_outputs(mlp_results, tf_dir: Path) -> None:
    from ai_edge_litert.interpreter import Interpreter

    from services.runners.tensorflow import KerasRunner
    from services.runners.tflite import TFLiteRunner

    path = _published(mlp_results["int8-integer-io"][0], "tflite") / "model.tflite"
    raw = Interpreter(model_path=str(path)).get_signature_runner("serving_default")
    assert raw.get_input_details()["x"]["dtype"] == np.int8
    assert raw.get_output_details()["logits"]["dtype"] == np.int8
    runner = TFLiteRunner(path)
    assert [(t.name, t.dtype, t.shape) for t in runner.inputs] == [("x", "float32", (None, 64))]
    x = np.random.default_rng(4).standard_normal((3, 64)).astype("float32")  # batch 3: a resize
    got = runner.run({"x": x})["logits"]
    want = KerasRunner(tf_dir / "mlp.keras").run({"x": x})["logits"]
    assert got.dtype == np.float32 and got.shape == (3, 10)
    cos = float(np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cos > 0.98
    runner.close()


# --- MobileNetV2 (keras.applications, weights=None) to every CPU engine -------------------------


def test_mobilenet_v2_every_cpu_engine(tf_dir: Path, tmp_path: Path, store, repository) -> None:
    src = mobilenet_v2(tf_dir / "mobilenet_v2.keras")
    spec = _spec(["onnxruntime", "openvino", "tflite", "tfserving"], validation={"samples": 4})
    result = compile_model(src, spec, store=store, repository=repository)
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        out = target.parity["outputs"][0]
        assert out["name"] == "predictions"
        assert out["max_abs"] < 1e-4 and out["cosine"] > 0.9999 and out["top1"] == 1.0, (name, out)
    first_choice = [s for s in result.plan.steps if not s.fallback]
    assert [s.id for s in first_choice if s.kind == "convert" and s.format_out == "onnx"] == ["keras-to-onnx"]
    # The network is alive: its class probabilities differ between samples and from uniform.
    ref = result.steps["reference"].artifact
    with np.load(ref.root / "outputs.npz") as outputs:
        probs = np.stack([outputs[f"{i}/predictions"][0] for i in range(4)])
    assert probs.max() > 0.15 and np.ptp(probs, axis=0).max() > 0.01


def test_tflite_without_signature_source(tf_dir: Path, store, repository) -> None:
    """A .tflite with no SignatureDef runs by tensor name, resizes its dynamic batch, converts to ONNX."""
    from services.runners.tflite import TFLiteRunner

    src = tflite_without_signature(tf_dir / "nosig.tflite")
    runner = TFLiteRunner(src)
    assert runner.signature is None and [t.name for t in runner.inputs] == ["x"]
    for batch in (1, 4, 2):
        assert runner.run({"x": np.ones((batch, 6), np.float32)})["y"].shape == (batch, 3)
    result = compile_model(src, _spec(["onnxruntime", "tflite"], optimize=False), store=store, repository=repository)
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        assert target.parity["outputs"][0]["max_abs"] < 1e-5
    assert result.steps["tflite-to-onnx"].meta["inputs"][0]["name"] == "x"


# --- files as TFLite's own tools write them (issue 27) -----------------------------------------


def _with_metadata_zip(tflite: Path, dest: Path) -> Path:
    """Append a zip of associated files to a .tflite, as TFLite's metadata writers and Model Maker do."""
    import io
    import zipfile

    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as zf:
        zf.writestr("labels.txt", "\n".join(f"class_{i}" for i in range(10)))
        zf.writestr("vocab.txt", "a\nb\n")
    dest.write_bytes(tflite.read_bytes() + packed.getvalue())
    return dest


def test_a_tflite_file_with_appended_metadata_is_tflite_not_an_archive(
    mlp_results, tmp_path: Path, store, repository
) -> None:
    import zipfile

    from services.formats import Format, detect_format, open_source
    from services.inspect_model import inspect_model

    plain = _published(mlp_results["fp32"][0], "tflite") / "model.tflite"
    src = _with_metadata_zip(plain, tmp_path / "with_metadata.tflite")
    assert zipfile.is_zipfile(src)  # what fooled detection before
    assert detect_format(src)[0] is Format.TFLITE
    opened = open_source(src, tmp_path / "work")
    assert opened.path == src and opened.path.is_file()
    summary = inspect_model(src, tmp_path / "inspect")
    assert summary.format == "tflite" and [t.name for t in summary.inputs] == ["x"]
    result = compile_model(src, _spec(["onnxruntime", "openvino", "tflite"]), store=store, repository=repository)
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        assert target.parity["outputs"][0]["max_abs"] < 1e-4, name


def test_inspect_shows_a_quantised_tflite_model_s_integer_io_and_its_artifact_says_it_keeps_it(
    mlp_results, tmp_path: Path, store, repository
) -> None:
    from services.inspect_model import inspect_model

    src = _published(mlp_results["int8-integer-io"][0], "tflite") / "model.tflite"
    summary = inspect_model(src, tmp_path / "inspect").to_dict()
    (x,) = summary["inputs"]
    (logits,) = summary["outputs"]
    assert (x["name"], x["dtype"]) == ("x", "int8") and (logits["name"], logits["dtype"]) == ("logits", "int8")
    assert x["quantization"]["scale"] > 0 and isinstance(x["quantization"]["zero_point"], int)
    result = compile_model(src, _spec(["tflite"]), store=store, repository=repository)
    target = result.targets["tflite"]
    assert target.status == "succeeded", target.error
    kept = [w for w in target.warnings if "keeps the source's quantised integer I/O" in w]
    assert kept and "input x (int8, scale" in kept[0] and "output logits (int8" in kept[0]
