"""Rewrites for the onnxruntime target only: transformer fusions into onnxruntime's contrib ops.

The default pipeline writes plain ONNX every target can read. An onnxruntime artifact may
also use onnxruntime's ``com.microsoft`` operators, and two things make it faster
(benchmarks/bench_ort_fusions.py, docs/benchmarks.md "Transformer fusions"):

- **No SkipLayerNormalization.** onnxruntime fuses a residual Add and LayerNormalization
  into SkipLayerNormalization at load whenever it knows both Add inputs have the same 3-D
  shape; on CPU that kernel is a scalar loop 5-8x slower than the two ops (issue 12). The
  shapes it needs are the ``value_info`` a graph declares, and torch's dynamo exporter
  declares every intermediate shape; the default pipeline keeps what a source declares. So
  for this target every ``value_info`` goes when the graph has an Add feeding a
  LayerNormalization (it is optional metadata; onnxruntime infers what it needs).
  onnxscript's own skip_layer_normalization fusion is left out for the same reason.
- **onnxscript's attention and Gelu fusions** (``onnxscript.rewriter.ort_fusions``), which
  match torch dynamo exports: scaled dot-product attention → MultiHeadAttention, its Q/K/V
  bias Adds folded in, the three projections packed into one Attention, and Add + Gelu →
  BiasGelu. Its MultiHeadAttention rule is used with one more check (``_checked_mha_rules``).

Each result is run against its input on the given feeds (a fusion that changes outputs is
dropped), and timed against it as onnxruntime serves it: the input is kept unless the
rewritten model is faster (the speed guard's rule, ``services/passes/speed.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from services.passes import speed
from services.passes._base import quiet_logger
from services.passes.pipeline import _graphs
from services.passes.verify import OutputCheck

__all__ = [
    "FUSIONS",
    "LEFT_OUT",
    "apply_fusions",
    "drop_value_info",
    "fuse_for_onnxruntime",
    "has_skip_layernorm_pattern",
]

#: onnxscript fusions applied, in order (later ones consume what earlier ones made).
FUSIONS = ("sdpa", "mha", "mha_scale", "mha_bias", "attention", "sdpa_via_mha", "gelu", "bias_gelu")
#: onnxscript fusions deliberately not applied, and why.
LEFT_OUT = {
    "skip_layer_normalization": "SkipLayerNormalization's CPU kernel runs 5-8x slower than Add + LayerNormalization",
}


def _checked_mha_rules() -> Any:
    """Return onnxscript's MultiHeadAttention rules, made to refuse a match whose output is not (B, S, D).

    onnxscript 0.7.2 does not check the Reshape after attention ("TODO: verify Reshapes"):
    on GPT-2's dynamo export that Reshape flattens to (B*S, D) for the Gemm of the output
    projection, and the rule replaced it with the 3-D attention output, which the Gemm rejects.
    """
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions import mha

    class CheckedMultiHeadAttention(mha.MultiHeadAttention):  # type: ignore[misc]
        def check(self, op: Any, **bindings: Any) -> Any:  # type: ignore[override]
            result = super().check(op, **bindings)
            if not result:
                return result
            out, query = bindings.get("attention_reshaped"), bindings.get("query_BSD")
            if out is None or out.shape is None or query is None or out.shape.rank() != 3:
                return result.fail("the attention output is not reshaped back to (B, S, D)", out)
            return result

    rules = []
    for past in (True, False):  # as onnxscript orders them: rules with past first
        for rotary in (False, True):
            for cross in [False] if past else [False, True]:
                name = f"MHA{'_Rotary' if rotary else ''}{'_Past' if past else ''}{'_CrossAttention' if cross else ''}"
                rules.append(
                    CheckedMultiHeadAttention.rule(
                        name, is_rotary=rotary, has_past_present=past, is_cross_attention=cross
                    )
                )
    return pattern.RewriteRuleSet(rules)


def _fusion_functions() -> dict[str, Callable[..., int]]:
    from onnxscript.rewriter.ort_fusions import _core

    mha_rules = _checked_mha_rules()

    def mha(model: ir.Model) -> int:
        return int(mha_rules.apply_to_model(model))

    return {
        # SDPA's rules need ranks and dims; the ones after it match what it produced.
        "sdpa": lambda m: _core.fuse_sdpa(m, apply_shape_inference=True),
        "mha": mha,
        "mha_scale": _core.fuse_mha_scale,
        "mha_bias": _core.fuse_mha_bias,
        "attention": _core.fuse_attention,
        # An SDPA no MHA rule took (onnxruntime has no such op) becomes a MultiHeadAttention wrapped in Transposes.
        "sdpa_via_mha": _core.replace_sdpa_by_mha,
        "gelu": _core.fuse_gelu,
        "bias_gelu": _core.fuse_bias_gelu,
        # Not in FUSIONS (see LEFT_OUT); here for benchmarks/bench_ort_fusions.py to measure.
        "skip_layer_normalization": _core.fuse_skip_layer_normalization,
    }


def has_skip_layernorm_pattern(model: onnx.ModelProto) -> bool:
    """Return whether some Add feeds a LayerNormalization (what onnxruntime fuses into SkipLayerNormalization)."""
    for graph in _graphs(model.graph):
        adds = {out for node in graph.node if node.op_type == "Add" for out in node.output}
        if any(node.op_type == "LayerNormalization" and node.input[0] in adds for node in graph.node):
            return True
    return False


def drop_value_info(model: onnx.ModelProto) -> int:
    """Remove every intermediate ``value_info`` from ``model`` (subgraphs included); return how many."""
    removed = 0
    for graph in _graphs(model.graph):
        removed += len(graph.value_info)
        del graph.value_info[:]
    return removed


def apply_fusions(model: onnx.ModelProto, names: tuple[str, ...] = FUSIONS) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Return ``model`` with onnxscript's ORT fusions ``names`` applied (``model`` itself when none fired), and counts."""
    from onnx_ir.passes import common as ir_common

    from services.passes.elimination import DeadCode, DeduplicateInitializers, LiftConstants
    from services.passes.folding import ShapeInference

    working = ir.serde.deserialize_model(model)
    ShapeInference()(working)
    counts: dict[str, int] = {}
    with quiet_logger("onnxscript"):
        for name, fuse in _fusion_functions().items():
            if name in names:
                counts[name] = int(fuse(working))
                if counts[name]:
                    # The values a rule creates carry no type; the next rules check dtypes and ranks.
                    ShapeInference()(working)
    if not any(counts.values()):
        return model, counts
    # A fusion may leave an intermediate function (an SDPA no MHA consumed): inline it.
    ir_common.InlinePass()(working)
    ir_common.RemoveUnusedFunctionsPass()(working)
    ir_common.RemoveUnusedOpsetsPass()(working)
    DeadCode()(working)
    # The rules write their shape vectors and scales as Constant nodes; Kiln's outputs hold them as initializers.
    LiftConstants()(working)
    DeduplicateInitializers()(working)
    return ir.serde.serialize_model(working), counts


