"""`kiln api | worker | migrate | serve | token`: the service's processes and their admin.

Heavy imports (FastAPI, Celery, SQLAlchemy) happen inside the commands, so `kiln compile`
stays quick to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import click

from cli.common import EXIT_INPUT, console, handle_errors, out

__all__ = ["COMMANDS", "api_cmd", "migrate_cmd", "serve_cmd", "token_group", "worker_cmd"]


def _settings(**overrides: Any) -> Any:
    """Return the process's settings (with ``overrides``); INVALID_SETTINGS naming what is wrong."""
    from pydantic import ValidationError

    from services.errors import InvalidSettings
    from services.settings import Settings, get_settings

    try:
        base = get_settings()
        return Settings.model_validate({**base.model_dump(), **overrides}) if overrides else base
    except ValidationError as exc:
        problems = "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in exc.errors())
        raise InvalidSettings(f"the settings are refused: {problems}") from None


#: Host names that reach only this machine: where an API without auth may listen.
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _open_api_settings(settings: Any, host: str) -> Any:
    """Return ``settings`` for an API listening on ``host``: with auth off, loopback only and loopback names only.

    With auth off every caller is an admin, so the API must not be reachable from another
    machine (INVALID_SETTINGS otherwise), and answers only Host names of this machine, so
    a page that rebinds its own DNS name to 127.0.0.1 cannot reach it either.
    """
    from services.errors import InvalidSettings

    if settings.auth_enabled:
        return settings
    if host not in LOOPBACK:
        raise InvalidSettings(
            f"with auth off every caller is an admin, so Kiln listens only on loopback, not on {host}",
            hint="Set KILN_AUTH_ENABLED=true (and create a token: `kiln token create NAME`), or keep --host 127.0.0.1.",
        )
    if settings.allowed_hosts:
        return settings
    return settings.model_copy(update={"allowed_hosts": "127.0.0.1,localhost,[::1]"})  # any port


@click.command("api")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--workers", default=1, show_default=True, type=int, help="uvicorn worker processes.")
@click.option("--access-log/--no-access-log", default=True, show_default=True)
@click.option(
    "--http",
    "http_impl",
    type=click.Choice(["auto", "h11", "httptools"]),
    default="auto",
    show_default=True,
    help="HTTP parser (auto: httptools when installed).",
)
@handle_errors
def api_cmd(host: str, port: int, workers: int, access_log: bool, http_impl: str) -> None:
    """Run the HTTP API against KILN_DATABASE_URL, KILN_BROKER_URL, KILN_REPOSITORY, KILN_ARTIFACT_STORE."""
    import uvicorn

    settings = _open_api_settings(_settings(), host)
    # proxy_headers off: uvicorn would believe X-Forwarded-* from 127.0.0.1 by default; the app
    # believes exactly KILN_TRUSTED_PROXIES instead (api.app).
    opts: dict[str, Any] = {
        "host": host,
        "port": port,
        "access_log": access_log,
        "http": http_impl,
        "proxy_headers": False,
    }
    if workers > 1:
        # Each process builds its own app from the environment.
        if settings.allowed_hosts:
            os.environ["KILN_ALLOWED_HOSTS"] = settings.allowed_hosts
        uvicorn.run("api.app:create_app", factory=True, workers=workers, **opts)
        return
    from api.app import create_app

    uvicorn.run(create_app(settings), **opts)


@click.command("worker")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    help="Engine whose queue to serve (repeatable; default: all installed); `tune` for the tune queue alone.",
)
@click.option("--concurrency", default=1, show_default=True, type=int, help="Steps run at once.")
@click.option("--loglevel", default="INFO", show_default=True)
@handle_errors
def worker_cmd(engines: tuple[str, ...], concurrency: int, loglevel: str) -> None:
    """Run a Celery worker on the queues kiln.<engine>; refuses engines whose SDK is missing (exit 2)."""
    from services.errors import EngineUnavailable
    from workers.probe import resolve_served

    try:
        resolve_served(list(engines))
    except EngineUnavailable as err:
        console.print(f"[bold red]error {err.code}[/]: {err.message}")
        console.print(f"[yellow]hint[/]: {err.hint}")
        sys.exit(EXIT_INPUT)
    from workers.main import run_worker

    run_worker(_settings(), engines, concurrency=concurrency, loglevel=loglevel)


@click.command("migrate")
@handle_errors
def migrate_cmd() -> None:
    """Apply the job store's database migrations (Alembic upgrade head)."""
    from services.jobs.db import database_url
    from services.jobs.migrate import upgrade

    url = database_url(_settings())
    upgrade(url)
    shown = url.split("@")[-1] if "@" in url else url
    out.print(f"job store at {shown} is up to date")


