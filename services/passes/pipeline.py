"""Kiln's default ONNX pipeline and ``optimize_model``, the one call others use.

Order matters: make shapes and constants known, fold them, then fuse (fusions match on
constant weights and known ranks), then clean up what folding and fusion left behind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import onnx
import onnx_ir as ir
from google.protobuf.message import EncodeError

from services.passes._base import KilnPass, count_nodes
from services.passes.elimination import (
    CommonSubexpressions,
    DeadCode,
    DeduplicateInitializers,
    EliminateNoOps,
    IdentityElimination,
    LiftConstants,
)
from services.passes.folding import ConstantFolding, InlineFunctions, MaterializeReshapeShapes, ShapeInference
from services.passes.fusion import (
    FuseActivationClips,
    FuseBatchNorm,
    FuseConvAffine,
    FuseMatMulAddToGemm,
    FusePadIntoConv,
    RemoveZeroBias,
)
from services.passes.manager import OptimizeReport, PassManager, PassRecord, pass_failure
from services.passes.shape_vectors import FoldShapeSelects
from services.passes.slices import MergeSlicesIntoSplit
from services.passes.verify import OutputCheck

__all__ = ["default_passes", "drop_inferred_value_info", "optimize_model"]


def default_passes() -> list[KilnPass]:
    """Return fresh instances of the default pipeline, in the order they run."""
    return [
        InlineFunctions(),
        ShapeInference(),
        ConstantFolding(),
        MaterializeReshapeShapes(),
        EliminateNoOps(),
        # After EliminateNoOps: TorchScript flattens the vector (Reshape to [-1]) before the select.
        FoldShapeSelects(),
        FuseBatchNorm(),
        FuseConvAffine(),
        FusePadIntoConv(),
        FuseMatMulAddToGemm(),
        MergeSlicesIntoSplit(),
        FuseActivationClips(),
        RemoveZeroBias(),
        IdentityElimination(),
        # Constants become initializers and equal initializers one, so that CSE sees nodes
        # reading equal constants as reading the same value.
        LiftConstants(),
        DeduplicateInitializers(),
        CommonSubexpressions(),
        DeadCode(),
    ]


def _checker_error(model: onnx.ModelProto) -> str | None:
    """Return onnx.checker's complaint about ``model`` (None when it is valid)."""
    try:
        data = model.SerializeToString()  # once: ByteSize would encode the model as well
    except (ValueError, EncodeError):
        return None  # past protobuf's 2 GiB: the checker only takes such models from a path
    try:
        onnx.checker.check_model(data)
        return None
    except Exception as exc:
        return str(exc).splitlines()[0][:500]


def _find_invalidating_pass(original: onnx.ModelProto, manager: PassManager) -> str:
    """Replay the passes with the checker after each; return the first one that breaks validity."""
    model = ir.serde.deserialize_model(original)
    for i, p in enumerate(manager.passes):
        manager.run_pass(p, model, manager.names[:i])
        if _checker_error(ir.serde.serialize_model(model)) is not None:
            return p.name
    return manager.names[-1]


def _replay_with_reverts(
    original: onnx.ModelProto, manager: PassManager, check: OutputCheck
) -> tuple[onnx.ModelProto, list[PassRecord]]:
    """Rerun the passes checking outputs after each change; undo each pass that changes them."""
    model = ir.serde.deserialize_model(original)
    records: list[PassRecord] = []
    for p in manager.passes:
        snapshot = ir.serde.serialize_model(model)
        record = manager.run_pass(p, model, [r.name for r in records])
        if record.modified:
            problem = check.compare(ir.serde.serialize_model(model))
            if problem is not None:
                model = ir.serde.deserialize_model(snapshot)
                record.reverted = True
                record.reason = problem
                record.nodes_after = record.nodes_before
        records.append(record)
    return ir.serde.serialize_model(model), records


def _declared_value_info(model: onnx.ModelProto) -> set[str]:
    """Return the names of the intermediate values ``model`` itself annotates (value_info), subgraphs included."""
    names: set[str] = set()
    for graph in _graphs(model.graph):
        names.update(vi.name for vi in graph.value_info)
    return names


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                found.extend(_graphs(sub))
    return found


def drop_inferred_value_info(result: onnx.ModelProto, source: onnx.ModelProto) -> int:
    """Remove from ``result`` the value_info the source did not declare; return how many were removed.

    Shape inference annotates every intermediate value so that the passes can match on
    ranks and dims; those annotations are the passes' working state, not part of the
    model. Left in, they tell onnxruntime shapes it cannot infer itself (data-propagated
    Reshape outputs), and its load-time SkipLayerNormFusion then turns Add + LayerNormalization
    into SkipLayerNormalization, whose CPU kernel is a scalar loop 5-8x slower than the two
    ops it replaces (onnxruntime 1.32; issue 12: BERT 1.10x slower than its source).
    """
    declared = _declared_value_info(source)
    removed = 0
    for graph in _graphs(result.graph):
        keep = [vi for vi in graph.value_info if vi.name in declared]
        removed += len(graph.value_info) - len(keep)
        if len(keep) != len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(keep)
    return removed


def optimize_model(
    model: onnx.ModelProto,
    passes: Sequence[KilnPass] | None = None,
    *,
    check: OutputCheck | None = None,
    keep_inferred_shapes: bool = False,
) -> tuple[onnx.ModelProto, OptimizeReport]:
    """Return the optimised copy of ``model`` and what each pass did; ``model`` is not modified.

    ``passes`` defaults to :func:`default_passes`. With ``check`` (the original's outputs on
    some feeds), the result is run in onnxruntime; if it disagrees, the passes are replayed
    one by one and each pass that changes the outputs is undone and reported as reverted.
    A failing pass, or a result onnx.checker rejects when the input passed it, raises
    CONVERSION_FAILED naming the pass and the passes before it. The shapes the passes
    inferred for intermediate values are dropped from the result unless
    ``keep_inferred_shapes`` (see :func:`drop_inferred_value_info`).
    """
    manager = PassManager(default_passes() if passes is None else passes)
    started = time.perf_counter()
    working = ir.serde.deserialize_model(model)
    nodes_before = count_nodes(working)
    records = manager.run(working)
    result = ir.serde.serialize_model(working)
    if _checker_error(result) is not None and _checker_error(model) is None:
        culprit = _find_invalidating_pass(model, manager)
        before = manager.names[: manager.names.index(culprit)]
        raise pass_failure(culprit, before, f"the result fails onnx.checker: {_checker_error(result)}")
    verification = None
    if check is not None:
        problem = check.compare(result)
        verification = {"checked": True, "samples": check.samples, "reverted": []}
        if problem is not None:
            result, records = _replay_with_reverts(model, manager, check)
            verification["first_mismatch"] = problem
            verification["reverted"] = [r.name for r in records if r.reverted]
            final = check.compare(result)
            if final is not None:  # every pass passed alone yet the whole does not: keep the source
                verification["fallback"] = "source model kept: " + final
                result = onnx.ModelProto()
                result.CopyFrom(model)
                for r in records:
                    r.reverted, r.nodes_after = True, r.nodes_before
    if not keep_inferred_shapes:
        drop_inferred_value_info(result, model)
    nodes_after = records[-1].nodes_after if records else nodes_before
    report = OptimizeReport(records, nodes_before, nodes_after, time.perf_counter() - started, verification)
    return result, report
