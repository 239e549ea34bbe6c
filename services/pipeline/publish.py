"""The publish step: an export artifact becomes a repository version with its manifest."""

from __future__ import annotations

from typing import Any

from services.artifacts import Artifact
from services.errors import KilnError
from services.repository.publish import publish_version
from services.steps.context import StepContext

__all__ = ["build_manifest", "run_publish_step"]


def _route_attempts(ctx: StepContext) -> list[dict[str, Any]]:
    """Return the target's routes tried, in order: the failed ones, then this one (published)."""
    tried = ctx.extras.get("route_attempts") or [{"rank": 1, "route": ctx.step.options.get("route")}]
    return [{**a, "status": "published"} if a.get("status", "running") == "running" else a for a in tried]


def build_manifest(ctx: StepContext, exported: Artifact) -> dict[str, Any]:
    """Return the provenance manifest: source, route, passes, speed guard, tools, precision, parity, benchmark."""
    meta = exported.meta
    lineage: list[dict[str, Any]] = meta.get("lineage", [])
    tools: dict[str, str] = {}
    passes: list[dict[str, Any]] = []
    speed_guard: dict[str, Any] | None = None
    opset_upgrade: dict[str, Any] | None = None
    static_arguments: dict[str, Any] = {}
    for rec in lineage:
        tools.update(rec.get("tool_versions", {}))
        passes.extend(rec.get("report", {}).get("passes", []))
        # The optimize step's timing of its output against its input, and which it kept.
        speed_guard = rec.get("report", {}).get("speed_guard", speed_guard)
        # An old opset the optimize step upgraded: from, to, why (services/passes/opset_upgrade.py).
        opset_upgrade = rec.get("report", {}).get("opset_upgrade") or opset_upgrade
        # Arguments the spec pinned (inputs.<name>.value) that the converter baked in as constants.
        static_arguments = rec.get("report", {}).get("static_arguments") or static_arguments
    return {
        "kiln_manifest": 1,
        "job_id": ctx.job_id,
        "target": meta.get("target"),
        "precision": meta.get("precision"),
        "format": meta.get("format"),
        "source": {
            "sha256": ctx.source.sha256,
            "format": ctx.source.format.value,
            "filename": ctx.source.path.name,
            "detected_as": ctx.source.seen,
        },
        "route": ctx.step.options.get("route"),
        # Every route tried for this target, in order: those that failed (tool, code, message) and this one.
        "route_attempts": _route_attempts(ctx),
        "steps": [
            {
                k: rec.get(k)
                for k in ("step", "kind", "tool", "engine", "seconds", "rss_before_mb", "peak_rss_mb", "tool_versions")
            }
            for rec in lineage
        ],
        "passes": passes,
        "speed_guard": speed_guard,
        "opset_upgrade": opset_upgrade,
        "static_arguments": static_arguments,
        "tool_versions": tools,
        "io": meta.get("io"),
        "parity": meta.get("parity"),
        # Task accuracy on the spec's labelled data: metric, source and artifact scores, drop, max_drop.
        "evaluation": meta.get("evaluation"),
        "benchmark": meta.get("benchmark"),
        "vs_fp32": meta.get("vs_fp32"),
        "engine_details": meta.get("engine_details", {}),
        # A GPU-bound artifact: the GPU that checked it and its numbers there, or that only the CPU did.
        "device_check": meta.get("device_check"),
        # The export's content address: an identical artifact has the same key (see publish_version).
        "artifact_key": ctx.input_keys.get("model"),
        "warnings": meta.get("warnings", []),
        "spec": ctx.spec.model_dump(mode="json"),
    }


def _instance_kind(ctx: StepContext) -> str | None:
    """Return Triton's instance kind when the spec asks for one (onnxruntime on GPU); None = the exporter's."""
    if ctx.step.target == "onnxruntime" and ctx.spec.serving.onnxruntime_device == "gpu":
        return "KIND_GPU"
    return None


def run_publish_step(ctx: StepContext) -> Artifact:
    """Publish the export artifact into the job's repository; return a record of where."""
    if ctx.repository is None:
        raise KilnError("no model repository configured for publishing")
    exported = ctx.model
    name = ctx.step.options["name"]
    published = publish_version(
        ctx.repository,
        exported,
        name=name,
        version=ctx.spec.version,
        manifest=build_manifest(ctx, exported),
        max_batch_size=ctx.spec.max_batch_size,
        batch_limit=ctx.spec.batch_limit,
        serving_root=ctx.spec.serving.root,
        instance_kind=_instance_kind(ctx),
        reuse_identical=ctx.use_cache,
        triton_serving=ctx.spec.serving.triton,
    )
    if published.reused:
        ctx.progress(f"{published.name} version {published.version} already holds this artifact: not published again")
        return Artifact(root=ctx.out_dir, kind="published", meta={"published": published.to_dict(), "reused": True})
    ctx.progress(f"published {published.name} version {published.version}")
    return Artifact(root=ctx.out_dir, kind="published", meta={"published": published.to_dict()})
