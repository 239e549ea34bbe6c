"""The service itself: live engines and workers, the model repository, health probes, metrics."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.auth import Principal
from api.deps import (
    JobStoreDep,
    ModelNamesDep,
    ReadAuth,
    RepositoryDep,
    SignatureChecksDep,
    WorkersDep,
    optional_reader,
)
from api.schemas import (
    EnginePublic,
    EnginesPublic,
    HealthPublic,
    ModelPublic,
    QuotaPublic,
    ReadyPublic,
    RepositoryPublic,
    SignaturePublic,
    VersionPublic,
    WorkerPublic,
)
from services.gpu.device import GpuDevice
from services.graph.engines import queue_name
from services.jobs.quotas import QuotaStore, TenantQuota
from services.repository.checks import SignatureChecks
from services.repository.publish import MANIFEST, MODEL_META, configured_serving_root, published_models
from workers.queues import queue_engines

router = APIRouter(tags=["service"])


@router.get("/engines", response_model=EnginesPublic, summary="Live workers and the engines they serve")
def engines(request: Request, _: ReadAuth, registry: WorkersDep) -> EnginesPublic:
    """Return every engine with its queue and number of live workers, and the workers themselves.

    ``tune`` is listed too: the queue of tune jobs (POST /tune), taken by workers running several engines.
    """
    live = registry.live_workers(request.app.state.worker_max_age)
    out = []
    for name in queue_engines():
        serving = [w for w in live if name in w.engines]
        versions: dict[str, str] = next((w.versions.get(name, {}) for w in serving), {})
        devices = [d.to_dict() for w in serving if (d := GpuDevice.from_versions(w.versions.get(name, {})))]
        out.append(
            EnginePublic(name=name, queue=queue_name(name), workers=len(serving), versions=versions, devices=devices)
        )
    workers = [
        WorkerPublic(
            hostname=w.hostname,
            engines=list(w.engines),
            concurrency=w.concurrency,
            pid=w.pid,
            started_at=w.started_at,
            heartbeat_at=w.heartbeat_at,
        )
        for w in live
    ]
    return EnginesPublic(engines=out, workers=workers)


@router.get("/quota", response_model=QuotaPublic, summary="The caller's tenant: its jobs against its quotas")
def quota(request: Request, principal: ReadAuth, jobs: JobStoreDep) -> QuotaPublic:
    """Return how many of the caller's tenant's jobs run and wait, and the limits the caller's token submits under."""
    return quota_of(principal, jobs, request.app.state.settings)


def quota_of(principal: Principal, jobs: Any, settings: Any) -> QuotaPublic:
    """Return ``principal``'s tenant's usage and its token's quotas (also on the dashboard's job list)."""
    limits = TenantQuota.of(settings, principal.max_running_jobs, principal.max_queued_jobs)
    usage = QuotaStore(jobs.db).usage(principal.tenant)
    return QuotaPublic(
        tenant=principal.tenant,
        running=usage.running,
        max_running=limits.max_running,
        queued=usage.queued,
        max_queued=limits.max_queued,
    )


@router.get("/repository", response_model=RepositoryPublic, summary="Published models and versions")
def repository(
    principal: ReadAuth, repo: RepositoryDep, names: ModelNamesDep, checks: SignatureChecksDep
) -> RepositoryPublic:
    """Return the models of the caller's tenant (an admin: every model) with their versions, provenance headlines
    and signatures: whether each version's files are still the ones Kiln signed."""
    return repository_listing(principal, repo, names, checks)


def signature_public(checks: SignatureChecks, repo: Any, model_dir: str, version: int) -> SignaturePublic:
    """Return the version's signature verdict as the API shows it."""
    verdict = checks.check(repo, model_dir, version)
    body = verdict.to_dict()
    return SignaturePublic.model_validate({k: body[k] for k in ("status", "code", "message", "key_id", "problems")})