def _timed(
    source: onnx.ModelProto, candidate: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> speed.SpeedVerdict | str:
    try:
        times = speed.time_interleaved(speed.timing_session(source), speed.timing_session(candidate), feed)
    except Exception as exc:
        return f"timing failed: {type(exc).__name__}: {str(exc)[:200]}"
    if times is None:
        return "one run is too slow to time within the guard's budget"
    return speed.decide(*times, margin=1.0)


def fuse_for_onnxruntime(
    model: onnx.ModelProto,
    feeds: list[dict[str, np.ndarray]],
    *,
    timed: bool = True,
    check: OutputCheck | None = None,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Return the model to publish for onnxruntime and what was done, measured and decided.

    ``model`` is not modified. The result is ``model`` itself when nothing applies, when a
    rewrite changes its outputs on ``feeds``, or (with ``timed``) when the rewritten model
    is not faster in onnxruntime than ``model`` (median over interleaved rounds). ``check``:
    ``model``'s outputs on ``feeds`` when the caller already has them.
    """
    started = time.perf_counter()
    report: dict[str, Any] = {"tool": "onnxscript.rewriter.ort_fusions", "left_out": dict(LEFT_OUT)}
    candidate = onnx.ModelProto()
    candidate.CopyFrom(model)
    drop = has_skip_layernorm_pattern(candidate)
    try:
        # On the declared shapes: the rules check ranks and dims that inference alone may not recover.
        fused, counts = apply_fusions(candidate)
    except Exception as exc:  # a library rule that crashes costs its fusions, not the job
        fused, counts = candidate, {}
        report["fusion_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if drop:
        report["value_info_dropped"] = drop_value_info(candidate)
    report["fusions"] = {k: v for k, v in counts.items() if v}
    if fused is not candidate:
        if drop or has_skip_layernorm_pattern(fused):
            drop_value_info(fused)  # the shapes the fusions inferred would bring SkipLayerNorm back
        problem = _check(model, fused, feeds, check)
        if problem is None:
            candidate = fused
        else:
            report["fusions_dropped"] = problem
            report["fusions"] = {}
    changed = bool(report.get("value_info_dropped")) or bool(report["fusions"])
    report["nodes_before"], report["nodes_after"] = len(model.graph.node), len(candidate.graph.node)
    if not changed:
        report["applied"], report["reason"] = False, "nothing to fuse"
        report["seconds"] = round(time.perf_counter() - started, 3)
        return model, report
    verdict = _timed(model, candidate, feeds[0]) if timed and feeds else None
    if isinstance(verdict, speed.SpeedVerdict):
        report["timing"] = verdict.to_dict()
        faster = verdict.ratio < 1.0
        report["applied"] = faster
        report["reason"] = f"fused model runs in {verdict.ratio:.2f}x the unfused one's time in onnxruntime" + (
            "" if faster else ": the unfused model is kept"
        )
    else:
        report["applied"] = True
        report["reason"] = verdict or "not timed"
    report["seconds"] = round(time.perf_counter() - started, 3)
    if not report["applied"]:
        report["nodes_after"] = report["nodes_before"]
        return model, report
    return candidate, report


def _check(
    model: onnx.ModelProto, fused: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], check: OutputCheck | None
) -> str | None:
    """Return why ``fused`` is not ``model`` on ``feeds`` (it fails to load, or its outputs differ), else None."""
    if not feeds:
        return "no inputs to check the fusions on"
    try:
        return (check or OutputCheck.for_model(model, feeds)).compare(fused)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
