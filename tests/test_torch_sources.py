"""PyTorch sources: TorchScript (.pt) and torch.export (.pt2) compiled through ONNX, with the
reference computed by torch; pickles refused, and smuggled payloads proven not to run.

Models are built here with random weights (a CNN, a tiny BertModel from a BertConfig);
nothing is downloaded. Parity is always against torch's own outputs on the source file.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from jobs_support import KILN_CMD

from kiln_testing.models import BERT_VOCAB, assert_parity_passed, export_again, tiny_bert_module, tiny_cnn_module
from services.errors import InvalidSpec, UnsafeInput
from services.formats import Format
from services.pipeline import compile_model
from services.runners import open_runner
from services.spec import load_spec

# --------------------------------------------------------------------------- models, once


@pytest.fixture(scope="module")
def torch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch-sources")


@pytest.fixture(scope="module")
def cnn(torch_dir: Path) -> dict[str, Path]:
    """The shared tiny CNN as a traced TorchScript, a scripted TorchScript and an ExportedProgram."""
    import torch

    model = tiny_cnn_module()
    x = torch.randn(2, 3, 32, 32)
    paths = {
        "traced": torch_dir / "cnn_traced.pt",
        "scripted": torch_dir / "cnn_scripted.pt",
        "pt2": torch_dir / "cnn.pt2",
    }
    torch.jit.trace(model, x).save(str(paths["traced"]))
    torch.jit.script(model).save(str(paths["scripted"]))
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}}), str(paths["pt2"]))
    return paths


@pytest.fixture(scope="module")
def bert(torch_dir: Path) -> dict[str, Path]:
    """A tiny BertModel (input_ids, attention_mask int64) as an ExportedProgram and a traced TorchScript."""
    import torch

    model = tiny_bert_module()
    ids = torch.randint(0, BERT_VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    batch, seq = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("seq", min=2, max=64)
    program = torch.export.export(
        model,
        (),
        kwargs={"input_ids": ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
    )
    paths = {"pt2": torch_dir / "bert.pt2", "traced": torch_dir / "bert_traced.pt"}
    torch.export.save(program, str(paths["pt2"]))
    # strict=False: BertModel returns a dict-like ModelOutput, which the traced module keeps as a dict.
    torch.jit.trace(model, (ids, mask), strict=False).save(str(paths["traced"]))
    return paths


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory):
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("torch-store"))


def _spec(targets: list[str], precision: str = "fp32", **extra):
    body = {
        "targets": targets,
        "precision": precision,
        "name": "m",
        "benchmark": False,
        # The ONNX passes are another step's subject; these tests check the torch routes.
        "optimize": False,
        "validation": {"samples": 4},
        **extra,
    }
    return load_spec(body)


def _compile(path: Path, spec, store, repository):
    return compile_model(path, spec, store=store, repository=repository)


def _onnx_dims(path: Path) -> dict[str, list[object]]:
    import onnx

    model = onnx.load(str(path))
    return {
        vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*model.graph.input, *model.graph.output]
    }


# --------------------------------------------------------------------------- CNN to onnxruntime


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_cnn_torchscript_to_onnxruntime(cnn, precision, shared_store, repository, repo_dir) -> None:
    result = _compile(cnn["traced"], _spec(["onnxruntime"], precision), shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["onnxruntime"] == "torchscript → onnx ⇒ onnxruntime"
    assert_parity_passed(target.parity, precision)
    assert target.parity["outputs"][0]["top1"] >= (1.0 if precision == "fp32" else 0.75)
    published = repo_dir / "triton" / "m" / "1" / "model.onnx"
    assert published.is_file()
    # No spec inputs: the shapes come from what the traced module recorded, batch left dynamic.
    assert _onnx_dims(published)["x"] == ["batch", 3, 32, 32]
    reference = result.steps["reference"].meta
    assert reference["signature"]["inputs"] == [{"name": "x", "dtype": "float32", "shape": [None, 3, 32, 32]}]


def test_cnn_exported_program_to_onnxruntime_all_precisions(cnn, shared_store, repository, repo_dir, tmp_path) -> None:
    result = _compile(cnn["pt2"], _spec(["onnxruntime"]), shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["onnxruntime"] == "torch_export → onnx ⇒ onnxruntime"
    assert_parity_passed(target.parity, "fp32")
    dims = _onnx_dims(repo_dir / "triton" / "m" / "1" / "model.onnx")
    assert dims["x"][1:] == [3, 32, 32] and isinstance(dims["x"][0], str)  # the program's dynamic batch
    assert dims["output"][1:] == [10]
    for precision in ("fp16", "int8"):
        meta = export_again(result, _spec(["onnxruntime"], precision), shared_store, repository)
        assert_parity_passed(meta["onnxruntime"]["parity"], precision)
        assert meta["onnxruntime"]["precision"] == precision
    assert sorted(p.name for p in (repo_dir / "triton" / "m").iterdir() if p.is_dir()) == ["1", "2", "3"]


# --------------------------------------------------------------------------- BERT


def test_bert_exported_program_to_onnxruntime_all_precisions(
    bert, shared_store, repository, repo_dir, tmp_path
) -> None:
    result = _compile(bert["pt2"], _spec(["onnxruntime"]), shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert_parity_passed(target.parity, "fp32")
    # Names follow the program: kwargs in, ModelOutput keys out (made a plain dict on load).
    assert [o["name"] for o in target.parity["outputs"]] == ["last_hidden_state", "pooler_output"]
    dims = _onnx_dims(repo_dir / "triton" / "m" / "1" / "model.onnx")
    assert set(dims) == {"input_ids", "attention_mask", "last_hidden_state", "pooler_output"}
    assert all(isinstance(d, str) for d in dims["input_ids"])  # batch and sequence stay dynamic
    signature = result.steps["reference"].meta["signature"]
    assert [(t["name"], t["dtype"], t["shape"]) for t in signature["inputs"]] == [
        ("input_ids", "int64", [None, None]),
        ("attention_mask", "int64", [None, None]),
    ]
    for precision in ("fp16", "int8"):
        meta = export_again(result, _spec(["onnxruntime"], precision), shared_store, repository)
        assert_parity_passed(meta["onnxruntime"]["parity"], precision)


def test_bert_exported_program_to_openvino_all_precisions(bert, shared_store, repository) -> None:
    result = _compile(bert["pt2"], _spec(["openvino"]), shared_store, repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["openvino"] == "torch_export → onnx → openvino_ir ⇒ openvino"
    assert_parity_passed(target.parity, "fp32")
    assert [o["name"] for o in target.parity["outputs"]] == ["last_hidden_state", "pooler_output"]
    for precision in ("fp16", "int8"):
        meta = export_again(result, _spec(["openvino"], precision), shared_store, repository)
        assert_parity_passed(meta["openvino"]["parity"], precision)


def test_bert_traced_torchscript_dict_outputs_and_dynamic_sequence(bert, shared_store, repository, repo_dir) -> None:
    profile = {"min": [1, 4], "opt": [2, 24], "max": [8, 64]}
    spec = _spec(["onnxruntime"], inputs={"input_ids": profile, "attention_mask": profile})
    result = _compile(bert["traced"], spec, shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert_parity_passed(target.parity, "fp32")
    assert [o["name"] for o in target.parity["outputs"]] == ["last_hidden_state", "pooler_output"]
    convert = result.steps["torchscript-to-onnx"].meta
    assert convert["flattened_outputs"] is True  # the traced module returns a dict
    assert convert["dynamic_axes"] == {
        "input_ids": {"0": "batch", "1": "input_ids_dim1"},
        "attention_mask": {"0": "batch", "1": "attention_mask_dim1"},
    }
    dims = _onnx_dims(repo_dir / "triton" / "m" / "1" / "model.onnx")
    assert dims["input_ids"] == ["batch", "input_ids_dim1"]
    # The reference ran torch at the spec's opt shape, not the traced one.
    ref_inputs = result.steps["reference"].meta["signature"]["inputs"]
    assert ref_inputs[0] == {"name": "input_ids", "dtype": "int64", "shape": [None, None]}
    import onnxruntime as ort

    session = ort.InferenceSession(str(repo_dir / "triton" / "m" / "1" / "model.onnx"))
    ids = np.random.default_rng(1).integers(0, BERT_VOCAB, (3, 40))
    runner = open_runner(Format.TORCHSCRIPT, bert["traced"], inputs=spec.inputs)
    expected = runner.run({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    got = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    np.testing.assert_allclose(got[0], expected["last_hidden_state"], atol=1e-4)  # a length never traced


# --------------------------------------------------------------------------- TorchScript shapes


def test_scripted_torchscript_without_shapes_asks_for_inputs(cnn, shared_store, repository) -> None:
    result = _compile(cnn["scripted"], _spec(["onnxruntime"]), shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "failed"
    assert target.error["code"] == "INVALID_SPEC"
    assert "['x']" in target.error["message"]
    assert '"inputs"' in target.error["hint"] and '"min"' in target.error["hint"]


def test_scripted_torchscript_with_spec_profile(cnn, shared_store, repository, repo_dir) -> None:
    spec = _spec(["onnxruntime"], inputs={"x": {"min": [1, 3, 16, 16], "opt": [2, 3, 32, 32], "max": [8, 3, 64, 64]}})
    result = _compile(cnn["scripted"], spec, shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert_parity_passed(target.parity, "fp32")
    assert _onnx_dims(repo_dir / "triton" / "m" / "1" / "model.onnx")["x"] == ["batch", 3, "x_dim2", "x_dim3"]
    assert result.steps["reference"].meta["signature"]["inputs"][0]["shape"] == [None, 3, None, None]


def test_spec_inputs_must_name_model_inputs(cnn) -> None:
    spec = _spec(["onnxruntime"], inputs={"image": {"shape": [1, 3, 32, 32]}})
    with pytest.raises(InvalidSpec, match=r"\['image'\].*\['x'\]"):
        open_runner(Format.TORCHSCRIPT, cnn["traced"], inputs=spec.inputs)


def test_dynamic_axes_rules() -> None:
    from services.runners.torch import dynamic_axes_of
    from services.spec import InputSpec

    assert dynamic_axes_of(None, 4) == {0}
    assert dynamic_axes_of(InputSpec(shape=[1, 3, -1, -1]), 4) == {0, 2, 3}
    assert dynamic_axes_of(InputSpec(min=[4, 8], opt=[4, 16], max=[4, 32]), 2) == {1}  # batch pinned at 4
    assert dynamic_axes_of(InputSpec(shape=[]), 0) == set()


def test_runners_match_eager_torch(cnn, bert) -> None:
    import torch

    model = tiny_cnn_module()
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        eager = model(torch.from_numpy(x)).numpy()
    for fmt, path in ((Format.TORCHSCRIPT, cnn["traced"]), (Format.TORCH_EXPORT, cnn["pt2"])):
        runner = open_runner(fmt, path)
        assert [(t.name, t.dtype, t.shape) for t in runner.inputs] == [("x", "float32", (None, 3, 32, 32))]
        assert [(t.name, t.dtype) for t in runner.outputs] == [("output", "float32")]
        np.testing.assert_allclose(runner.run({"x": x})["output"], eager, atol=1e-5)
    runner = open_runner(Format.TORCH_EXPORT, bert["pt2"])
    assert [(t.name, t.shape) for t in runner.outputs] == [
        ("last_hidden_state", (None, None, 32)),
        ("pooler_output", (None, 32)),
    ]


def test_unsupported_operator_is_conversion_failed(torch_dir, shared_store, repository) -> None:
    import torch

    class Svd(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svdvals(x)

    path = torch_dir / "svd.pt"
    torch.jit.trace(Svd(), torch.randn(2, 4, 4)).save(str(path))
    result = _compile(path, _spec(["onnxruntime"]), shared_store, repository)
    error = result.targets["onnxruntime"].error
    assert error["code"] == "CONVERSION_FAILED"
    assert "svd" in error["message"].lower()
    assert error["details"]["tool"] == "torch.onnx (TorchScript exporter)"


# --------------------------------------------------------------------------- other CPU engines


def test_cnn_torchscript_to_openvino_all_precisions(cnn, shared_store, repository, tmp_path) -> None:
    result = _compile(cnn["traced"], _spec(["openvino"]), shared_store, repository)
    target = result.targets["openvino"]
    assert target.status == "succeeded", target.error
    assert result.plan.routes["openvino"] == "torchscript → onnx → openvino_ir ⇒ openvino"
    assert_parity_passed(target.parity, "fp32")
    for precision in ("fp16", "int8"):
        meta = export_again(result, _spec(["openvino"], precision), shared_store, repository)
        assert_parity_passed(meta["openvino"]["parity"], precision)


def test_cnn_torchscript_to_tflite_and_tfserving(cnn, shared_store, repository, tmp_path) -> None:
    result = _compile(cnn["traced"], _spec(["tflite", "tfserving"]), shared_store, repository)
    for name in ("tflite", "tfserving"):
        target = result.targets[name]
        assert target.status == "succeeded", target.error
        assert result.plan.routes[name] == f"torchscript → onnx → savedmodel ⇒ {name}"
        assert_parity_passed(target.parity, "fp32")
    assert "torchscript-to-onnx/onnx-to-savedmodel" in result.plan.shared  # converted once for both
    meta = export_again(result, _spec(["tflite", "tfserving"], "fp16"), shared_store, repository)
    assert_parity_passed(meta["tflite"]["parity"], "fp16")
    assert_parity_passed(meta["tfserving"]["parity"], "fp16")
    meta = export_again(result, _spec(["tflite", "tfserving"], "int8"), shared_store, repository)
    assert_parity_passed(meta["tflite"]["parity"], "int8")
    assert_parity_passed(meta["tfserving"]["parity"], "int8")


def test_spec_opset_reaches_the_exported_onnx(cnn, shared_store, repository, repo_dir) -> None:
    import onnx

    from services.converters.torch_to_onnx import DEFAULT_OPSET

    def published_opset() -> int:
        model = onnx.load(str(repo_dir / "triton" / "m" / "1" / "model.onnx"), load_external_data=False)
        return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))

    wanted = 16 if DEFAULT_OPSET != 16 else 15
    result = _compile(cnn["traced"], _spec(["onnxruntime"], opset=wanted), shared_store, repository)
    assert result.targets["onnxruntime"].status == "succeeded", result.targets["onnxruntime"].error
    assert published_opset() == wanted
    shutil.rmtree(repo_dir / "triton" / "m")
    result = _compile(cnn["traced"], _spec(["onnxruntime"]), shared_store, repository)
    assert result.targets["onnxruntime"].status == "succeeded", result.targets["onnxruntime"].error
    assert published_opset() == DEFAULT_OPSET


def test_cnn_exported_program_to_the_other_cpu_engines(cnn, shared_store, repository) -> None:
    # The .pt2 route into ONNX is torch's dynamo exporter; from there the same edges as TorchScript.
    targets = ["openvino", "tflite", "tfserving"]
    result = _compile(cnn["pt2"], _spec(targets), shared_store, repository)
    for name in targets:
        target = result.targets[name]
        assert target.status == "succeeded", target.error
        assert result.plan.routes[name].startswith("torch_export → onnx → "), result.plan.routes[name]
        assert_parity_passed(target.parity, "fp32")


# --------------------------------------------------------------------------- pickles refused


class _Payload:
    """Unpickling this creates ``marker``: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickled_model(path: Path, marker: Path, *, zipped: bool = True) -> Path:
    import torch

    model = tiny_cnn_module().features  # an nn.Sequential: every class in it is importable
    model.payload = _Payload(marker)  # rides along in the pickled module's __dict__
    torch.save(model, str(path), _use_new_zipfile_serialization=zipped)
    return path