def repository_listing(principal: Principal, repo: Any, names: Any, checks: SignatureChecks) -> RepositoryPublic:
    """Return the repository as ``principal`` may see it: its tenant's model names only, unless admin.

    A name no job of this service published (put there by `kiln compile`, say) has no owner
    and is listed to admins only. Each version is verified against its signature (again only
    when its files changed: services/repository/checks.py). Only admins see the repository's own
    location (a host path or bucket); a tenant's URIs are relative to the serving root in force
    (bare when none is set).
    """
    owned = None if principal.sees_all else names.owned_by(principal.tenant)
    # A tenant sees where the serving engines find a model, never where this host keeps it.
    served = None if principal.sees_all else (configured_serving_root(repo) or "")

    def uri(rel: str = "") -> str:
        if served is None:
            return str(repo.uri(rel) if rel else repo.uri())
        if not served or not rel:
            return served or rel
        return f"{served.rstrip('/')}/{rel}"

    models = []
    for root, name in published_models(repo):
        if owned is not None and name not in owned:
            continue
        model_dir = f"{root}/{name}"
        raw_meta = repo.read_file(f"{model_dir}/{MODEL_META}")
        meta: dict[str, Any] = json.loads(raw_meta) if raw_meta else {}
        versions = []
        for v in repo.versions(model_dir):
            raw = repo.read_file(f"{model_dir}/{v}/{MANIFEST}")
            manifest: dict[str, Any] = json.loads(raw) if raw else {}
            versions.append(
                VersionPublic(
                    version=v,
                    uri=uri(f"{model_dir}/{v}"),
                    published_at=manifest.get("published_at"),
                    precision=manifest.get("precision"),
                    source_sha256=(manifest.get("source") or {}).get("sha256"),
                    job_id=manifest.get("job_id"),
                    signature=signature_public(checks, repo, model_dir, v),
                )
            )
        models.append(
            ModelPublic(name=name, root=root, target=meta.get("target"), format=meta.get("format"), versions=versions)
        )
    return RepositoryPublic(uri=uri(), models=models)


@router.get("/healthz", response_model=HealthPublic, summary="Liveness: the process answers")
async def healthz() -> HealthPublic:
    return HealthPublic()


def _check(fn: Any) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def _broker_ok(celery_app: Any) -> None:
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=2)


@router.get(
    "/readyz",
    response_model=ReadyPublic,
    responses={
        503: {
            "model": ReadyPublic,
            "description": "Not ready: a backing service is down (`unavailable`, `checks` says which), or `kiln serve`'s "
            "own workers are still starting (`starting` names their engines).",
        }
    },
    summary="Readiness: broker, database and storage answer (and `kiln serve`'s workers have started)",
)
async def readyz(request: Request) -> JSONResponse:
    """Answer 200 `ready` when the service can run jobs; 503 `starting` or `unavailable` otherwise.

    Anyone may call it; with auth on, only a caller with a read token (or a dashboard session)
    sees what failed and which engines are starting: the others get "ok" or "fail" per check.

    Under `kiln serve`, ready also means that its workers for the engines installed have
    started: until then (bounded by KILN_EMBEDDED_START_SECONDS) the answer is 503 `starting`,
    with the engines in `starting` (jobs submitted meanwhile are accepted and wait).
    """
    checks, starting = await run_in_threadpool(_readiness, request.app.state)
    ok = all(v == "ok" for v in checks.values())
    only_starting = bool(starting) and all(v == "ok" for k, v in checks.items() if k != "workers")
    status: Literal["ready", "starting", "unavailable"] = (
        "ready" if ok else "starting" if only_starting else "unavailable"
    )
    if await optional_reader(request) is None:
        # Anyone may ask (load balancers, probes), but what failed and how (a database address in
        # a driver's error, the engines installed) is for a caller with a token: ok or fail only.
        checks = {k: "ok" if v == "ok" else "fail" for k, v in checks.items()}
        starting = []
    body = ReadyPublic(status=status, checks=checks, starting=starting)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


def _live_engines(state: Any) -> set[str]:
    return {e for w in state.workers.live_workers(state.worker_max_age) for e in w.engines}


def _readiness(state: Any) -> tuple[dict[str, str], list[str]]:
    checks = readiness_checks(state)
    embedded = getattr(state, "embedded", None)
    starting = embedded.starting(_live_engines(state)) if embedded is not None and checks["database"] == "ok" else []
    return checks, starting


def readiness_checks(state: Any) -> dict[str, str]:
    """Return broker, database, storage (and `kiln serve`'s workers): "ok" or what failed (blocking: call it off the event loop)."""
    checks = {
        "broker": _check(lambda: _broker_ok(state.celery)),
        "database": _check(state.jobs.ping),
        "storage": _check(lambda: state.store.exists("readyz-probe")),
    }
    embedded = getattr(state, "embedded", None)
    if embedded is not None:
        checks["workers"] = (
            embedded.verdict(_live_engines(state)) if checks["database"] == "ok" else "unknown (no database)"
        )
    return checks


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
    },
    summary="Prometheus metrics",
)
def metrics(request: Request, _: ReadAuth) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
