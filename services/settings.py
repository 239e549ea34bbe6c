"""Kiln's settings: one pydantic-settings class shared by the CLI, the API and the workers.

Read through :func:`get_settings` (cached, overridable in tests), never as an import-time
global. Every field is settable as ``KILN_<FIELD>`` in the environment (compose.yaml and the
Helm chart's ConfigMap/Secret use exactly these names).
"""

from __future__ import annotations

import os
import re
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DEFAULT_PASSWORDS", "Environment", "Settings", "get_settings"]


class Environment(str, Enum):
    """Where Kiln runs: production refuses the unsafe defaults development allows."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


def _default_cache() -> Path:
    return Path.home() / ".cache" / "kiln"


def _default_data() -> Path:
    # XDG's data home: what must survive a cache wipe (the embedded job database).
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "kiln"


#: Passwords and keys that shipped as defaults somewhere (Kiln's own compose file before it
#: generated them, MinIO's, PostgreSQL's images' examples): production refuses them.
DEFAULT_PASSWORDS = frozenset(
    {"", "kiln", "kiln-minio-secret", "minioadmin", "postgres", "password", "secret", "admin", "changeme"}
    | {"change-me", "change-me-too"}
)
#: The shortest secret (admin token, session key) production accepts: 128 bits of hex or base64.
MIN_SECRET_CHARS = 32


def _url_password(url: str) -> str | None:
    """Return the password in a database URL (``scheme://user:password@host/db``), None without one."""
    m = re.match(r"^[^:/]+(?:\+[^:/]+)?://[^:@/]*:([^@/]*)@", url)
    return m.group(1) if m else None


#: Seconds a benchmark waits for its host to be quiet by default (services/steps/host_gate.py).
BENCH_QUIET_WAIT = 120.0


class Settings(BaseSettings):
    """Configuration from ``KILN_*`` environment variables (and an optional .env file)."""

    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=".env", extra="ignore")

    environment: Environment = Field(
        default=Environment.DEVELOPMENT, description="development | production; production refuses unsafe defaults."
    )
    secrets_dir: str = Field(
        default="",
        description="A directory of files named like these variables (KILN_DATABASE_URL, KILN_ADMIN_TOKEN, ...) "
        "whose contents are the values: compose's generated secrets. Read from the environment by get_settings "
        "before the rest; a variable set in the environment wins over its file.",
    )
    cache_dir: Path = Field(default_factory=_default_cache, description="Local scratch space and artifact cache.")
    data_dir: Path = Field(
        default_factory=_default_data,
        description="Kiln's own data that must outlive the cache: the embedded SQLite job database "
        "(~/.local/share/kiln, or $XDG_DATA_HOME/kiln).",
    )
    cache_max_bytes: int = Field(
        default=0,
        ge=0,
        description="Cap on the local artifact cache (<cache_dir>/store) in bytes; 0 = no cap. `kiln compile` prunes "
        "least recently used entries down to it after each job, `kiln cache prune` on demand.",
    )

    # --- where things live ---
    repository: str = Field(
        default="./model-repository", description="Model repository: a directory or s3://bucket/prefix."
    )
    artifact_store: str = Field(
        default="", description="Artifact store: a directory or s3://bucket/prefix; empty = <cache_dir>/store."
    )
    serving_root: str = Field(
        default="",
        description="Path at which serving engines see the repository, e.g. /models when it is mounted there "
        "in their containers: base_path in tfserving/models.config and ovms/config.json becomes "
        "<serving_root>/<root>/<name>. Empty = the repository's own location (a directory or s3:// URL). "
        "A job's spec (serving.root) or `kiln compile --serving-root` overrides it and is recorded in the "
        "repository's kiln-repository.json for later publishes.",
    )
    s3_endpoint_url: str = Field(default="", description="S3-compatible endpoint (MinIO, SeaweedFS); empty = AWS.")
    s3_region: str = Field(default="us-east-1", description="S3 region.")
    s3_access_key_id: str = Field(default="", description="S3 access key; empty = boto3's default chain.")
    s3_secret_access_key: SecretStr = Field(default=SecretStr(""), description="S3 secret key.")

    # --- service ---
    database_url: str = Field(
        default="", description="SQLAlchemy URL of the job store; empty = SQLite under data_dir (embedded default)."
    )
    broker_url: str = Field(
        default="", description="Celery broker URL (redis://...); empty = the embedded broker that needs no server."
    )
    max_upload_bytes: int = Field(default=4 * 1024**3, ge=1, description="Largest accepted model upload.")
    auth_enabled: bool = Field(
        default=False,
        description="Require API tokens on every endpoint but health. Off, every caller is an anonymous admin: "
        "only for `kiln serve` on a laptop's loopback (production refuses it).",
    )
    admin_token: SecretStr = Field(
        default=SecretStr(""),
        description="An admin token the API makes live at start (token `admin`, tenant `default`): compose "
        "generates it on first start, the Helm chart keeps it in its Secret. Empty = none; `kiln token create` "
        "makes the others.",
    )
    session_secret: SecretStr = Field(
        default=SecretStr(""),
        description="Key that signs the dashboard's session cookies and CSRF tokens; every API replica needs the "
        "same. Empty = a key generated on first use in <data_dir>/session-secret (development only).",
    )
    session_lifetime: float = Field(
        default=12 * 3600.0, gt=0, description="Seconds a dashboard session lasts after sign-in."
    )
    trusted_proxies: str = Field(
        default="",
        description="Comma-separated addresses or CIDRs of the reverse proxies (TLS-terminating ingress) whose "
        "X-Forwarded-Proto and X-Forwarded-For the API believes, or `*` for any. Empty = none: the scheme and "
        "client are the connection's own.",
    )
    allowed_origins: str = Field(
        default="",
        description="Comma-separated origins (scheme://host[:port]) besides the API's own from which a browser may "
        "send state-changing requests; any other Origin, and Sec-Fetch-Site: cross-site, is refused (FORBIDDEN).",
    )
    allowed_hosts: str = Field(
        default="",
        description="Comma-separated Host header values the API answers; empty = any. `kiln serve` with auth off "
        "answers only loopback names, so a DNS-rebinding page cannot reach it.",
    )
    step_soft_time_limit: int = Field(default=3600, ge=1, description="Seconds before a step is asked to stop.")
    step_hard_time_limit: int = Field(default=3900, ge=1, description="Seconds before a step is killed.")
    # Read by the step code from the environment (steps get no Settings): services/steps/host_gate.py.
    host_lock_dir: str = Field(
        default="",
        description="Directory of the host's step/benchmark locks; workers sharing it benchmark one at a time with "
        "no other step running. Empty = kiln-host-<uid> in the system temp dir.",
    )
    # Read by the step code from the environment, like host_lock_dir: services/tvm/_tuning.py.
    tvm_tuning_dir: str = Field(
        default="",
        description="The TVM tuning database steps share: one folder per tuned kernel (keyed by its content and the "
        "CPU target), reused by every later tvm job that meets the same kernel. Empty = kiln-tvm-tuning-<uid> in "
        "/var/tmp.",
    )
    bench_quiet_wait: float = Field(
        default=BENCH_QUIET_WAIT,
        ge=0,
        description="Seconds a benchmark waits for the other steps on its host to finish; then it runs anyway and "
        "its rows say alone: false.",
    )
    step_heartbeat_interval: float = Field(
        default=5.0, gt=0, description="Seconds between a running step's heartbeats in the job store."
    )
    step_stale_after: float = Field(
        default=60.0, gt=0, description="Seconds without a heartbeat after which a running step is requeued."
    )
    # --- fair sharing between tenants (services/jobs/quotas.py; a token may carry its own) ---
    tenant_max_running_jobs: int = Field(
        default=4,
        ge=1,
        description="Jobs of one tenant that run at once; its further jobs wait, queued, until one ends "
        "(`kiln token create --max-running` sets it per token).",
    )
    tenant_max_queued_jobs: int = Field(
        default=50,
        ge=1,
        description="Jobs of one tenant waiting to start; a submission past it is refused with 429 QUOTA_EXCEEDED "
        "(`kiln token create --max-queued` sets it per token).",
    )
    # --- untrusted models (docs/security.md) ---
    sandbox: Literal["auto", "bwrap", "landlock", "off"] = Field(
        default="auto",
        description="How steps that load or run a user's model are confined (services/sandbox): auto = the "
        "strongest this host allows (bubblewrap namespaces with Landlock per step, else Landlock alone); bwrap or "
        "landlock = require it (refuse to start without); off = run them unconfined.",
    )
    step_max_address_space: int = Field(
        default=0,
        ge=0,
        description="Bytes of address space a step process may map (RLIMIT_AS). 0: twice the host's memory, and no "
        "limit on a worker serving a GPU engine (CUDA maps the device's memory into the address space).",
    )
    step_max_cpu_seconds: float = Field(
        default=0,
        ge=0,
        description="CPU seconds (all threads) one step may use; past it the step is stopped (TIMEOUT). "
        "0: the soft time limit times the host's cores.",
    )
    step_max_processes: int = Field(
        default=2048,
        ge=16,
        description="Processes and threads a step's sandbox may run at once (RLIMIT_NPROC): a fork bomb stops there.",
    )
    step_max_open_files: int = Field(
        default=4096, ge=64, description="Files a step process may hold open at once (RLIMIT_NOFILE)."
    )
    step_max_output_bytes: int = Field(
        default=64 * 1024**3,
        ge=1024**2,
        description="The largest file a step may write (RLIMIT_FSIZE), and the most its output folder may hold.",
    )
    vet_uploads: bool = Field(
        default=True,
        description="Vet uploaded graphs per format at submission (file, network, printing and Python-calling "
        "ops refused with UNSAFE_INPUT). Turn off only to test the sandbox; production refuses false.",
    )
    worker_wait_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Seconds a queued step waits while its engine has no live worker before it fails with "
        "ENGINE_UNAVAILABLE (jobs are only accepted that way with the spec's wait_for_workers).",
    )

    embedded_start_seconds: float = Field(
        default=180.0,
        gt=0,
        description="`kiln serve`: seconds its own worker may take to start (after each restart). Meanwhile "
        "/readyz answers 503 starting and jobs for its engines are accepted and wait; after that an engine "
        "still missing is reported unavailable.",
    )

    # --- signed versions (services/repository/signing.py, docs/security.md) ---
    signing_key: SecretStr = Field(
        default=SecretStr(""),
        description="PEM of the EC private key (P-256, P-384 or P-521) that signs every published version with "
        "OpenSSF model-signing; `kiln secrets init` makes one (KILN_SIGNING_KEY in KILN_SECRETS_DIR). Empty = a "
        "key generated on first use in <data_dir>/signing-key.pem (development only; production requires it).",
    )
    signing_certificate: str = Field(
        default="",
        description="Optional PEM of an X.509 certificate for the signing key (key usage: digital signature, or "
        "extended key usage: code signing). Set, signatures carry it and KILN_SIGNING_CERTIFICATE_CHAIN, and "
        "verifiers check that chain to a CA they trust (KILN_SIGNING_TRUSTED_CAS, `kiln verify --ca`).",
    )
    signing_certificate_chain: str = Field(
        default="",
        description="PEM of the certificates between KILN_SIGNING_CERTIFICATE and its root CA, root last (optional).",
    )
    signing_trusted_cas: str = Field(
        default="",
        description="Comma-separated paths of PEM CA certificates a certificate-signed version must chain to. Empty: "
        "the last certificate of KILN_SIGNING_CERTIFICATE_CHAIN, else KILN_SIGNING_CERTIFICATE itself.",
    )
    signing_trusted_keys: str = Field(
        default="",
        description="Comma-separated paths of PEM public keys whose signatures also count as Kiln's (keys that "
        "signed older versions, before a rotation). The signing key's own public half is always trusted.",
    )

    # --- webhooks (the spec's notify; services/webhooks.py) ---
    webhook_secret: SecretStr = Field(
        default=SecretStr(""),
        description="HMAC-SHA256 key signing the webhooks of jobs whose notify has no secret of its own. Empty: "
        "such a job is refused (INVALID_SPEC).",
    )
    webhook_allow_networks: str = Field(
        default="",
        description="Comma-separated CIDRs (127.0.0.0/8, 10.1.2.0/24) that webhooks may reach although they are "
        "loopback, link-local or private; every other such address is refused, so a job cannot make the service "
        "probe its own network. Empty: public addresses only.",
    )
    webhook_attempts: int = Field(default=6, ge=1, le=50, description="Tries per webhook before giving up.")
    webhook_retry_seconds: float = Field(
        default=5.0,
        gt=0,
        description="Wait before a webhook's second try; doubled for each further one (up to 10 min).",
    )

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> Settings:
        if self.environment is Environment.PRODUCTION:
            problems = []
            if not self.auth_enabled:
                problems.append("KILN_AUTH_ENABLED must be true")
            if not self.database_url or self.database_url.startswith("sqlite"):
                problems.append("KILN_DATABASE_URL must name a server database (PostgreSQL)")
            if not self.broker_url:
                problems.append("KILN_BROKER_URL must name a broker (Redis)")
            if not self.vet_uploads or self.sandbox == "off":
                problems.append("KILN_VET_UPLOADS must be true and KILN_SANDBOX not off")
            if _url_password(self.database_url) in DEFAULT_PASSWORDS:
                problems.append("KILN_DATABASE_URL carries a default password")
            if self.s3_access_key_id and self.s3_secret_access_key.get_secret_value() in DEFAULT_PASSWORDS:
                problems.append("KILN_S3_SECRET_ACCESS_KEY is a default credential")
            if len(self.session_secret.get_secret_value()) < MIN_SECRET_CHARS:
                problems.append(f"KILN_SESSION_SECRET must be set (at least {MIN_SECRET_CHARS} characters)")
            if not self.signing_key.get_secret_value().strip():
                problems.append("KILN_SIGNING_KEY must be set (`kiln secrets init` makes one)")
            admin = self.admin_token.get_secret_value()
            if admin and (len(admin) < MIN_SECRET_CHARS or admin in DEFAULT_PASSWORDS):
                problems.append(f"KILN_ADMIN_TOKEN must be a generated token (at least {MIN_SECRET_CHARS} characters)")
            if problems:
                raise ValueError("unsafe production settings: " + "; ".join(problems))
        return self

    @property
    def trusted_proxy_list(self) -> list[str]:
        return _split(self.trusted_proxies)

    @property
    def allowed_origin_list(self) -> list[str]:
        return [o.rstrip("/").lower() for o in _split(self.allowed_origins)]

    @property
    def webhook_allowed_networks(self) -> list[str]:
        return _split(self.webhook_allow_networks)

    @property
    def signing_trusted_key_files(self) -> list[str]:
        return _split(self.signing_trusted_keys)

    @property
    def signing_trusted_ca_files(self) -> list[str]:
        return _split(self.signing_trusted_cas)

    @property
    def allowed_host_list(self) -> list[str]:
        return [h.lower() for h in _split(self.allowed_hosts)]

    @property
    def store_location(self) -> str:
        """Return the artifact store location, defaulting under the cache dir."""
        return self.artifact_store or str(self.cache_dir / "store")


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


@lru_cache
def get_settings() -> Settings:
    """Return the process's settings (tests call ``get_settings.cache_clear()`` to swap them).

    ``KILN_SECRETS_DIR`` names a directory of files named like the variables
    (``KILN_DATABASE_URL``, ``KILN_ADMIN_TOKEN``, ...): what compose's generated secrets
    volume holds. A variable set in the environment wins over its file.
    """
    secrets_dir = os.environ.get("KILN_SECRETS_DIR") or None
    # pydantic-settings' init argument for the secrets directory, which mypy's view of the class lacks.
    return Settings(_secrets_dir=secrets_dir)  # type: ignore[call-arg]
