"""The service pages: engines and workers with the readiness banner, and the model repository."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from api.auth import Principal
from api.routes.service import readiness_checks, repository_listing, signature_public
from api.ui.session import render, render_page, viewer
from services.errors import NotFound
from services.gpu.device import GpuDevice
from services.graph.engines import queue_name
from services.repository.publish import MANIFEST, find_model_dir
from services.repository.signing import HINTS
from workers.queues import queue_engines

__all__ = ["router", "version_size"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _engines_context(request: Request) -> dict[str, Any]:
    state = request.app.state
    now = datetime.now(UTC)
    live = state.workers.live_workers(state.worker_max_age)
    queued = state.steps.queued_steps_by_queue()
    rows = []
    for name in queue_engines():
        serving = [w for w in live if name in w.engines]
        rows.append(
            {
                "name": name,
                "queue": queue_name(name),
                "workers": serving,
                "versions": next((w.versions.get(name, {}) for w in serving), {}),
                # The GPU engine's worker reports its device among its versions (services/gpu/device.py).
                "devices": [d for w in serving if (d := GpuDevice.from_versions(w.versions.get(name, {})))],
                "queued": queued.get(queue_name(name), 0),
            }
        )
    extra_queues = {q: n for q, n in queued.items() if q not in {r["queue"] for r in rows}}
    return {
        "engines": rows,
        "extra_queues": extra_queues,
        "workers": [{"w": w, "age": (now - w.heartbeat_at).total_seconds()} for w in live],
        "checks": readiness_checks(state),
    }


@router.get("/engines")
async def engines_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_engines_context, request)
    template = "_engines_live.html" if request.headers.get("hx-request") else "engines.html"
    return render(request, template, who, nav="engines", **ctx)


def version_size(repo: Any, model_dir: str, version: int) -> int | None:
    """Return the bytes of a published version in a local repository (None elsewhere: S3 is not walked)."""
    from services.repository.local import LocalModelRepository

    if not isinstance(repo, LocalModelRepository):
        return None
    return sum(p.stat().st_size for p in (repo.root / model_dir / str(version)).rglob("*") if p.is_file())


def _repository_context(request: Request, who: Principal) -> dict[str, Any]:
    repo = request.app.state.repository
    listing = repository_listing(who, repo, request.app.state.model_names, request.app.state.signatures)
    sizes = {
        (m.name, v.version): version_size(repo, f"{m.root}/{m.name}", v.version)
        for m in listing.models
        for v in m.versions
    }
    return {"listing": listing, "sizes": sizes}


@router.get("/repository")
async def repository_page(request: Request) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    ctx = await run_in_threadpool(_repository_context, request, who)
    return render(request, "repository.html", who, nav="repository", **ctx)


def _version_context(request: Request, who: Principal, name: str, version_text: str) -> dict[str, Any]:
    if not version_text.isdigit():
        raise NotFound(f"no version {version_text!r} of model {name!r}", hint="Versions are numbers.")
    version = int(version_text)
    repo = request.app.state.repository
    if not who.sees_all and request.app.state.model_names.owner(name) != who.tenant:
        raise NotFound(f"no version {version} of model {name!r}", hint="The repository page lists what is there.")
    model_dir = find_model_dir(repo, name)  # the server root (triton/, tfserving/, tflite/) that holds it
    if model_dir is None or version not in repo.versions(model_dir):
        raise NotFound(f"no version {version} of model {name!r}", hint="The repository page lists what is there.")
    raw = repo.read_file(f"{model_dir}/{version}/{MANIFEST}")
    manifest: dict[str, Any] = json.loads(raw) if raw else {}
    config = repo.read_file(f"{model_dir}/config.pbtxt")
    signature = signature_public(request.app.state.signatures, repo, model_dir, version)
    return {
        "name": name,
        "version": version,
        "uri": repo.uri(f"{model_dir}/{version}"),
        "manifest": manifest,
        "manifest_json": json.dumps(manifest, indent=2, default=str),
        "config": config.decode(errors="replace") if config else None,
        "size": version_size(repo, model_dir, version),
        "signature": signature,
        "hint": HINTS.get(signature.code, ""),
    }


@router.get("/repository/{name}/{version}")
async def version_page(request: Request, name: str, version: str) -> Response:
    return await render_page(request, "version.html", _version_context, name, version, nav="repository")
