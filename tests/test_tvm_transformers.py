"""The tvm target on transformers as users export them: shapes kept open where Relax can, pinned where not.

Each library is checked again outside Kiln's parity code: loaded by TVM's own Relax VM from
the published folder and run against onnxruntime on the source ONNX, at a shape parity used
and, where the library kept its axes open, at one it never saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm", reason="the tvm extra is not installed (pip install -c constraints.txt -e '.[tvm]')")

from services.pipeline import compile_model
from services.spec import load_spec

VOCAB = 50


def _bert_input_ids_only(path: Path) -> Path:
    """transformers' BertModel called with input_ids alone, exported by torch.onnx (TorchScript, opset 17).

    Its token-type ids are a buffer sliced and ``expand``-ed to the input's shape: the Expand
    whose shape operand TVM's importer took for a runtime value.
    """
    import torch
    import transformers as tr

    torch.manual_seed(0)
    config = tr.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    bert = tr.BertModel(config, add_pooling_layer=False).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids).last_hidden_state  # type: ignore[no-any-return]

    torch.onnx.export(
        Encoder().eval(),
        (torch.randint(0, VOCAB, (2, 16)),),
        str(path),
        input_names=["input_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}},
        opset_version=17,
        dynamo=False,
    )
    return path


def _run_published(version: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run the published library with TVM's own runtime, as its README says (not Kiln's runner)."""
    import tvm
    from tvm import relax

    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(version / "model.so")), dev)
    params = tvm.runtime.load_param_dict((version / "params.bin").read_bytes())
    weights = [tvm.runtime.tensor(params[f"p{i}"].numpy(), dev) for i in range(len(params))]
    io = json.loads((version / "io.json").read_text())
    args = [tvm.runtime.tensor(feeds[t["name"]], dev) for t in io["inputs"]]
    out = vm["main"](*args, *weights)
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


def _ort(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)  # type: ignore[no-any-return]


