"""Dependencies of the routes, as ``Annotated`` aliases: settings, the job stores, Celery, storage, auth.

They are ``async`` because they do no I/O: FastAPI would run a plain ``def`` dependency in
its thread pool, a thread hop per dependency per request.

Everything hangs off ``app.state`` (set by ``create_app``), so a test builds an app with
its own settings and Celery app instead of patching globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.auth import Principal, authenticate, authenticate_session
from api.sessions import SAFE_METHODS, request_session, require_csrf
from services.errors import Forbidden, Unauthorized
from services.graph.registry import Registry
from services.jobs.idempotency import IdempotencyKeys
from services.jobs.model_names import ModelNames
from services.jobs.store import JobStore
from services.jobs.worker_registry import WorkerRegistry
from services.repository.base import ModelRepository
from services.repository.checks import SignatureChecks
from services.settings import Settings
from services.storage.base import ArtifactStore

__all__ = [
    "AdminAuth",
    "CeleryDep",
    "IdempotencyDep",
    "JobStoreDep",
    "ModelNamesDep",
    "ReadAuth",
    "RegistryDep",
    "RepositoryDep",
    "SettingsDep",
    "SignatureChecksDep",
    "StoreDep",
    "WorkersDep",
    "WriteAuth",
]


async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_job_store(request: Request) -> JobStore:
    return request.app.state.jobs  # type: ignore[no-any-return]


async def get_workers(request: Request) -> WorkerRegistry:
    return request.app.state.workers  # type: ignore[no-any-return]


async def get_model_names(request: Request) -> ModelNames:
    return request.app.state.model_names  # type: ignore[no-any-return]


async def get_idempotency_keys(request: Request) -> IdempotencyKeys:
    return request.app.state.idempotency  # type: ignore[no-any-return]


async def get_celery(request: Request) -> Any:
    return request.app.state.celery


async def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store  # type: ignore[no-any-return]


async def get_repository(request: Request) -> ModelRepository:
    return request.app.state.repository  # type: ignore[no-any-return]


async def get_signature_checks(request: Request) -> SignatureChecks:
    return request.app.state.signatures  # type: ignore[no-any-return]


async def get_registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
JobStoreDep = Annotated[JobStore, Depends(get_job_store)]
WorkersDep = Annotated[WorkerRegistry, Depends(get_workers)]
ModelNamesDep = Annotated[ModelNames, Depends(get_model_names)]
IdempotencyDep = Annotated[IdempotencyKeys, Depends(get_idempotency_keys)]
CeleryDep = Annotated[Any, Depends(get_celery)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]
RepositoryDep = Annotated[ModelRepository, Depends(get_repository)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
SignatureChecksDep = Annotated[SignatureChecks, Depends(get_signature_checks)]

_bearer = HTTPBearer(auto_error=False, description="An API token from `kiln token create` (when auth is enabled).")


def _require(scope: str) -> Any:
    # async, like the getters above: FastAPI runs a sync dependency in the thread pool, a hop
    # per dependency per request. The only blocking part (a token's first lookup) is
    # pushed to a thread by authenticate itself.
    async def dependency(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> Principal:
        state = request.app.state
        if credentials is not None or not state.settings.auth_enabled:
            return await authenticate(state, credentials.credentials if credentials else None, scope)
        # No bearer token: the dashboard's session cookie stands in for it (api.sessions).
        session_id = request_session(request)
        if session_id is None:
            return await authenticate(state, None, scope)  # UNAUTHORIZED
        if request.method not in SAFE_METHODS:
            require_csrf(request, session_id)
        return await authenticate_session(state, session_id, scope)

    dependency.__name__ = f"require_{scope}"
    return dependency


async def optional_reader(request: Request) -> Principal | None:
    """Return the caller when it may read (a bearer token or a dashboard session; anyone with auth off), else None.

    For routes anyone may call but whose details only a reader may see (/readyz). The header is
    read here rather than through the bearer dependency, so the route stays documented as open.
    """
    state = request.app.state
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    try:
        if scheme.lower() == "bearer" and token.strip():
            return await authenticate(state, token.strip(), "read")
        if not state.settings.auth_enabled:
            return await authenticate(state, None, "read")
        session_id = request_session(request)
        return await authenticate_session(state, session_id, "read") if session_id else None
    except (Unauthorized, Forbidden):
        return None


ReadAuth = Annotated[Principal, Depends(_require("read"))]
WriteAuth = Annotated[Principal, Depends(_require("write"))]
AdminAuth = Annotated[Principal, Depends(_require("admin"))]


@dataclass
class Intake:
    """What accepting an upload needs (POST /compile, POST /tune): the caller (write scope) and what it writes to."""

    principal: Principal
    settings: Settings
    jobs: JobStore
    workers: WorkerRegistry
    store: ArtifactStore
    celery: Any
    registry: Registry
    keys: IdempotencyKeys


async def get_intake(
    principal: WriteAuth,
    settings: SettingsDep,
    jobs: JobStoreDep,
    workers: WorkersDep,
    store: StoreDep,
    celery: CeleryDep,
    registry: RegistryDep,
    keys: IdempotencyDep,
) -> Intake:
    return Intake(principal, settings, jobs, workers, store, celery, registry, keys)


IntakeDep = Annotated[Intake, Depends(get_intake)]
