"""The optimize step: load the ONNX model, run the default passes with the safety net and the
speed guard, save it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from services.artifacts import Artifact
from services.formats import Format
from services.onnx_io import load_onnx, save_onnx
from services.passes import speed
from services.passes.opset_upgrade import upgrade_opset
from services.passes.pipeline import optimize_model
from services.passes.verify import OutputCheck, ort_session, session_inputs
from services.spec import CompileSpec
from services.steps.context import StepContext
from services.validation import make_validation_inputs

__all__ = ["GUARD_MAX_WEIGHT_BYTES", "MODEL_FILE", "VERIFY_SAMPLES", "output_check", "run_optimize_step", "speed_guard"]

MODEL_FILE = "model.onnx"
#: Seeded random samples the safety net compares on; round-off shows on the first one,
#: a wrong rewrite on all of them.
VERIFY_SAMPLES = 2
#: Above this much weight the guard does not time: two more sessions would cost seconds.
GUARD_MAX_WEIGHT_BYTES = 256 << 20


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


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def speed_guard(
    source: onnx.ModelProto, optimised: onnx.ModelProto, feed: dict[str, np.ndarray] | None
) -> tuple[bool, dict[str, Any]]:
    """Return (keep the source instead, what the guard measured or why it did not) for the manifest."""
    if feed is None:
        return False, {
            "checked": False,
            "reason": "no inputs to time with (the source does not run on generated inputs)",
        }
    if _weight_bytes(source) > GUARD_MAX_WEIGHT_BYTES:
        return False, {"checked": False, "reason": f"weights over {GUARD_MAX_WEIGHT_BYTES >> 20} MiB: not timed"}
    try:
        times = speed.time_interleaved(speed.timing_session(source), speed.timing_session(optimised), feed)
    except Exception as exc:  # the safety net has already run both; a timing failure must not fail the job
        return False, {"checked": False, "reason": f"timing failed: {type(exc).__name__}: {str(exc)[:300]}"}
    if times is None:
        return False, {"checked": False, "reason": f"one run takes over {speed.BUDGET_S / (2 * speed.ROUNDS):.3f} s"}
    verdict = speed.decide(*times)
    return verdict.kept == "source", {"checked": True, **verdict.to_dict()}


def run_optimize_step(ctx: StepContext) -> Artifact:
    """Optimise ``ctx.model`` with Kiln's default passes; return the artifact with per-pass records."""
    model, upgrade = upgrade_opset(load_onnx(ctx.model.path))
    if upgrade is not None:
        ctx.progress(f"upgraded the graph from opset {upgrade['from']} to {upgrade['to']} (onnx.version_converter)")
    check, unchecked = output_check(model, ctx.spec)
    ctx.progress(f"optimising {len(model.graph.node)} nodes")
    optimized, report = optimize_model(model, check=check)
    verification: dict[str, Any] = report.verification or {"checked": False, "reason": unchecked}
    if report.reverted:
        ctx.progress(f"reverted passes that changed outputs: {', '.join(report.reverted)}")
    nodes_after = report.nodes_after
    if not any(r.modified and not r.reverted for r in report.passes):
        keep_source, guard = False, {"checked": False, "reason": "the passes changed nothing that was kept"}
    else:
        keep_source, guard = speed_guard(model, optimized, check.feeds[0] if check is not None else None)
    if keep_source:
        ctx.progress(f"speed guard: {guard['reason']}")
        optimized, nodes_after = model, report.nodes_before
    ctx.progress(f"{report.nodes_before} -> {nodes_after} nodes")
    save_onnx(optimized, ctx.out_dir / MODEL_FILE)
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "passes": [r.to_dict() for r in report.passes],
            "nodes_before": report.nodes_before,
            "nodes_after": nodes_after,
            "seconds": round(report.seconds, 3),
            "verification": verification,
            "speed_guard": guard,
            "opset_upgrade": upgrade,
        },
    )
