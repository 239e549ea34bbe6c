"""onnxruntime-only transformer fusions (services/passes/ort_fusions.py) through the onnxruntime target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from kiln_testing.models import tiny_cnn_onnx
from services.passes.ort_fusions import drop_value_info, fuse_for_onnxruntime, has_skip_layernorm_pattern
from services.pipeline import compile_model
from services.spec import load_spec

SEQ = 16


def _tiny_bert_dynamo(path: Path) -> Path:
    """transformers' BertModel (2 layers, hidden 64, 4 heads) with random weights and biases, dynamo-exported."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    bert = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # trained models have non-zero biases; transformers initialises them to 0
        for name, p in bert.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.1, 0.1)

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, 100, (2, SEQ))
    batch, seq = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("sequence", min=2, max=64)
    program = torch.onnx.export(
        LastHidden().eval(),
        (ids, torch.ones_like(ids)),
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
        dynamo=True,
        optimize=False,
        verbose=False,
    )
    program.save(str(path))
    return path


@pytest.fixture(scope="module")
def bert_dynamo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_bert_dynamo(tmp_path_factory.mktemp("bert") / "bert.onnx")


def _compile(model: Path, store, repository, precision: str):  # type: ignore[no-untyped-def]
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "precision": precision,
            "name": "m",
            "benchmark": {"batch_sizes": [1], "iterations": 3, "warmup": 1},
        }
    )
    return compile_model(model, spec, store=store, repository=repository)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bert_artifact_has_fused_attention_and_passes_parity(
    bert_dynamo: Path, precision: str, store, repository, repo_dir: Path
) -> None:
    result = _compile(bert_dynamo, store, repository, precision)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"] is True
    version_dir = repo_dir / "triton" / "m" / "1"
    manifest = json.loads((version_dir / "kiln-manifest.json").read_text())
    fusions = manifest["engine_details"]["ort_fusions"]
    assert fusions["fusions"] == {"sdpa": 2, "mha": 2, "mha_bias": 2, "bias_gelu": 2}, fusions
    assert "skip_layer_normalization" in fusions["left_out"]
    artifact = onnx.load(str(version_dir / "model.onnx"))
    ops = [n.op_type for n in artifact.graph.node]
    if fusions["applied"]:  # kept only when it timed faster than the unfused model on this machine
        assert fusions["nodes_after"] < fusions["nodes_before"]
        assert ops.count("MultiHeadAttention") == 2, sorted(set(ops))
        assert ops.count("BiasGelu") == 2 and "SkipLayerNormalization" not in ops
        assert not artifact.graph.value_info  # what would let onnxruntime fuse SkipLayerNormalization at load
    else:
        assert fusions["timing"]["ratio"] >= 1.0 and "MultiHeadAttention" not in ops


def test_fusions_reach_contrib_ops_and_keep_outputs(bert_dynamo: Path) -> None:
    from services.passes import optimize_model
    from services.passes.verify import ort_session

    model, _ = optimize_model(onnx.load(str(bert_dynamo)))
    rng = np.random.default_rng(0)
    feeds = [
        {"input_ids": rng.integers(0, 100, (b, SEQ)).astype(np.int64), "attention_mask": np.ones((b, SEQ), np.int64)}
        for b in (1, 3)
    ]
    fused, report = fuse_for_onnxruntime(model, feeds, timed=False)
    assert report["applied"] and report["value_info_dropped"] > 0
    ops = [n.op_type for n in fused.graph.node]
    # Scaled dot-product attention → MultiHeadAttention with the Q/K/V bias Adds folded in.
    assert report["fusions"] == {"sdpa": 2, "mha": 2, "mha_bias": 2, "bias_gelu": 2}, report
    assert ops.count("MultiHeadAttention") == 2 and ops.count("BiasGelu") == 2, report
    assert len(fused.graph.node) < len(model.graph.node) and not fused.graph.value_info
    a, b = ort_session(model), ort_session(fused)
    for feed in feeds:
        np.testing.assert_allclose(b.run(None, feed)[0], a.run(None, feed)[0], rtol=1e-4, atol=1e-5)


