"""TensorFlow-family sources (Keras .keras/.h5, SavedModel dir/archive, TFLite) and ONNX via onnx2tf,
compiled end to end to every CPU engine with parity checked against the source framework."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kiln_testing.tf_models import (
    IMAGE,
    image_calibration,
    keras_cnn,
    keras_gelu_mlp,
    keras_grouped_conv,
    keras_normalized,
    keras_two_inputs,
    savedmodel_two_signatures,
    tar_gz,
    tflite_from_savedmodel,
)
from services.errors import ConversionFailed, InvalidSpec
from services.pipeline import compile_model
from services.repository.publish import read_manifest
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec

CPU_TARGETS = ["onnxruntime", "openvino", "tflite", "tfserving"]


@pytest.fixture(scope="session")
def tf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "tf-models"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def cnn_keras(tf_dir: Path) -> Path:
    return keras_cnn(tf_dir / "cnn.keras")


@pytest.fixture(scope="module")
def two_inputs_keras(tf_dir: Path) -> Path:
    return keras_two_inputs(tf_dir / "two_inputs.keras")


def _spec(targets: list[str], precision: str = "fp32", **extra):
    return load_spec({"targets": targets, "precision": precision, "name": "m", "benchmark": False, **extra})


def _assert_parity(result, precision: str) -> None:
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        parity = target.parity
        assert parity["passed"] is True, (name, parity)
        for out in parity["outputs"]:
            assert out["cosine"] >= tol.min_cosine, (name, out)
            if out["top1"] is not None:
                assert out["top1"] >= tol.min_top1, (name, out)
            if precision == "fp32":
                assert out["max_abs"] < 1e-4, (name, out)


def _repo_files(repo: Path, name: str) -> set[str]:
    (version,) = repo.glob(f"*/{name}/1")  # under its server's root
    return {p.relative_to(version).as_posix() for p in version.rglob("*") if p.is_file()}


# --- Keras CNN to every CPU engine, with the plan sharing work ------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_keras_cnn_every_cpu_engine(
    precision: str, cnn_keras: Path, tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    extra = {}
    if precision == "int8":
        extra["calibration"] = str(image_calibration(tmp_path / "calib.npz", "image", IMAGE))
    result = compile_model(cnn_keras, _spec(CPU_TARGETS, precision, **extra), store=store, repository=repository)
    _assert_parity(result, precision)

    # ONNX is made once (for onnxruntime); tfserving and openvino share the native SavedModel.
    plan_to_onnx = [s for s in result.plan.steps if s.kind == "convert" and s.format_out == "onnx" and not s.fallback]
    assert [s.id for s in plan_to_onnx] == ["keras-to-onnx"]
    ran_to_onnx = [
        sid
        for sid in result.steps
        if result.plan.step(sid).kind == "convert" and result.plan.step(sid).format_out == "onnx"
    ]
    assert ran_to_onnx == ["keras-to-onnx"]
    assert result.plan.shared == ["keras-to-savedmodel"]
    assert result.plan.routes == {
        "onnxruntime": "keras → onnx → optimize ⇒ onnxruntime",
        "openvino": "keras → savedmodel → openvino_ir ⇒ openvino",
        "tflite": "keras → savedmodel ⇒ tflite",
        "tfserving": "keras → savedmodel ⇒ tfserving",
    }

    assert _repo_files(repo_dir, "m-tflite") == {"model.tflite", "kiln-manifest.json"}
    assert {"saved_model.pb", "kiln-manifest.json"} <= _repo_files(repo_dir, "m-tfserving")
    assert (repo_dir / "tfserving" / "m-tfserving" / "1" / "variables").is_dir()
    assert "model.onnx" in _repo_files(repo_dir, "m-onnxruntime")
    assert {"model.xml", "model.bin"} <= _repo_files(repo_dir, "m-openvino")
    if precision == "fp32":
        # The reference came from Keras itself; every artifact agrees with it to float rounding.
        worst = max(o["max_abs"] for t in result.targets.values() for o in t.parity["outputs"])
        assert worst < 1e-5
    if precision == "int8":
        tflite = read_manifest(repository, "m-tflite", 1)["engine_details"]["tflite"]
        assert tflite["mode"] == "full-integer int8" and tflite["calibration_data"] == "calibration file"
        # Full-integer inside, float32 at the boundary: the contract every target keeps by default.
        assert tflite["quantized_io"] == {"inputs": [], "outputs": []}
        assert tflite["io_contract"] == "float32 inputs and outputs"


def test_keras_h5_source(tf_dir: Path, store, repository) -> None:
    import keras

    h5 = tf_dir / "cnn.h5"
    if not h5.exists():
        keras.saving.load_model(keras_cnn(tf_dir / "cnn.keras")).save(h5)
    result = compile_model(h5, _spec(["onnxruntime", "tflite"], optimize=False), store=store, repository=repository)
    assert result.source.seen == "HDF5 file (Keras .h5)"
    _assert_parity(result, "fp32")


# --- two named inputs and two named outputs: names carried through every format ------------


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_two_named_inputs_every_cpu_engine(precision: str, two_inputs_keras: Path, store, repository) -> None:
    result = compile_model(two_inputs_keras, _spec(CPU_TARGETS, precision), store=store, repository=repository)
    _assert_parity(result, precision)
    for target in result.targets.values():
        # Outputs were matched by name, not position: each artifact reports the Keras output names.
        assert [o["name"] for o in target.parity["outputs"]] == ["prob", "score"]
    onnx_model = onnx.load(str(result.steps["keras-to-onnx"].artifact.path))
    assert sorted(i.name for i in onnx_model.graph.input) == ["extra", "features"]
    assert sorted(o.name for o in onnx_model.graph.output) == ["prob", "score"]
    sig = read_manifest(repository, "m-tfserving", 1)["engine_details"]["tfserving"]["signature"]
    assert sig["signature"] == "serving_default"
    # Keys are what TF Serving clients send; the graph tensors behind them (serving_default_extra:0
    # at fp32, extra:0 in the frozen fp16 graph) are what saved_model_cli shows.
    assert sorted(sig["inputs"]) == ["extra", "features"]
    assert all(tensor.endswith(f"{key}:0") for key, tensor in sig["inputs"].items())
    assert set(sig["outputs"]) == {"prob", "score"}
    io = read_manifest(repository, "m-tflite", 1)["io"]
    assert [t["name"] for t in io["inputs"]] == ["extra", "features"]


def test_two_inputs_int8_calibration_matched_by_name(two_inputs_keras: Path, tmp_path: Path, store, repository) -> None:
    rng = np.random.default_rng(11)
    # Keys written in the opposite order to the model's inputs; matching is by name.
    calib = tmp_path / "calib.npz"
    np.savez(
        calib,
        features=rng.standard_normal((24, 8)).astype("float32"),
        extra=rng.standard_normal((24, 4)).astype("float32"),
    )
    result = compile_model(
        two_inputs_keras,
        _spec(CPU_TARGETS, "int8", calibration=str(calib)),
        store=store,
        repository=repository,
    )
    _assert_parity(result, "int8")
    details = read_manifest(repository, "m-tflite", 1)["engine_details"]["tflite"]
    assert details["mode"] == "full-integer int8"
    assert details["calibration_samples"] == 18  # 6 of the 24 rows are held out for parity
    assert details["quantized_io"] == {"inputs": [], "outputs": []}  # float32 I/O: integer_io is not set
    # NNCF's per-sample mean of min/max clipped these short activation vectors ("score" cosine 0.980).
    nncf = read_manifest(repository, "m-openvino", 1)["engine_details"]["int8"]
    assert nncf["activation_ranges"] == "global min/max" and nncf["subset_size"] == 18


# --- SavedModel sources: the spec's signature, directory or archive -------------------------


def test_savedmodel_signature_chosen_by_spec(tf_dir: Path, store, repository) -> None:
    sm = savedmodel_two_signatures(tf_dir / "two_sigs")
    result = compile_model(
        sm, _spec(["onnxruntime", "tflite", "tfserving"], signature="doubled"), store=store, repository=repository
    )
    _assert_parity(result, "fp32")
    ref = result.steps["reference"].artifact
    with np.load(ref.root / "inputs.npz") as inputs, np.load(ref.root / "outputs.npz") as outputs:
        x, y = inputs["0/x"], outputs["0/y"]
    import tensorflow as tf

    plain = tf.saved_model.load(str(sm)).signatures["serving_default"](x=tf.constant(x))["y"].numpy()
    np.testing.assert_allclose(y, 2 * plain, rtol=1e-5)  # the reference ran "doubled", not the default
    manifest = read_manifest(repository, "m-tfserving", 1)
    assert manifest["engine_details"]["tfserving"]["signature"]["signature"] == "doubled"
    assert read_manifest(repository, "m-tflite", 1)["engine_details"]["tflite"]["signature"] == "doubled"


def test_savedmodel_archive_and_missing_signature(tf_dir: Path, store, repository) -> None:
    archive = tar_gz(savedmodel_two_signatures(tf_dir / "two_sigs"), tf_dir / "two_sigs.tar.gz")
    result = compile_model(archive, _spec(["onnxruntime"], optimize=False), store=store, repository=repository)
    assert result.source.seen == "tar archive holding a TF SavedModel"
    _assert_parity(result, "fp32")
    bad = compile_model(
        archive, _spec(["onnxruntime"], optimize=False, signature="nope"), store=store, repository=repository
    )
    err = bad.targets["onnxruntime"].error
    assert err["code"] == InvalidSpec.code
    assert "['doubled', 'serving_default']" in err["message"]


# --- TFLite source ------------------------------------------------------------------------------


def test_tflite_source_to_onnx_keeps_signature_names(tf_dir: Path, store, repository) -> None:
    import keras

    cnn_sm = tf_dir / "cnn_sm"
    if not cnn_sm.exists():
        from services.converters.tensorflow_native import write_keras_savedmodel

        write_keras_savedmodel(keras.saving.load_model(keras_cnn(tf_dir / "cnn.keras")), cnn_sm)
    src = tflite_from_savedmodel(cnn_sm, tf_dir / "cnn.tflite")
    result = compile_model(src, _spec(["onnxruntime", "tflite", "openvino"]), store=store, repository=repository)
    _assert_parity(result, "fp32")
    onnx_model = onnx.load(str(result.steps["tflite-to-onnx"].artifact.path))
    assert [i.name for i in onnx_model.graph.input] == ["image"]
    assert [o.name for o in onnx_model.graph.output] == ["logits"]
    assert result.steps["tflite-to-onnx"].meta["renamed"] == {
        "serving_default_image:0": "image",
        "StatefulPartitionedCall:0": "logits",
    }
    assert (
        Path(result.targets["tflite"].published["uri"].removeprefix("file://")) / "model.tflite"
    ).read_bytes() == src.read_bytes()


# --- ONNX sources through onnx2tf --------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_onnx_source_to_tfserving_and_tflite(precision: str, cnn_onnx: Path, tmp_path: Path, store, repository) -> None:
    extra = {}
    if precision == "int8":
        rng = np.random.default_rng(2)
        extra["calibration"] = str(tmp_path / "c.npz")
        np.savez(extra["calibration"], input=rng.standard_normal((16, 3, 32, 32)).astype("float32"))
    result = compile_model(
        cnn_onnx, _spec(["tfserving", "tflite"], precision, **extra), store=store, repository=repository
    )
    _assert_parity(result, precision)
    assert result.plan.shared == ["optimize", "optimize/onnx-to-savedmodel"]
    converted = result.steps["optimize/onnx-to-savedmodel"].meta
    assert converted["kept_input_layout"] == ["input"]
    # The SavedModel takes the ONNX layout (NCHW), so callers feed what they fed the ONNX model.
    io = read_manifest(repository, "m-tfserving", 1)["io"]
    assert io["inputs"] == [{"name": "input", "dtype": "float32", "shape": [None, 3, 32, 32]}]


def test_onnx2tf_channel_last_output_is_transposed_back(tmp_path: Path, store, repository) -> None:
    from kiln_testing.models import _torch, export_onnx

    torch = _torch()
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()).eval()
    src = export_onnx(conv, torch.randn(1, 3, 8, 10), tmp_path / "conv.onnx")
    result = compile_model(src, _spec(["tfserving"], optimize=False), store=store, repository=repository)
    _assert_parity(result, "fp32")
    meta = result.steps["onnx-to-savedmodel"].meta
    assert meta["transposed_outputs"] == ["output"]
    io = read_manifest(repository, "m", 1)["io"]
    assert io["outputs"][0]["shape"] == [None, 4, 8, 10]


# --- Keras models tf2onnx once got wrong: each on its first route, to every CPU engine ------------


@pytest.mark.parametrize("builder", [keras_normalized, keras_grouped_conv], ids=["normalization", "grouped-conv"])
def test_keras_preprocessing_constants_and_grouped_conv_every_cpu_engine(
    builder, tf_dir: Path, store, repository
) -> None:
    # Normalization(mean, variance): tf2onnx made its two constants extra graph inputs (parity
    # failed on input names). Grouped Conv2D: Keras runs it XLA-compiled, and tf2onnx left a
    # StatefulPartitionedCall no runtime loads (reported as SOURCE_UNREADABLE, "truncated").
    keras = builder(tf_dir / f"{builder.__name__}.keras")
    result = compile_model(keras, _spec(CPU_TARGETS), store=store, repository=repository)
    _assert_parity(result, "fp32")
    for name, target in result.targets.items():
        assert [a["rank"] for a in target.attempts] == [1], (name, target.attempts)  # no fallback was needed
    onnx_model = onnx.load(str(result.steps["keras-to-onnx"].artifact.path))
    assert [i.name for i in onnx_model.graph.input] == ["image"]
    assert [o.name for o in onnx_model.graph.output] == ["logits"]
    assert not [n.op_type for n in onnx_model.graph.node if n.op_type.endswith("PartitionedCall")]


def test_tf2onnx_output_with_a_function_call_is_conversion_failed_naming_tf2onnx(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    from services.converters.tensorflow_to_onnx import check_onnx_output

    # What tf2onnx wrote for a grouped Conv2D before Kiln inlined XLA calls: a TF call node in ONNX.
    graph = helper.make_graph(
        [helper.make_node("StatefulPartitionedCall", ["image"], ["logits"], name="functional/conv/call")],
        "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))

    class Ctx:
        step = type("Step", (), {"id": "keras-to-onnx"})()

    with pytest.raises(ConversionFailed) as exc:
        check_onnx_output(Ctx(), model, path, "Keras model m.keras")  # type: ignore[arg-type]
    err = exc.value
    assert err.code == "CONVERSION_FAILED" and err.details["tool"] == "tf2onnx"
    assert err.details["step"] == "keras-to-onnx" and "StatefulPartitionedCall" in err.message
    assert "source model is fine" in err.hint
    # A node onnxruntime has no kernel for is caught by loading the model, not by its name.
    graph.node[0].op_type = "NoSuchOp"
    onnx.save(model, str(path))
    with pytest.raises(ConversionFailed, match="tf2onnx wrote an invalid ONNX model"):
        check_onnx_output(Ctx(), model, path, "Keras model m.keras")  # type: ignore[arg-type]


def test_exact_gelu_reaches_onnxruntime(tf_dir: Path, store, repository) -> None:
    # tf2onnx passes TensorFlow's Erfc through as an "Erfc" node, which is no ONNX op
    # (ConvNeXt's GELU failed so on every route); Kiln rewrites it as 1 - Erf(x).
    result = compile_model(
        keras_gelu_mlp(tf_dir / "gelu.keras"), _spec(["onnxruntime"]), store=store, repository=repository
    )
    _assert_parity(result, "fp32")
    step = result.steps["keras-to-onnx"]
    assert step.meta["erfc_lowered"] == 1
    ops = {n.op_type for n in onnx.load(str(step.artifact.path)).graph.node}
    assert "Erf" in ops and "Erfc" not in ops