def test_bert_encoder_from_torch_onnx_compiles_with_the_input_shape_given(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    """Issue 30: `inputs.input_ids.shape = [4, 64]` given, the BERT encoder compiles, and keeps its open axes."""
    model = _bert_input_ids_only(tmp_path / "bert.onnx")
    spec = load_spec(
        {
            "targets": ["tvm"],
            "name": "bert",
            "benchmark": False,
            "validation": {"samples": 2},
            "inputs": {"input_ids": {"shape": [4, 64]}},
        }
    )
    target = compile_model(model, spec, store=store, repository=repository).targets["tvm"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"] is True and target.parity["shapes"][0] == {"input_ids": [4, 64]}
    version = repo_dir / "tvm" / "bert" / "1"
    io = json.loads((version / "io.json").read_text())
    assert io["inputs"][0]["shape"] == [None, None]  # Relax kept batch and sequence open
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    assert "built_for" not in manifest["engine_details"]
    rng = np.random.default_rng(5)
    for shape in ((4, 64), (3, 23)):  # the given shape, and one parity never fed
        feeds = {"input_ids": rng.integers(0, VOCAB, shape).astype(np.int64)}
        (got,) = _run_published(version, feeds)
        (want,) = _ort(model, feeds)
        assert got.shape == want.shape == (*shape, 32)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _matmul_gelu_onnx(path: Path) -> Path:
    """A static [1, 8, 16] x [16, 16] MatMul, bias and Relu: two kernels, so a two-trial budget covers them."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    weight = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, "w")
    bias = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) * 0.1, "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["biased"]),
            helper.make_node("Relu", ["biased"], ["y"]),
        ],
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [weight, bias],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_second_job_reuses_the_tuning_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A static model is tuned by default; kernels tuned by one job are stored by content, and the next job
    meeting them takes their schedules, tuning none."""
    from services.repository import LocalModelRepository
    from services.storage import LocalArtifactStore

    database = tmp_path / "tuning"
    monkeypatch.setenv("KILN_TVM_TUNING_DIR", str(database))
    model = _matmul_gelu_onnx(tmp_path / "block.onnx")
    tunings = []
    for job, budget in (("first", "2"), ("second", "2"), ("third", "8")):  # separate artifact stores: each export runs
        monkeypatch.setenv("KILN_TVM_DEFAULT_TRIALS", budget)  # the default budget, kept tiny here (conftest: 0)
        spec = load_spec({"targets": ["tvm"], "name": job, "benchmark": False})  # no tuning_trials: the default
        store = LocalArtifactStore(tmp_path / f"store-{job}")
        repo = LocalModelRepository(tmp_path / "repo")
        target = compile_model(model, spec, store=store, repository=repo).targets["tvm"]
        assert target.status == "succeeded", target.error
        manifest = json.loads((tmp_path / "repo" / "tvm" / job / "1" / "kiln-manifest.json").read_text())
        tunings.append(manifest["engine_details"]["tuning"])
        assert not any(w.startswith("untuned") for w in manifest["warnings"])
    first, second, third = tunings
    assert first["trials"] == second["trials"] == 2 and third["trials"] == 8
    assert first["reused"] == 0 and first["tuned"] == first["tasks"] >= 1 and first["stored"] >= 1
    kernels = [p for p in database.iterdir() if p.is_dir()]
    assert len(kernels) == first["stored"]
    assert second["reused"] == first["stored"] and second["records"] == 0  # nothing measured again
    assert second["scheduled_kernels"] >= second["reused"]  # the stored schedules are the library's
    # A larger budget per kernel than any stored entry's tunes again and adds its entry beside the first.
    assert third["reused"] == 0 and third["records"] >= 1 and third["stored"] == first["stored"]
    entries = sorted(e.name.split("-")[0] for k in kernels for e in k.iterdir() if not e.name.startswith("."))
    assert entries.count("t2") == len(kernels) and len(entries) == 2 * len(kernels)
    assert all((e / "records.json").stat().st_size > 0 for k in kernels for e in k.iterdir())


def _slice_pad_reshape_onnx(path: Path) -> Path:
    """basic-pitch's first four nodes at a 64-sample window (tf2onnx): TVM builds them at an open batch, and the
    library then fails when run (``std::bad_alloc``: the full-range Slice leaves ``min(2147483647, batch)`` in the
    memory plan)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def ints(name: str, values: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["audio", "flat"], ["mono"]),
            helper.make_node("Slice", ["mono", "starts", "ends", "axes"], ["sliced"]),
            helper.make_node("Pad", ["sliced", "pads"], ["padded"], mode="reflect"),
            helper.make_node("Reshape", ["padded", "frames"], ["out"]),
        ],
        "basic_pitch_head",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 64, 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 72, 1])],
        [
            ints("flat", [-1, 1, 64]),
            ints("starts", [0, 0, 0]),
            ints("ends", [2147483647] * 3),
            ints("axes", [0, 1, 2]),
            ints("pads", [0, 0, 4, 0, 0, 4]),
            ints("frames", [-1, 72, 1]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_library_that_fails_when_run_is_rebuilt_at_the_parity_shape(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    """Issue 30: built at open axes, the library dies at run time; it is rebuilt at a fixed shape, said so, and runs."""
    model = _slice_pad_reshape_onnx(tmp_path / "head.onnx")
    spec = load_spec({"targets": ["tvm"], "name": "head", "benchmark": False, "validation": {"samples": 2}})
    target = compile_model(model, spec, store=store, repository=repository).targets["tvm"]
    assert target.status == "succeeded", target.error
    version = repo_dir / "tvm" / "head" / "1"
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    built_for = manifest["engine_details"]["built_for"]
    assert built_for["shapes"] == {"audio": [1, 64, 1]} and built_for["chosen_by"] == "the parity inputs' shape"
    assert "std::bad_alloc" in built_for["why"]
    assert any(
        "built for fixed shapes (audio [1, 64, 1]" in w and "inputs.<name>.shape" in w for w in manifest["warnings"]
    )
    assert json.loads((version / "io.json").read_text())["inputs"][0]["shape"] == [1, 64, 1]
    feeds = {"audio": np.random.default_rng(2).standard_normal((1, 64, 1)).astype(np.float32)}
    (got,) = _run_published(version, feeds)
    (want,) = _ort(model, feeds)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_pinning_folds_the_bert_encoders_shape_arithmetic(tmp_path: Path) -> None:
    """Issue 30: pinned at [4, 64], the token-type slice (GatherElements over a buffer) folds, and the graph agrees."""
    import onnx

    from services.passes.pinned_shapes import pin_input_shapes

    model = _bert_input_ids_only(tmp_path / "bert.onnx")
    pinned, _ = pin_input_shapes(onnx.load(str(model)), {"input_ids": [4, 64]})
    ops = {n.op_type for n in pinned.graph.node}
    assert not ops & {"GatherElements", "Expand", "Where", "Shape", "ConstantOfShape"}, ops
    onnx.save(pinned, str(tmp_path / "pinned.onnx"))
    feeds = {"input_ids": np.random.default_rng(8).integers(0, VOCAB, (4, 64)).astype(np.int64)}
    (got,) = _ort(tmp_path / "pinned.onnx", feeds)
    (want,) = _ort(model, feeds)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gather_elements_folds_like_onnxruntime() -> None:
    """Kiln's folder evaluates GatherElements with numpy where onnx.reference fails (fewer indices than data)."""
    from onnx import TensorProto, helper

    from services.passes.folding import _gather_elements

    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, 7, 5)).astype(np.float32)
    indices = rng.integers(-7, 7, (2, 4, 3)).astype(np.int64)  # shorter than data off the axis, negatives too
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["d", "i"], ["o"], axis=1)],
        "g",
        [
            helper.make_tensor_value_info("d", TensorProto.FLOAT, [3, 7, 5]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 4, 3]),
        ],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 4, 3])],
    )
    import onnxruntime as ort

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"d": data, "i": indices}
    )
    np.testing.assert_array_equal(_gather_elements(data, indices, axis=1), want)