def test_cnn_graph_unchanged(tmp_path: Path, store, repository, repo_dir: Path) -> None:
    cnn = tiny_cnn_onnx(tmp_path / "cnn.onnx")
    model = onnx.load(str(cnn))
    assert not has_skip_layernorm_pattern(model)
    feeds = [{"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)}]
    same, report = fuse_for_onnxruntime(model, feeds)
    assert same is model and report["applied"] is False and report["reason"] == "nothing to fuse"

    result = _compile_cnn(cnn, store, repository)
    assert result.targets["onnxruntime"].status == "succeeded"
    version_dir = repo_dir / "triton" / "cnn" / "1"
    manifest = json.loads((version_dir / "kiln-manifest.json").read_text())
    assert manifest["engine_details"]["ort_fusions"]["applied"] is False
    from services.passes import optimize_model

    optimize_input = model if manifest["speed_guard"].get("kept") == "source" else optimize_model(model)[0]
    artifact = onnx.load(str(version_dir / "model.onnx"))

    def nodes(m: onnx.ModelProto) -> list[tuple[str, list[str], list[str]]]:
        return [(n.op_type, list(n.input), list(n.output)) for n in m.graph.node]

    assert nodes(artifact) == nodes(optimize_input)  # the optimize step's graph, node for node
    assert len(artifact.graph.value_info) == len(optimize_input.graph.value_info)


def _compile_cnn(model: Path, store, repository):  # type: ignore[no-untyped-def]
    spec = load_spec({"targets": ["onnxruntime"], "name": "cnn", "benchmark": {"batch_sizes": [1], "iterations": 3}})
    return compile_model(model, spec, store=store, repository=repository)


def test_drop_value_info_counts_subgraphs() -> None:
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "body",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        value_info=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["a", "b"], ["s"]),
            helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"]),
            helper.make_node("If", ["c"], ["o"], then_branch=body, else_branch=body),
        ],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "b", "g")],
        [helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])],
        value_info=[helper.make_tensor_value_info("s", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph)
    assert has_skip_layernorm_pattern(model)
    assert drop_value_info(model) == 3 and not model.graph.value_info


def test_gpt2_attention_fused_without_breaking_its_gemm(tmp_path: Path) -> None:
    """onnxscript's MHA rule would replace GPT-2's (B*S, D) Reshape before the Gemm with a 3-D value."""
    import torch
    from transformers import GPT2Config, GPT2Model

    from services.passes import optimize_model
    from services.passes.ort_fusions import apply_fusions
    from services.passes.speed import timing_session
    from services.passes.verify import ort_session

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)
    gpt2 = GPT2Model(config).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids):  # type: ignore[no-untyped-def]
            return self.gpt2(input_ids=input_ids, use_cache=False).last_hidden_state

    ids = torch.randint(0, 100, (2, SEQ))
    dims = {0: torch.export.Dim("batch", min=1, max=32), 1: torch.export.Dim("sequence", min=2, max=64)}
    program = torch.onnx.export(
        LastHidden().eval(), (ids,), input_names=["input_ids"], dynamic_shapes=(dims,), dynamo=True, optimize=False
    )
    path = tmp_path / "gpt2.onnx"
    program.save(str(path))
    model, _ = optimize_model(onnx.load(str(path)))
    fused, counts = apply_fusions(model)
    assert counts["sdpa"] == 2 and counts["mha"] == 0 and counts["sdpa_via_mha"] == 2, counts
    assert [n.op_type for n in fused.graph.node].count("MultiHeadAttention") == 2
    feed = {"input_ids": np.random.default_rng(0).integers(0, 100, (3, SEQ)).astype(np.int64)}
    expected = ort_session(model).run(None, feed)[0]
    # As served (onnxruntime's own rewrites on), where the broken graph failed in the Gemm.
    np.testing.assert_allclose(timing_session(fused).run(None, feed)[0], expected, rtol=1e-4, atol=1e-5)