def _die_with_parent() -> None:
    # The embedded worker must not outlive `kiln serve` (Linux: SIGTERM when we exit).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _WorkerSupervisor(threading.Thread):
    """Keeps the embedded worker process running; restarts it if it dies."""

    def __init__(self, argv: list[str], env: dict[str, str], embedded: Any = None) -> None:
        super().__init__(name="kiln-serve-worker", daemon=True)
        self.argv, self.env, self.embedded = argv, env, embedded
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.embedded is not None:
                self.embedded.started()  # its engines are starting (again): /readyz and admission wait
            self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
            code = self.proc.wait()
            if self.stopping.is_set():
                return
            console.print(f"[yellow]embedded worker exited with {code}; restarting[/]")
            time.sleep(1.0)

    def stop(self, timeout: float = 20.0) -> None:
        self.stopping.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # Celery's warm shutdown: it stops its own pool
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--repo",
    default="model-repository",
    show_default=True,
    help="Model repository: a directory or s3://bucket/prefix.",
)
@click.option(
    "--concurrency",
    default=2,
    show_default=True,
    type=int,
    help="Steps the worker runs at once (a job's targets branch after their shared steps).",
)
@handle_errors
def serve_cmd(host: str, port: int, repo: str, concurrency: int) -> None:
    """Run the API and a worker for every engine installed here: SQLite, local directories, no broker server."""
    import uvicorn

    from api.app import create_app
    from api.readiness import EmbeddedWorkers
    from services.jobs.db import database_url
    from services.jobs.migrate import upgrade
    from services.repository.local import LocalModelRepository
    from services.storage.factory import repository_from_url
    from workers.probe import resolve_engines

    # The same factory as everywhere: s3:// is S3 (never a folder named "s3:"), an unknown scheme is refused.
    repository = repository_from_url(repo, _settings())
    repository.model_names()  # reach it now, not at the first publish
    if isinstance(repository, LocalModelRepository):
        repo = str(repository.root)  # absolute: the worker processes share it
    settings = _settings(repository=repo, database_url="", broker_url="", artifact_store="")
    settings = _open_api_settings(settings, host)
    upgrade(database_url(settings))
    engines = resolve_engines([])
    env = {
        **os.environ,
        "KILN_REPOSITORY": repo,
        "KILN_DATABASE_URL": "",
        "KILN_BROKER_URL": "",
        "KILN_ARTIFACT_STORE": "",
        "KILN_CACHE_DIR": str(settings.cache_dir),
    }
    # `-c`, not `-m cli.main`: run as __main__, cli/main.py would be a second copy of the group.
    argv = [sys.executable, "-c", "from cli.main import main; main()", "worker", "--concurrency", str(concurrency)]
    for e in engines:
        argv += ["--engine", e]
    from workers.queues import serves_tune

    # The worker takes tune jobs too when it runs several tunable engines (workers/main.py).
    embedded = EmbeddedWorkers([*engines, *(["tune"] if serves_tune(engines) else [])], settings.embedded_start_seconds)
    supervisor = _WorkerSupervisor(argv, env, embedded)
    supervisor.start()
    console.print(f"kiln serve: API on http://{host}:{port}, worker for {', '.join(engines)}, repository {repo}")
    if not settings.auth_enabled:
        console.print(
            "kiln serve: auth is off: anyone on this machine is an admin; other sites' pages may not change anything"
        )
    try:
        uvicorn.run(create_app(settings, embedded=embedded), host=host, port=port, proxy_headers=False)
    finally:
        supervisor.stop()


@click.group("token")
def token_group() -> None:
    """Manage API tokens (used when KILN_AUTH_ENABLED=true)."""


@token_group.command("create")
@click.argument("name")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    type=click.Choice(["read", "write", "admin"]),
    help="Scopes (repeatable; default read and write). admin sees and changes every tenant's jobs.",
)
@click.option(
    "--tenant",
    default="default",
    show_default=True,
    help="The tenant (team) the token acts for: it sees and changes only that tenant's jobs, logs, "
    "artifacts and model names.",
)
@click.option(
    "--max-running",
    type=click.IntRange(min=1),
    default=None,
    help="Jobs of the tenant that run at once when this token submits them (default KILN_TENANT_MAX_RUNNING_JOBS).",
)
@click.option(
    "--max-queued",
    type=click.IntRange(min=1),
    default=None,
    help="Jobs of the tenant waiting to start past which this token's submissions get 429 QUOTA_EXCEEDED "
    "(default KILN_TENANT_MAX_QUEUED_JOBS).",
)
@handle_errors
def token_create(
    name: str, scopes: tuple[str, ...], tenant: str, max_running: int | None, max_queued: int | None
) -> None:
    """Create a token NAME of TENANT and print it once (only its hash is stored)."""
    from services.jobs.db import database_url
    from services.jobs.tokens import TokenStore

    token = TokenStore(database_url(_settings())).create_token(
        name, scopes or ("read", "write"), tenant, max_running_jobs=max_running, max_queued_jobs=max_queued
    )
    click.echo(token)  # plain: scripts capture it


@token_group.command("revoke")
@click.argument("name")
@handle_errors
def token_revoke(name: str) -> None:
    """Revoke the token NAME (its dashboard sessions end with it)."""
    from services.errors import NotFound
    from services.jobs.db import database_url
    from services.jobs.tokens import TokenStore

    if not TokenStore(database_url(_settings())).revoke_token(name):
        raise NotFound(f"no live token named {name!r}", hint="List them with `kiln token list`.")
    out.print(f"revoked {name}")


@token_group.command("list")
@handle_errors
def token_list() -> None:
    """List tokens (names, tenants, scopes, state; never the tokens)."""
    from services.jobs.db import database_url
    from services.jobs.tokens import TokenStore

    for t in TokenStore(database_url(_settings())).list_tokens():
        state = f"revoked {t.revoked_at:%Y-%m-%d}" if t.revoked_at else "active"
        quota = f"running {t.max_running_jobs or 'default'}, queued {t.max_queued_jobs or 'default'}"
        out.print(f"{t.name}\t{t.tenant}\t{t.scopes}\t{state}\t{quota}")


#: What cli.main registers.
COMMANDS = (api_cmd, worker_cmd, migrate_cmd, serve_cmd, token_group)
