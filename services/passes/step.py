"""The optimize step: load the ONNX model, run the default passes with the safety net, save it."""

from __future__ import annotations

from typing import Any

import onnx

from services.artifacts import Artifact
from services.formats import Format
from services.onnx_io import load_onnx, save_onnx
from services.passes.pipeline import optimize_model
from services.passes.verify import OutputCheck, ort_session, session_inputs
from services.pipeline.context import StepContext
from services.spec import CompileSpec
from services.validation import make_validation_inputs

__all__ = ["MODEL_FILE", "VERIFY_SAMPLES", "output_check", "run_optimize_step"]

MODEL_FILE = "model.onnx"
#: Seeded random samples the safety net compares on; round-off shows on the first one,
#: a wrong rewrite on all of them.
VERIFY_SAMPLES = 2


def output_check(model: onnx.ModelProto, spec: CompileSpec) -> tuple[OutputCheck | None, str | None]:
    """Return the safety net for ``model`` (seeded random feeds shaped by the spec), or why there is none."""
    try:
        # One session for the feeds' shapes and the expected outputs: building a session
        # costs seconds for a model with gigabytes of weights.
        session = ort_session(model)
        feeds, _ = make_validation_inputs(session_inputs(session), spec)
        return OutputCheck.for_model(model, feeds[:VERIFY_SAMPLES], session=session), None
    except Exception as exc:
        return None, f"the source model does not run on generated inputs: {type(exc).__name__}: {str(exc)[:300]}"


def run_optimize_step(ctx: StepContext) -> Artifact:
    """Optimise ``ctx.model`` with Kiln's default passes; return the artifact with per-pass records."""
    model = load_onnx(ctx.model.path)
    check, unchecked = output_check(model, ctx.spec)
    ctx.progress(f"optimising {len(model.graph.node)} nodes")
    optimized, report = optimize_model(model, check=check)
    verification: dict[str, Any] = report.verification or {"checked": False, "reason": unchecked}
    if report.reverted:
        ctx.progress(f"reverted passes that changed outputs: {', '.join(report.reverted)}")
    ctx.progress(f"{report.nodes_before} -> {report.nodes_after} nodes")
    save_onnx(optimized, ctx.out_dir / MODEL_FILE)
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "passes": [r.to_dict() for r in report.passes],
            "nodes_before": report.nodes_before,
            "nodes_after": report.nodes_after,
            "seconds": round(report.seconds, 3),
            "verification": verification,
        },
    )