def _assert_live(path: Path, marker: Path, load: Callable[[Path], object]) -> None:
    """Prove the payload is real: loading ``path`` the unsafe way creates ``marker``."""
    assert not marker.exists()
    try:
        load(path)
    except Exception:
        pass  # several payloads break the load after they ran; the marker is what counts
    assert marker.exists(), "the payload did not run under the unsafe loader, so the test proves nothing"
    marker.unlink()


@pytest.mark.parametrize("zipped", [True, False], ids=["torch.save zip", "legacy raw pickle"])
def test_pickled_torch_model_refused_and_payload_not_run(zipped, tmp_path, shared_store, repository) -> None:
    import torch

    marker = tmp_path / "payload-ran"
    model_path = _pickled_model(tmp_path / "model.pt", marker, zipped=zipped)
    _assert_live(model_path, marker, lambda p: torch.load(p, weights_only=False))

    with pytest.raises(UnsafeInput) as err:
        _compile(model_path, _spec(["onnxruntime"]), shared_store, repository)
    assert err.value.code == "UNSAFE_INPUT"
    assert "torch.export" in err.value.hint and "torch.jit" in err.value.hint
    assert not marker.exists()

    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [*KILN_CMD, "compile", str(model_path), "-t", "onnxruntime", "--repo", str(tmp_path / "repo"),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "UNSAFE_INPUT" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


# --------------------------------------------------------------------------- smuggling attempts


def _rewrite(
    src: Path, dst: Path, edit: Callable[[str, bytes], bytes | None], add: dict[str, bytes] | None = None
) -> Path:
    """Copy a zip archive member by member through ``edit(relative name, bytes)``; add members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            body = edit(info.filename.split("/", 1)[1], zin.read(info.filename))
            if body is not None:
                zout.writestr(info.filename, body)
        for name, body in (add or {}).items():
            zout.writestr(f"{root}/{name}", body)
    return dst


def _torch_saved(obj: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _edit_json(member: str, change: Callable[[dict], None]) -> Callable[[str, bytes], bytes | None]:
    def edit(name: str, body: bytes) -> bytes:
        if name != member:
            return body
        doc = json.loads(body)
        change(doc)
        return json.dumps(doc).encode()

    return edit


def _sample_inputs(marker: Path):
    return lambda name, body: _torch_saved(((_Payload(marker),), {})) if name == "data/sample_inputs/model.pt" else body


def _sympy_expression(marker: Path):
    symbol = b"Symbol('s77', positive=True, integer=True)"
    evil = f"__import__('pathlib').Path({str(marker)!r}).touch() or ".encode() + symbol

    def edit(name: str, body: bytes) -> bytes:
        if name != "models/model.json":
            return body
        assert symbol in body, "the CNN program should carry its dynamic batch symbol"
        return body.replace(symbol, evil, 1)

    return edit


def _guards(marker: Path):
    return _edit_json(
        "models/model.json", lambda d: d.__setitem__("guards_code", [f"open({str(marker)!r}, 'w') is not None"])
    )


def _opaque_constant(marker: Path):
    entry = {"evil": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}
    return _edit_json("data/constants/model_constants_config.json", lambda d: d["config"].update(entry))


def _pickled_weight(marker: Path):
    def edit(name: str, body: bytes) -> bytes:
        if name == "data/weights/weight_0":
            return _torch_saved(_Payload(marker))
        if name == "data/weights/model_weights_config.json":
            doc = json.loads(body)
            first = next(m for m in doc["config"].values() if m["path_name"] == "weight_0")
            first["use_pickle"] = True
            return json.dumps(doc).encode()
        return body

    return edit


def _stock_load_and_call(path: Path) -> None:
    import torch

    program = torch.export.load(str(path))
    program.module()(torch.randn(2, 3, 32, 32))


# (id, how the .pt2 is edited, extra members, is the payload live under stock torch.export.load,
#  what Kiln does: "UNSAFE_INPUT", or "succeeded" when the dangerous part is stripped instead)
PT2_ATTEMPTS = [
    ("pickled sample inputs", _sample_inputs, lambda m: {}, True, "UNSAFE_INPUT"),
    ("sympy expression", _sympy_expression, lambda m: {}, True, "UNSAFE_INPUT"),
    ("guards code", _guards, lambda m: {}, True, "succeeded"),  # guards are dropped, never exec'd
    (
        "opaque constant",
        _opaque_constant,
        lambda m: {"data/constants/opaque_obj_0": pickle.dumps(_Payload(m))},
        True,
        "UNSAFE_INPUT",
    ),
    ("pickled weight", _pickled_weight, lambda m: {}, True, "UNSAFE_INPUT"),
    (
        "AOTInductor library",
        lambda m: lambda n, b: b,
        lambda m: {"data/aotinductor/model/model.so": b"\x7fELF"},
        False,
        "UNSAFE_INPUT",
    ),
]


@pytest.mark.parametrize(
    ("edit", "add", "live", "outcome"), [a[1:] for a in PT2_ATTEMPTS], ids=[a[0] for a in PT2_ATTEMPTS]
)
def test_pt2_smuggled_payload_refused_and_not_run(
    cnn, edit, add, live, outcome, tmp_path, shared_store, repository
) -> None:
    marker = tmp_path / "payload-ran"
    evil = _rewrite(cnn["pt2"], tmp_path / "evil.pt2", edit(marker), add(marker))
    if live:  # torch 2.13's own loader runs it: this is what Kiln must not do
        _assert_live(evil, marker, _stock_load_and_call)
    result = _compile(evil, _spec(["onnxruntime"]), shared_store, repository)
    target = result.targets["onnxruntime"]
    if outcome == "succeeded":
        assert target.status == "succeeded", target.error  # ran in torch and onnxruntime, guards gone
    else:
        assert target.error is not None and target.error["code"] == outcome, target.error
        assert result.steps.get("reference") is None  # refused before torch ran anything
    assert not marker.exists()


def test_torch_save_dressed_as_pt2_refused(tmp_path, shared_store, repository) -> None:
    marker = tmp_path / "payload-ran"
    pickled = _pickled_model(tmp_path / "model.pt", marker)
    disguised = _rewrite(pickled, tmp_path / "disguised.pt2", lambda n, b: b, {"models/model.json": b"{}"})
    result = _compile(disguised, _spec(["onnxruntime"]), shared_store, repository)
    assert result.source.format is Format.TORCH_EXPORT  # detection was fooled; the loader is not
    assert result.targets["onnxruntime"].error["code"] == "UNSAFE_INPUT"
    assert not marker.exists()


@pytest.mark.parametrize("member", ["data.pkl", "traced_inputs.pkl"])
def test_torchscript_smuggled_pickle_refused_and_not_run(cnn, member, tmp_path, shared_store, repository) -> None:
    import torch

    marker = tmp_path / "payload-ran"
    evil_pickle = pickle.dumps(_Payload(marker), protocol=2)
    evil = _rewrite(cnn["traced"], tmp_path / "evil.pt", lambda n, b: evil_pickle if n == member else b)
    if member == "data.pkl":
        with pytest.raises(Exception):  # noqa: B017 - torch's own TorchScript unpickler refuses it too
            torch.jit.load(str(evil))
        assert not marker.exists()
    result = _compile(evil, _spec(["onnxruntime"]), shared_store, repository)
    assert result.source.format is Format.TORCHSCRIPT
    error = result.targets["onnxruntime"].error
    assert error["code"] == "UNSAFE_INPUT", error
    assert f"{member} imports io.open" in error["message"]
    assert not marker.exists()


@pytest.mark.parametrize(
    "expr",
    [
        "Symbol('s77', positive=True, integer=True)",
        "Mul(Integer(2), Symbol('s0', integer=True, positive=True))",
        "FloorDiv(Add(Symbol('s1', positive=True, integer=True), Integer(-1)), Integer(2))",
        "Max(Integer(1), Symbol('u0', integer=True))",
    ],
)
def test_sympy_expressions_torch_writes_are_accepted(expr: str) -> None:
    from services.runners.torch_archives import _check_sympy_expr

    _check_sympy_expr(expr)


@pytest.mark.parametrize(
    "expr",
    [
        "open('x', 'w')",
        "Symbol('s0').subs",
        "Symbol('s0')[0]",
        "(lambda: 0)()",
        "Symbol('__class__')",
        "Symbol('a b; import os')",
        "exec('1')",
        "[x for x in ()]",
    ],
)
def test_sympy_expressions_that_could_run_code_are_refused(expr: str) -> None:
    from services.runners.torch_archives import _check_sympy_expr

    with pytest.raises(UnsafeInput):
        _check_sympy_expr(expr)


def test_pt2_enum_import_in_pytree_context_refused(cnn, tmp_path) -> None:
    def change(doc: dict) -> None:
        sig = doc["graph_module"]["module_call_graph"][0]["signature"]
        protocol, spec = json.loads(sig["in_spec"])
        spec["context"] = json.dumps([{"__enum__": True, "fqn": "antigravity:x", "name": "y"}])
        sig["in_spec"] = json.dumps([protocol, spec])

    evil = _rewrite(cnn["pt2"], tmp_path / "enum.pt2", _edit_json("models/model.json", change))
    with pytest.raises(UnsafeInput, match="__enum__"):
        open_runner(Format.TORCH_EXPORT, evil)
    assert "antigravity" not in sys.modules


def test_pt2_graph_calling_a_python_function_refused(cnn, tmp_path) -> None:
    # A node whose target resolves, through torch's attribute chain, to os.system.
    def change(doc: dict) -> None:
        node = next(n for n in doc["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.aten.relu.default")
        node["target"] = "torch.serialization.os.system"

    evil = _rewrite(cnn["pt2"], tmp_path / "call.pt2", _edit_json("models/model.json", change))
    with pytest.raises(UnsafeInput, match="system"):  # torch's verifier, then ours, before anything runs
        open_runner(Format.TORCH_EXPORT, evil)


def test_pt2_string_input_cannot_inject_guard_code(torch_dir, tmp_path, shared_store, repository) -> None:
    """torch pastes a string input's value, unescaped, into the guard code it exec()s."""
    import torch

    class Mode(torch.nn.Module):
        def forward(self, x, mode: str):
            return x * 2 if mode == "double" else x

    plain = torch_dir / "mode.pt2"
    torch.export.save(torch.export.export(Mode(), (torch.randn(2), "double")), str(plain))
    runner = open_runner(Format.TORCH_EXPORT, plain)  # a plain string input is fine
    np.testing.assert_array_equal(runner.run({"x": np.ones(2, np.float32)})["output"], [2.0, 2.0])

    marker = tmp_path / "payload-ran"
    payload = f"double' or open({str(marker)!r}, 'w') or '"
    quoted = json.dumps({"as_string": payload})[1:-1].encode()
    evil = _rewrite(plain, tmp_path / "evil.pt2", lambda n, b: b.replace(b'"as_string": "double"', quoted))
    _assert_live(evil, marker, lambda p: torch.export.load(str(p)).module()(torch.ones(2), payload))
    result = _compile(evil, _spec(["onnxruntime"]), shared_store, repository)
    assert result.targets["onnxruntime"].error["code"] == "UNSAFE_INPUT"
    assert not marker.exists()


def test_pt2_shapes_outside_the_programs_ranges_are_invalid_spec(cnn, shared_store, repository) -> None:
    spec = _spec(["onnxruntime"], inputs={"x": {"shape": [100, 3, 32, 32]}})  # exported with batch <= 64
    error = _compile(cnn["pt2"], spec, shared_store, repository).targets["onnxruntime"].error
    assert error["code"] == "INVALID_SPEC"
    assert "<= 64" in error["message"]


@pytest.mark.parametrize(
    ("module", "name", "allowed"),
    [
        ("__torch__.models", "TinyCNN", True),
        ("torch._utils", "_rebuild_tensor_v2", True),
        ("torch", "FloatStorage", True),
        ("torch", "per_tensor_affine", True),
        ("torch.jit._pickle", "restore_type_tag", True),
        ("collections", "OrderedDict", True),
        ("torch", "load", False),
        ("torch.serialization", "os", False),
        ("builtins", "eval", False),
        ("io", "open", False),
    ],
)
def test_torchscript_pickle_global_allowlist(module: str, name: str, allowed: bool) -> None:
    from services.runners.torch_archives import _torchscript_global

    assert _torchscript_global(module, name) is allowed


_SCALED_SOURCE = """
from typing import Optional

import torch


class Scaled(torch.nn.Module):
    def forward(self, x, mask: Optional[torch.Tensor] = None, scale: float = 2.0):
        y = x * scale
        return y if mask is None else y * mask
"""


def test_torchscript_defaulted_arguments_keep_defaults_unless_named(torch_dir) -> None:
    import importlib.util

    import torch

    source = torch_dir / "scaled_module.py"  # TorchScript compiles from source files
    source.write_text(_SCALED_SOURCE)
    spec_ = importlib.util.spec_from_file_location("scaled_module", source)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    path = torch_dir / "scaled.pt"
    torch.jit.script(module.Scaled()).save(str(path))
    ones = np.ones((2, 4), np.float32)

    runner = open_runner(
        Format.TORCHSCRIPT, path, inputs=_spec(["onnxruntime"], inputs={"x": {"shape": [2, 4]}}).inputs
    )
    assert [t.name for t in runner.inputs] == ["x"]  # mask and scale keep their defaults
    np.testing.assert_array_equal(runner.run({"x": ones})["output"], 2 * ones)

    both = {"x": {"shape": [2, 4]}, "mask": {"shape": [2, 4]}}
    runner = open_runner(Format.TORCHSCRIPT, path, inputs=_spec(["onnxruntime"], inputs=both).inputs)
    assert [t.name for t in runner.inputs] == ["x", "mask"]
    np.testing.assert_array_equal(runner.run({"x": ones, "mask": 0 * ones})["output"], 0 * ones)

    with pytest.raises(InvalidSpec, match="scale: float"):
        open_runner(
            Format.TORCHSCRIPT, path, inputs=_spec(["onnxruntime"], inputs={**both, "scale": {"shape": []}}).inputs
        )


@pytest.mark.parametrize(("model", "kind"), [("cnn", "pt2"), ("bert", "traced")])
def test_torch_onnx_goes_through_the_onnx_optimizer(model, kind, cnn, bert, shared_store, repository) -> None:
    source = {"cnn": cnn, "bert": bert}[model][kind]
    spec = _spec(["onnxruntime"], optimize=True)
    result = _compile(source, spec, shared_store, repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert target.route.endswith("→ onnx → optimize ⇒ onnxruntime")
    assert_parity_passed(target.parity, "fp32")
