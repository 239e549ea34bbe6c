"""The FastAPI app factory: settings, job store, Celery app and storage are handed in, not imported."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from api.auth import TokenCache
from api.deps import ReadAuth
from api.errors import install_error_handlers
from api.login_throttle import LoginThrottle
from api.metrics import Metrics, MetricsMiddleware
from api.openapi import complete_openapi, operation_id
from api.origin import OriginGuard
from api.polling import JobBodies, JobVersions
from api.readiness import EmbeddedWorkers
from api.routes import compile as compile_routes
from api.routes import jobs as job_routes
from api.routes import plan as plan_routes
from api.routes import service as service_routes
from api.routes import tune as tune_routes
from api.scratch import ApiScratch
from api.sessions import session_keys
from api.ui import install_dashboard
from services.graph.registry import Registry, default_registry
from services.jobs.backends import open_repository, open_store
from services.jobs.db import database_url
from services.jobs.migrate import upgrade
from services.jobs.models import DEFAULT_TENANT
from services.jobs.stores import JobStores
from services.repository.checks import SignatureChecks
from services.repository.signing_keys import trusted_cas, trusted_keys
from services.settings import Settings, get_settings
from services.webhooks import WebhookPolicy, deliver_due
from workers.maintenance import fail_unserved_once, worker_max_age

log = logging.getLogger("kiln.api")

__all__ = ["create_app"]

#: Seconds between removals of idempotency keys past their 24 hours.
KEY_PURGE_INTERVAL = 3600.0
#: Seconds between looks for due webhooks.
WEBHOOK_POLL = 0.5

DESCRIPTION = """\
Kiln compiles a trained model for every serving engine a team deploys to, checks each
artifact against the source model, benchmarks it and publishes it into a model repository.

Submit with `POST /compile` (multipart: `model` file + `spec` JSON), follow with
`GET /jobs/{id}/events` (Server-Sent Events) or `GET /jobs/{id}`, download with
`GET /jobs/{id}/artifacts/{target}`. Errors carry a stable `code` and a `hint`.

The web dashboard is at `/ui`. With auth on it signs in with a token and keeps a signed
session id (never the token) in the `kiln_session` cookie (HttpOnly, SameSite=Strict, Secure
over https), which GET requests may send instead of the bearer token; any other request with
only the cookie needs the session's `X-CSRF-Token` header too. Whatever the auth setting, a
state-changing request with a foreign `Origin` or `Sec-Fetch-Site: cross-site` is FORBIDDEN.

Every token belongs to a tenant: it sees and changes only its tenant's jobs, logs,
artifacts and model names (admin tokens: every tenant's).
"""


def create_app(
    settings: Settings | None = None,
    celery_app: Any = None,
    *,
    registry: Registry | None = None,
    embedded: EmbeddedWorkers | None = None,
) -> FastAPI:
    """Return the API app for ``settings`` publishing steps through ``celery_app``.

    Without a Celery app one is built from the settings (what `kiln api` does). A SQLite
    job store is migrated at start; PostgreSQL is migrated by `kiln migrate`. ``embedded``:
    `kiln serve`'s own workers, which /readyz and job admission wait for while they start.
    """
    settings = settings or get_settings()
    if celery_app is None:
        from workers.app import create_celery_app

        celery_app = create_celery_app(settings)
    url = database_url(settings)

    async def fail_unserved_steps() -> None:
        # Workers sweep too, but with no worker alive at all only the API is left to notice
        # that a job waits for an engine nobody serves.
        purged_at = 0.0
        while True:
            await asyncio.sleep(settings.step_heartbeat_interval)
            try:
                await run_in_threadpool(
                    fail_unserved_once, app.state.steps, app.state.workers, app.state.celery, settings
                )
                if time.monotonic() - purged_at > KEY_PURGE_INTERVAL:
                    await run_in_threadpool(app.state.idempotency.purge_expired)
                    purged_at = time.monotonic()
            except Exception:  # a database or broker blip must not end the loop
                log.warning("sweep for unserved steps failed", exc_info=True)

    async def deliver_webhooks() -> None:
        # Webhooks go out from the API, never from the step that ended the job: a slow or dead
        # receiver costs the job nothing. Any API process may send; claims keep them apart.
        while True:
            await asyncio.sleep(WEBHOOK_POLL)
            try:
                await run_in_threadpool(deliver_due, app.state.webhooks, settings)
            except Exception:  # a database blip must not end the loop
                log.warning("webhook delivery pass failed", exc_info=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        if url.startswith("sqlite"):
            upgrade(url)
        admin = settings.admin_token.get_secret_value()
        if admin and await run_in_threadpool(app.state.tokens.ensure_token, "admin", admin, ["admin"], DEFAULT_TENANT):
            log.info("admin token (KILN_ADMIN_TOKEN) is live as token 'admin'")
        tasks = [asyncio.create_task(fail_unserved_steps()), asyncio.create_task(deliver_webhooks())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            app.state.scratch.close()

    # With auth on, the API description needs a token too ("every endpoint but the health
    # probes"); the interactive pages, which cannot send one, are off then.
    open_docs = not settings.auth_enabled
    app = FastAPI(
        title="Kiln",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        openapi_url="/openapi.json" if open_docs else None,
        docs_url=None,  # served from vendored files by api.ui.docs (offline)
        redoc_url=None,
        generate_unique_id_function=operation_id,
    )
    state = app.state
    state.settings = settings
    state.celery = celery_app
    stores = JobStores.open(url)
    state.jobs, state.steps, state.workers = stores.jobs, stores.steps, stores.workers
    state.tokens, state.sessions, state.model_names = stores.tokens, stores.sessions, stores.model_names
    state.idempotency = stores.idempotency
    state.webhooks = stores.webhooks
    state.webhook_policy = WebhookPolicy.from_settings(settings)
    state.session_keys = session_keys(settings)
    state.store = open_store(settings)
    state.repository = open_repository(settings)
    # Whether each published version still holds the files Kiln signed (GET /repository, the dashboard).
    own_key = state.repository.signing_key
    state.signatures = SignatureChecks(trusted_keys(settings, own_key), trusted_cas(settings, own_key))
    state.registry = registry or default_registry()
    state.embedded = embedded
    # Uploads, detection and downloads work here; a crashed predecessor's leftovers go now.
    state.scratch = ApiScratch(settings.cache_dir / "api")
    state.token_cache = TokenCache()
    state.login_throttle = LoginThrottle()
    state.job_bodies = JobBodies()
    state.job_versions = JobVersions(state.jobs.job_versions)
    state.worker_max_age = worker_max_age(settings)
    state.metrics = Metrics(state)
    install_error_handlers(app)
    for module in (compile_routes, tune_routes, job_routes, plan_routes, service_routes):
        app.include_router(module.router)
    install_dashboard(app, open_docs=open_docs)
    app.add_middleware(
        OriginGuard, allowed_origins=settings.allowed_origin_list, allowed_hosts=settings.allowed_host_list
    )
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    if settings.trusted_proxy_list:
        # Outermost, so the guard and the cookies see the scheme the proxy says the browser used.
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.trusted_proxy_list)
    complete_openapi(app)
    if not open_docs:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_document(_: ReadAuth) -> JSONResponse:
            return JSONResponse(app.openapi())

    return app
