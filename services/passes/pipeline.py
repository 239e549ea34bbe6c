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
from services.passes.slices import MergeSlicesIntoSplit
from services.passes.verify import OutputCheck

__all__ = ["default_passes", "optimize_model"]


def default_passes() -> list[KilnPass]:
    """Return fresh instances of the default pipeline, in the order they run."""
    return [
        InlineFunctions(),
        ShapeInference(),
        ConstantFolding(),
        MaterializeReshapeShapes(),
        EliminateNoOps(),
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


def optimize_model(
    model: onnx.ModelProto,
    passes: Sequence[KilnPass] | None = None,
    *,
    check: OutputCheck | None = None,
) -> tuple[onnx.ModelProto, OptimizeReport]:
    """Return the optimised copy of ``model`` and what each pass did; ``model`` is not modified.

    ``passes`` defaults to :func:`default_passes`. With ``check`` (the original's outputs on
    some feeds), the result is run in onnxruntime; if it disagrees, the passes are replayed
    one by one and each pass that changes the outputs is undone and reported as reverted.
    A failing pass, or a result onnx.checker rejects when the input passed it, raises
    CONVERSION_FAILED naming the pass and the passes before it.
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
    nodes_after = records[-1].nodes_after if records else nodes_before
    report = OptimizeReport(records, nodes_before, nodes_after, time.perf_counter() - started, verification)
    return result, report
