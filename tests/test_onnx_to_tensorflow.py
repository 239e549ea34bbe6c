"""Transformers through ONNX to TensorFlow (onnx2tf): the tflite and tfserving targets.

The tests' encoder block (dynamic batch) and a tiny BertModel exported with torch.export
(dynamic batch and sequence) go to tflite at fp32/fp16/int8 and tfserving at fp32/fp16,
each with parity against the source model's own framework. The block keeps its dynamic
batch; the BERT's attention-mask arithmetic only converts at fixed shapes, which the
SavedModel's signature, the step's report and the manifest all say. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln_testing.models import BERT_VOCAB, assert_parity_passed, export_again, grouped_cnn_onnx, tiny_bert_module
from services.errors import ConversionFailed
from services.formats import Format
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.pipeline.executor import run_step
from services.repository.publish import read_manifest
from services.runners import open_runner
from services.spec import load_spec

CONVERT = "onnx-to-savedmodel"


# --------------------------------------------------------------------------- models and helpers


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx2tf")


@pytest.fixture(scope="module")
def shared_store(work: Path):
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(work / "store")


@pytest.fixture(scope="module")
def bert_pt2(work: Path) -> Path:
    """A tiny BertModel (input_ids, attention_mask int64; dynamic batch and sequence) as an ExportedProgram."""
    import torch

    ids = torch.randint(0, BERT_VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    batch, seq = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("seq", min=2, max=64)
    program = torch.export.export(
        tiny_bert_module(),
        (),
        kwargs={"input_ids": ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
    )
    path = work / "bert.pt2"
    torch.export.save(program, str(path))
    return path


@pytest.fixture(scope="module")
def block_job(transformer_onnx: Path, shared_store, work: Path):
    """The encoder block compiled to tflite and tfserving at fp32, and the repository it went to."""
    from services.repository import LocalModelRepository

    repository = LocalModelRepository(work / "repo-block")
    return compile_model(
        transformer_onnx, _spec(["tflite", "tfserving"]), store=shared_store, repository=repository
    ), repository


@pytest.fixture(scope="module")
def bert_job(bert_pt2: Path, shared_store, work: Path):
    """The BERT compiled to tflite and tfserving at fp32, and the repository it went to."""
    from services.repository import LocalModelRepository

    repository = LocalModelRepository(work / "repo-bert")
    return compile_model(
        bert_pt2, _spec(["tflite", "tfserving"]), store=shared_store, repository=repository
    ), repository


def _spec(targets: list[str], precision: str = "fp32", **extra):
    return load_spec(
        {
            "targets": targets,
            "precision": precision,
            "name": "m",
            "benchmark": False,
            "validation": {"samples": 4},
            **extra,
        }
    )


def _convert_meta(result) -> dict:
    (step_id,) = [s for s in result.steps if s.endswith(CONVERT)]
    return result.steps[step_id].meta


def _tflite_ops(path: Path) -> set[str]:
    from ai_edge_litert.interpreter import Interpreter

    return {op["op_name"] for op in Interpreter(model_path=str(path))._get_ops_details()}


def _published(result, target: str) -> Path:
    return Path(result.targets[target].published["uri"].removeprefix("file://"))


# --------------------------------------------------------------------------- the encoder block


def test_transformer_block_keeps_dynamic_batch(block_job, transformer_onnx) -> None:
    result, repository = block_job
    for target in ("tflite", "tfserving"):
        assert result.targets[target].status == "succeeded", result.targets[target].error
        assert_parity_passed(result.targets[target].parity, "fp32")
    assert "optimize/onnx-to-savedmodel" in result.plan.shared  # converted once for both targets

    meta = _convert_meta(result)
    assert meta["input_shapes"] == "dynamic" and meta["fixed_axes"] == {}
    assert [a["input_shapes"] for a in meta["attempts"]] == ["dynamic"]
    # The probe ran a second batch size: the dynamic batch is real, not just declared.
    assert meta["probe"]["feeds"] == [
        {"feed": "job shapes", "shapes": {"input": [1, 16, 32]}},
        {"feed": "dynamic axes varied", "shapes": {"input": [2, 16, 32]}},
    ]
    assert meta["probe"]["max_abs_diff"]["output"] < 1e-5
    changed = {p["name"] for p in meta["passes"] if p["modified"]}
    # torch's Linear exports Add(bias, x @ W), which onnx2tf broadcast into [1, 96, 1]; TFLite has no Erf;
    # torch names nodes "/ln1/...", no valid TensorFlow scope for a variable onnx2tf creates; and
    # shape_inference: the optimiser leaves inferred shapes out of its output, onnx2tf needs them.
    assert changed == {
        "shape_inference",
        "onnx2tf_constant_operand_last",
        "onnx2tf_fuse_erf_gelu",
        "onnx2tf_scope_safe_node_names",
    }

    manifest = read_manifest(repository, "m-tfserving", 1)
    assert manifest["io"]["inputs"] == [{"name": "input", "dtype": "float32", "shape": [None, 16, 32]}]
    assert "onnx2tf_fuse_erf_gelu" in {p["name"] for p in manifest["passes"]}

    tflite = _published(result, "tflite") / "model.tflite"
    ops = _tflite_ops(tflite)
    assert "GELU" in ops and not any("FLEX" in op or "CUSTOM" in op for op in ops), ops

    # Batch 3 was never probed nor validated; both artifacts still match onnxruntime there.
    x = np.random.default_rng(5).standard_normal((3, 16, 32)).astype(np.float32)
    want = open_runner(Format.ONNX, transformer_onnx).run({"input": x})["output"]
    for fmt, path in ((Format.SAVEDMODEL, _published(result, "tfserving")), (Format.TFLITE, tflite)):
        got = open_runner(fmt, path).run({"input": x})["output"]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_transformer_block_fp16_and_int8(block_job, shared_store, work) -> None:
    result, repository = block_job
    for precision, targets in (("fp16", ["tflite", "tfserving"]), ("int8", ["tflite", "tfserving"])):
        metas = export_again(result, _spec(targets, precision), shared_store, repository)
        for target in targets:
            assert_parity_passed(metas[target]["parity"], precision)
            assert metas[target]["precision"] == precision


# --------------------------------------------------------------------------- BERT


def test_bert_exported_program_at_fixed_shapes(bert_job) -> None:
    result, repository = bert_job
    for target in ("tflite", "tfserving"):
        assert result.targets[target].status == "succeeded", result.targets[target].error
        parity = result.targets[target].parity
        assert_parity_passed(parity, "fp32")
        assert [o["name"] for o in parity["outputs"]] == ["last_hidden_state", "pooler_output"]
    assert result.plan.routes["tflite"] == "torch_export → onnx → optimize → savedmodel ⇒ tflite"

    meta = _convert_meta(result)
    first, second = meta["attempts"]
    assert first["input_shapes"] == "dynamic" and "unknown rank" in first["error"]
    assert second["input_shapes"] == "fixed" and "error" not in second
    assert meta["input_shapes"] == "fixed"
    assert meta["fixed_input_shapes"] == {"input_ids": [1, 16], "attention_mask": [1, 16]}
    assert meta["fixed_axes"] == {"input_ids": [0, 1], "attention_mask": [0, 1]}
    # The probe also ran with the mask's last quarter zeroed, so the masking path is checked.
    assert [f["feed"] for f in meta["probe"]["feeds"]] == ["job shapes", "padded masks"]
    assert max(meta["probe"]["max_abs_diff"].values()) < 1e-5

    # What a caller sees: the signature and the manifest carry the fixed shapes, and the
    # manifest lists the pass that pinned them.
    manifest = read_manifest(repository, "m-tfserving", 1)
    assert {t["name"]: t["shape"] for t in manifest["io"]["inputs"]} == {
        "input_ids": [1, 16],
        "attention_mask": [1, 16],
    }
    assert "fix_input_shapes" in {p["name"] for p in manifest["passes"]}

    # A padded batch (the reference's generated masks are all ones) against torch itself.
    import torch

    ids = np.random.default_rng(3).integers(0, BERT_VOCAB, (1, 16)).astype(np.int64)
    mask = np.ones((1, 16), np.int64)
    mask[0, 11:] = 0
    with torch.no_grad():
        eager = tiny_bert_module()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    tflite = _published(result, "tflite") / "model.tflite"
    for fmt, path in ((Format.SAVEDMODEL, _published(result, "tfserving")), (Format.TFLITE, tflite)):
        got = open_runner(fmt, path).run({"input_ids": ids, "attention_mask": mask})
        np.testing.assert_allclose(got["last_hidden_state"], eager.last_hidden_state.numpy(), atol=1e-4)
        np.testing.assert_allclose(got["pooler_output"], eager.pooler_output.numpy(), atol=1e-4)


def test_bert_fp16_and_int8(bert_job, shared_store, work) -> None:
    result, repository = bert_job
    for precision, targets in (("fp16", ["tflite", "tfserving"]), ("int8", ["tflite", "tfserving"])):
        metas = export_again(result, _spec(targets, precision), shared_store, repository)
        for target in targets:
            assert_parity_passed(metas[target]["parity"], precision)
            assert metas[target]["precision"] == precision


def test_bert_full_integer_int8_with_calibration(bert_pt2, shared_store, work) -> None:
    """With calibration rows (padded masks among them) TFLite quantizes every float tensor."""
    from services.repository import LocalModelRepository

    rng = np.random.default_rng(4)
    mask = np.ones((32, 16), np.int64)
    mask[::2, 12:] = 0
    calibration = work / "bert-calibration.npz"
    np.savez(calibration, input_ids=rng.integers(0, BERT_VOCAB, (32, 16)).astype(np.int64), attention_mask=mask)
    spec = _spec(["tflite"], "int8", calibration=str(calibration))
    result = compile_model(bert_pt2, spec, store=shared_store, repository=LocalModelRepository(work / "repo-int8"))
    target = result.targets["tflite"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"] and target.parity["inputs_from"] == "calibration"
    assert min(o["cosine"] for o in target.parity["outputs"]) >= 0.999
    details = result.steps["export:tflite"].meta["engine_details"]["tflite"]
    assert details["mode"] == "full-integer int8" and details["calibration_samples"] == 24
    # Token ids and masks stay integers; the outputs stay float32 (integer_io is not set).
    assert details["quantized_io"] == {"inputs": [], "outputs": []}
    io = result.steps["export:tflite"].meta["io"]  # read from the .tflite file
    assert {t["name"]: t["dtype"] for t in io["outputs"]} == {
        "last_hidden_state": "float32",
        "pooler_output": "float32",
    }


def test_spec_open_axes_are_never_pinned(bert_job, shared_store, work) -> None:
    """A batch axis the spec keeps open (-1) is not pinned: the conversion fails and says why."""
    result, _ = bert_job
    spec = _spec(["tfserving"], inputs={"input_ids": {"shape": [-1, 16]}, "attention_mask": {"shape": [-1, 16]}})
    (step,) = [s for s in plan_routes(result.source.format, spec).steps if s.id.endswith(CONVERT)]
    keys = {role: result.steps[dep].key or "" for role, dep in step.inputs.items()}
    with pytest.raises(ConversionFailed) as caught:
        run_step(
            step,
            job_id="open-axes",
            spec=spec,
            source=result.source,
            input_keys=keys,
            store=shared_store,
            scratch=work / "open-axes",
        )
    error = caught.value.to_dict()
    assert error["details"]["tool"] == "onnx2tf"
    assert [a["input_shapes"] for a in error["details"]["attempts"]] == ["dynamic"]
    assert "keeps axes {'input_ids': [0], 'attention_mask': [0]} dynamic" in error["message"]
    assert "fixed `shape`" in error["hint"] and "onnxruntime or openvino" in error["hint"]
    assert error["details"]["output_tail"]  # what onnx2tf printed
    assert json.dumps(error).count("Traceback (most recent call last)") <= 1


# --------------------------------------------------------------------------- refusals and passes


def test_op_without_onnx2tf_converter_is_named(work, store, repository) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("LpPool", ["input"], ["output"], kernel_shape=[2, 2], strides=[2, 2], p=2)],
        "lp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3, 4, 4])],
    )
    src = work / "lppool.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    result = compile_model(src, _spec(["tfserving"], optimize=False), store=store, repository=repository)
    error = result.targets["tfserving"].error
    assert error["code"] == "CONVERSION_FAILED"
    assert error["message"].count("onnx2tf has no converter for LpPool") == 2  # both attempts, before onnx2tf ran
    assert [a["input_shapes"] for a in error["details"]["attempts"]] == ["dynamic", "fixed"]


def test_onnx2tf_passes_keep_outputs(transformer_onnx) -> None:
    """The graph onnx2tf receives computes what the source computes (onnxruntime runs both)."""
    import onnx
    import onnxruntime as ort

    from services.converters.onnx_to_tensorflow import _prepare

    model = onnx.load(str(transformer_onnx))
    x = np.random.default_rng(1).standard_normal((2, 16, 32)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"input": x})[0]
    for fixed in (None, {"input": [2, 16, 32]}):
        prepared, records = _prepare(model, fixed)
        ops = [n.op_type for n in prepared.graph.node]
        assert "Erf" not in ops and ops.count("Gelu") == 1
        assert all(
            not (n.op_type in ("Add", "Mul") and n.input[0] in {i.name for i in prepared.graph.initializer})
            for n in prepared.graph.node
        )
        dims = [d.dim_value or d.dim_param for d in prepared.graph.input[0].type.tensor_type.shape.dim]
        assert dims == (["batch", 16, 32] if fixed is None else [2, 16, 32])
        assert ("fix_input_shapes" in {r["name"] for r in records}) == (fixed is not None)
        got = ort.InferenceSession(prepared.SerializeToString()).run(None, {"input": x})[0]
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_convolution_reaches_tflite_and_tfserving(groups: int, tmp_path: Path, store, repository) -> None:
    # onnx2tf builds a grouped Conv as a Keras Conv2D inside a Lambda, named after the torch
    # node ("/2/Conv"): its kernel was untracked (saving failed on a captured ResourceHandle)
    # and its name no valid TensorFlow scope. groups=1 is the control that always worked.
    src = grouped_cnn_onnx(tmp_path / f"g{groups}.onnx", groups)
    spec = load_spec(
        {"targets": ["tflite", "tfserving"], "name": "g", "benchmark": False, "validation": {"samples": 4}}
    )
    result = compile_model(src, spec, store=store, repository=repository)
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        assert target.route == f"onnx → optimize → savedmodel ⇒ {name}"
        assert_parity_passed(target.parity, "fp32")
    passes = [p["name"] for p in result.steps["optimize/onnx-to-savedmodel"].meta["passes"]]
    assert "onnx2tf_scope_safe_node_names" in passes


def test_onnx2tf_leaves_the_process_its_recursion_limit(transformer_onnx: Path) -> None:
    """onnx2tf sets the recursion limit to C int's maximum on import; Kiln gives it back after.

    In a fresh interpreter, so the import is the first: a deeply nested JSON body afterwards must
    still be a RecursionError (Kiln's INVALID_SPEC), not a C stack overflow that kills the process.
    """
    import subprocess
    import sys

    script = f"""
import json, sys
import onnx
from services.converters.onnx_to_tensorflow import _ops_without_converter
before = sys.getrecursionlimit()
_ops_without_converter(onnx.load({str(transformer_onnx)!r}))
assert "onnx2tf" in sys.modules and sys.getrecursionlimit() == before, sys.getrecursionlimit()
try:
    json.loads("[" * 1_000_000 + "]" * 1_000_000)
except RecursionError:
    print("RecursionError")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip().endswith("RecursionError")
