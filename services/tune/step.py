"""The tune job's two step functions: the search (in the worker's sandboxed child) and the publish.

``run_tune_step`` runs :func:`~services.tune.search.tune_model` on the job's source, as `kiln
tune` does, with the step's scratch as its artifact store (the candidates' shared conversions
run once within the step). Its events go out as progress lines that carry their data (the
job page draws the candidates as they arrive), and its output is the recommendation's export
artifact with the whole report in its metadata; with no recommendation, an empty artifact
holding the report, so the report survives and the publish step says why nothing is published.

``run_tune_publish_step`` runs on the worker (where the repository's credentials are): it
publishes that artifact with the manifest a compile writes plus the tune's section, and the
Triton config the recommendation measured (instances, batch, engine threads and streams).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import KilnError, NoCandidate
from services.pipeline.publish import build_manifest
from services.repository.publish import publish_version
from services.spec import TritonServingSpec
from services.steps.context import StepContext
from services.storage.local import LocalArtifactStore
from services.tune.manifest import tune_section
from services.tune.options import TuneOptions
from services.tune.search import tune_model

__all__ = ["progress_line", "run_tune_publish_step", "run_tune_step"]

#: Meta keys of the tune step's artifact besides the export's own.
_REPORT, _SECTION, _SERVING, _LINEAGE = "tune", "tune_manifest", "tune_serving", "tune_lineage"


def _settings_text(settings: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (settings or {}).items()) or "defaults"


def progress_line(event: dict[str, Any]) -> str | None:
    """Return the log line of a search event (None for the compile pipeline's own chatter)."""
    kind = event.get("type")
    if kind == "tune_build":
        return f"building {event['precision']}: {', '.join(event['targets'])}"
    if kind == "tune_built":
        built = ", ".join(
            f"{b['target']} {b['status']}"
            + (f" ({(b.get('error') or {}).get('code')})" if b["status"] != "built" else "")
            for b in event["built"]
        )
        return f"built {event['precision']}: {built}"
    if kind == "tune_measure":
        return f"timing {event['candidates']} candidates side by side, interleaved round by round"
    if kind == "tune_candidates":
        timed = sum(c["passed"] for c in event["candidates"])
        return f"{len(event['candidates'])} candidates {event['phase']}" + (
            f": {timed} passed and timed" if event["phase"] == "timed" else ""
        )
    if kind == "tune_concurrency":
        return f"throughput of {event['candidate']} at {','.join(map(str, event['levels']))} concurrent instances"
    if kind == "tune_recommendation":
        p50 = event.get("p50_ms")
        return (
            f"recommended {event['target']} {event['precision']} ({_settings_text(event.get('settings'))}, batch "
            f"{event['batch']})" + (f": p50 {p50:.3f} ms" if isinstance(p50, (int, float)) else "")
        )
    if kind == "step_failed":
        return f"{event['step']}: {(event.get('error') or {}).get('code')}"
    return None


def _without_paths(data: Any) -> Any:
    """Return ``data`` without the worker's scratch paths (the artifacts' and the model's) it carries."""
    if isinstance(data, dict):
        return {
            k: (None if k in ("artifact", "model") and isinstance(v, str) else _without_paths(v))
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_without_paths(v) for v in data]
    return data


def _relay(ctx: StepContext, event: dict[str, Any]) -> None:
    line = progress_line(event)
    if line is None:
        return
    if str(event.get("type", "")).startswith("tune_"):
        ctx.progress({"message": line, "tune": _without_paths(event)})
    else:
        ctx.progress(line)


def _shared_spec(ctx: StepContext) -> dict[str, Any]:
    """Return the CompileSpec fields every candidate shares, with the calibration file where the step has it."""
    data = ctx.spec.model_dump(mode="json", exclude_defaults=True)
    data["source_format"] = ctx.source.format.value  # detected (and vetted) at upload: not guessed again
    calibration = ctx.extras.get("calibration_path")
    if calibration:
        data["calibration"] = str(calibration)
    else:
        data.pop("calibration", None)
    evaluation = ctx.extras.get("evaluation_path")
    if ctx.spec.evaluation is not None and evaluation:
        # The candidates' accuracy floor: the labelled data where this step fetched it.
        data["evaluation"] = {**ctx.spec.evaluation.model_dump(mode="json"), "data": str(evaluation)}
    return data


def run_tune_step(ctx: StepContext) -> Artifact:
    """Search the step's space for the job's source; return the recommendation's export with the report."""
    options = TuneOptions.model_validate(ctx.step.options["tune"])
    req = options.request(ctx.source.path, _shared_spec(ctx))
    req.use_cache = ctx.use_cache
    store = LocalArtifactStore(ctx.scratch / "tune-store")
    report = tune_model(req, store=store, repository=None, on_event=lambda e: _relay(ctx, e))
    body = _without_paths(report.to_dict())
    body["model"] = ctx.source.path.name
    rec = report.recommendation
    if rec is None:
        return Artifact(root=ctx.out_dir, kind="tune_report", meta={_REPORT: body})
    chosen = next(c for c in report.candidates if c.key == rec["id"])
    path = Path(str(chosen.artifact))
    exported = Artifact.load(path if path.is_dir() else path.parent)
    shutil.copytree(exported.root, ctx.out_dir, dirs_exist_ok=True)
    meta = {
        **exported.meta,
        _REPORT: body,
        _SECTION: tune_section(rec, report.profiles, report.measurement),
        _SERVING: rec["serving"]["triton"],
        # The export's own steps (convert, optimize, export): the executor's lineage of this step
        # starts at the source, and the manifest should name the tools that made the artifact.
        _LINEAGE: exported.meta.get("lineage", []),
    }
    return Artifact(root=ctx.out_dir, kind=exported.kind, entry=exported.entry, meta=meta)


def run_tune_publish_step(ctx: StepContext) -> Artifact:
    """Publish the recommended artifact with the tune in its manifest and its measured Triton settings."""
    if ctx.repository is None:
        raise KilnError("no model repository configured for publishing")
    exported = ctx.model
    report = exported.meta.get(_REPORT) or {}
    if exported.meta.get(_SECTION) is None:
        tried = [c for c in report.get("candidates", []) if c.get("passed")]
        raise NoCandidate(
            "the tune found no candidate that meets every constraint"
            + (f" ({'; '.join(report.get('notes') or [])})" if report.get("notes") else "")
            + f": {len(tried)} of {len(report.get('candidates', []))} candidates passed parity and were timed",
            step=ctx.step.id,
        )
    lineage = list(exported.meta.get(_LINEAGE) or []) + list(exported.meta.get("lineage") or [])[-1:]
    manifest = build_manifest(
        ctx,
        Artifact(
            root=exported.root, kind=exported.kind, entry=exported.entry, meta={**exported.meta, "lineage": lineage}
        ),
    )
    manifest["tune"] = exported.meta[_SECTION]
    serving = ctx.spec.serving.triton.model_dump(exclude_none=True)
    triton = TritonServingSpec.model_validate({**serving, **(exported.meta.get(_SERVING) or {})})
    published = publish_version(
        ctx.repository,
        exported,
        name=ctx.step.options["name"],
        version=ctx.spec.version,
        manifest=manifest,
        max_batch_size=ctx.spec.max_batch_size,
        batch_limit=ctx.spec.batch_limit,
        serving_root=ctx.spec.serving.root,
        reuse_identical=ctx.use_cache,
        triton_serving=triton,
    )
    verb = "already holds" if published.reused else "now holds"
    ctx.progress(f"{published.name} version {published.version} {verb} the recommended artifact")
    meta: dict[str, Any] = {"published": published.to_dict()}
    if published.reused:
        meta["reused"] = True
    return Artifact(root=ctx.out_dir, kind="published", meta=meta)
