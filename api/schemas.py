"""Public request and response schemas of the API, named for their role."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.formats import Format
from services.spec import CompileSpec

__all__ = [
    "EnginePublic",
    "EnginesPublic",
    "ErrorPublic",
    "HealthPublic",
    "JobAccepted",
    "JobPublic",
    "JobStatus",
    "JobsPublic",
    "ModelPublic",
    "PlanPublic",
    "PlanRequest",
    "PlanStepPublic",
    "QuotaPublic",
    "ReadyPublic",
    "RepositoryPublic",
    "ResubmitRequest",
    "SourcePublic",
    "StepPublic",
    "TargetPublic",
    "VersionPublic",
    "WorkerPublic",
]

#: GET /jobs's sort orders: a column, `-` first for descending.
JobSort = Literal["created_at", "-created_at", "finished_at", "-finished_at", "name", "-name", "status", "-status"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
StepStatus = Literal["pending", "queued", "running", "succeeded", "failed", "skipped", "cancelled"]


class ErrorPublic(BaseModel):
    """Every 4xx/5xx body: a stable code, what happened, what to do."""

    code: str = Field(description="Stable error code, e.g. INVALID_SPEC, UNSAFE_INPUT, NOT_FOUND.")
    message: str
    hint: str
    details: dict[str, Any] | None = None


class JobAccepted(BaseModel):
    """Answer to POST /compile (202): where to follow the job."""

    id: str
    status: JobStatus = "queued"
    url: str = Field(description="The job's resource, also in the Location header.")
    events_url: str


class SourcePublic(BaseModel):
    filename: str
    sha256: str
    format: str
    detected_as: str
    size: int


class StepPublic(BaseModel):
    """One plan step of a job and how it ran."""

    id: str
    kind: str
    engine: str
    queue: str
    target: str | None
    status: StepStatus
    attempt: int = Field(description="How many times a worker claimed the step (more than 1 after a worker loss).")
    worker: str | None
    cached: bool = Field(description="The output came from the content-addressed cache; nothing was converted.")
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None
    error: ErrorPublic | None
    artifact_uri: str | None = Field(description="Where the step's output artifact lives in the artifact store.")
    report: dict[str, Any] | None = Field(description="What the step reported: passes, parity, benchmark, publication.")


class TargetPublic(BaseModel):
    """One target's outcome: route, status, parity, benchmark, artifact."""

    target: str
    route: str
    status: Literal["pending", "running", "succeeded", "failed", "cancelled"]
    steps: list[str] = Field(description="Ids of the steps this target needs, in order (shared ones included).")
    error: ErrorPublic | None = Field(
        default=None,
        description="Why the target failed: PARITY_FAILED (outputs differ from the source's beyond the tolerances), "
        "ACCURACY_DROP_EXCEEDED (the task metric on the spec's labelled data dropped past evaluation.max_drop; "
        "details.evaluation holds both scores), CONVERSION_FAILED, SLOWER_THAN_FP32, TIMEOUT, CANCELLED...",
    )
    parity: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = Field(
        default=None,
        description="The spec's evaluation: metric, output, samples, the source's and the artifact's scores, "
        "drop, max_drop, passed.",
    )
    benchmark: list[dict[str, Any]] = Field(default_factory=list)
    warnings: list[str] = Field(
        default_factory=list, description="Fallbacks the export took (e.g. dynamic-range int8), also in the manifest."
    )
    vs_fp32: dict[str, Any] | None = Field(
        default=None, description="fp16/int8 timed against fp32 on the same engine: rows, verdict, which to deploy."
    )
    published: dict[str, Any] | None = Field(default=None, description="Repository name, version and URI.")
    artifact_uri: str | None = None
    download_url: str | None = Field(default=None, description="GET this for a tar of the exported artifact.")
    attempts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Each route tried, in order: rank, route, status, and for a failed one its step, tool, code, message.",
    )
    device_check: dict[str, Any] | None = Field(
        default=None,
        description="A GPU-bound target (serving.onnxruntime_device: gpu, options.tvm.cuda_arch): checked_on 'gpu' "
        "with the device (name, compute capability, memory, driver, CUDA) and its parity and benchmark there, or "
        "'cpu' when no GPU worker checked it (a warning says so). None for a target that runs on the CPU.",
    )


class JobPublic(BaseModel):
    """A job: its spec, plan, per-step runs and per-target results."""

    id: str
    status: JobStatus
    name: str
    tenant: str = Field(description="The tenant (team) the job belongs to: its submitting token's.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    server_seconds: float | None = Field(description="finished_at - created_at: the job's time inside the service.")
    cached: bool | None = Field(description="Every step came from the cache (an identical resubmission).")
    source: SourcePublic
    spec: dict[str, Any]
    plan: dict[str, Any]
    targets: dict[str, TargetPublic]
    steps: list[StepPublic]
    error: ErrorPublic | None = None
    kind: Literal["compile", "tune"] = Field(default="compile", description="POST /compile's job, or POST /tune's.")
    tune: dict[str, Any] | None = Field(
        default=None,
        description="A tune job's search, once it ran (as `kiln tune --json` prints it): objective, candidates "
        "(target, precision, settings, batch, status, p50_ms, p99_ms, throughput...), recommendation (with "
        "runner_up, margin and serving), profiles, cache reuse, wall time. Its `tune` target is the "
        "recommendation's artifact.",
    )


class JobsPublic(BaseModel):
    """One page of jobs, newest first, and how many match."""

    data: list[JobPublic]
    count: int


class ResubmitRequest(BaseModel):
    """POST /jobs/{id}/resubmit: an edited spec, or none for the job's own."""

    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] | None = Field(
        default=None, description="A CompileSpec to use instead of the job's (validated like an upload's)."
    )


class PlanRequest(BaseModel):
    """A dry run: what a spec would do with a model of ``source_format``."""

    model_config = ConfigDict(extra="forbid")

    source_format: Format = Field(description="The format the model would be detected as.")
    spec: CompileSpec


class PlanStepPublic(BaseModel):
    id: str
    kind: str
    engine: str
    queue: str
    inputs: dict[str, str]
    after: list[str] = Field(default_factory=list)
    target: str | None
    tool: str
    fallback: bool = Field(default=False, description="Runs only when the routes before it failed.")


class PlanPublic(BaseModel):
    """The route per target and the queues its steps would take."""

    source_format: str
    routes: dict[str, str]
    shared_steps: list[str]
    steps: list[PlanStepPublic]
    fallback_routes: dict[str, list[str]] = Field(
        default_factory=dict, description="Per target, the routes tried in order when the first one fails."
    )
    queues: list[str] = Field(description="The queues the first-choice routes take.")
    engines_without_workers: list[str] = Field(
        description="Engines this plan needs that no live worker serves right now (the job would wait)."
    )


class WorkerPublic(BaseModel):
    hostname: str
    engines: list[str]
    concurrency: int
    pid: int
    started_at: datetime
    heartbeat_at: datetime


class EnginePublic(BaseModel):
    name: str
    queue: str
    workers: int = Field(description="Live workers serving this engine's queue.")
    versions: dict[str, str] = Field(description="Tool versions reported by a live worker.")
    devices: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The GPUs its live workers run on (the GPU engine): name, compute capability, arch, memory "
        "(MiB), driver and CUDA version, from each worker's probe.",
    )


class EnginesPublic(BaseModel):
    engines: list[EnginePublic]
    workers: list[WorkerPublic]


class SignatureProblemPublic(BaseModel):
    code: str = Field(description="FILE_MISSING, FILE_REPLACED, FILE_MODIFIED or FILE_UNSIGNED.")
    path: str
    message: str


class SignaturePublic(BaseModel):
    """Whether a version still holds the files Kiln signed (verified when they changed since the last look)."""

    status: Literal["verified", "unsigned", "foreign", "invalid", "mismatch"] = Field(
        description="verified: Kiln's signature and every file matches it; unsigned: no signature; foreign: signed "
        "by a key this service does not trust; invalid: the signature does not verify; mismatch: files differ "
        "from the ones signed (missing, replaced, modified or added)."
    )
    code: str = Field(
        description="VERIFIED, UNSIGNED, SIGNATURE_FOREIGN, SIGNATURE_INVALID, or the most serious file problem "
        "(FILE_MISSING, FILE_REPLACED, FILE_MODIFIED, FILE_UNSIGNED): what `kiln verify` reports."
    )
    message: str
    key_id: str | None = Field(default=None, description="SHA-256 of the public key the signature names.")
    problems: list[SignatureProblemPublic] = Field(default_factory=list)


class VersionPublic(BaseModel):
    version: int
    uri: str = Field(
        description="Where the version is: for an admin, in the repository itself (a directory or s3:// URL); for "
        "a tenant, where the serving engines find it (<serving root>/<root>/<name>/<version>, or that path alone)."
    )
    published_at: str | None = None
    precision: str | None = None
    source_sha256: str | None = None
    job_id: str | None = None
    signature: SignaturePublic | None = Field(
        default=None, description="The version's signature and whether its files still match it."
    )


class ModelPublic(BaseModel):
    name: str
    root: str = Field(description="The server root it is published under: triton, tfserving or tflite.")
    target: str | None
    format: str | None
    versions: list[VersionPublic]


class RepositoryPublic(BaseModel):
    uri: str = Field(
        description="The repository's location (admins), or the serving root in force (tenants; may be empty)."
    )
    models: list[ModelPublic]


class QuotaPublic(BaseModel):
    """A tenant's jobs against its quotas (services/jobs/quotas.py)."""

    tenant: str
    running: int = Field(description="Jobs of the tenant running now.")
    max_running: int = Field(description="Jobs of the tenant that run at once; more wait, queued.")
    queued: int = Field(description="Jobs of the tenant accepted and waiting to start.")
    max_queued: int = Field(description="Waiting jobs past which a submission is refused (429 QUOTA_EXCEEDED).")


class HealthPublic(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyPublic(BaseModel):
    status: Literal["ready", "starting", "unavailable"]
    checks: dict[str, str] = Field(
        description="broker, database, storage (and workers, under `kiln serve`): 'ok' or what failed; to a caller "
        "without a token (auth on), 'ok' or 'fail'."
    )
    starting: list[str] = Field(
        default_factory=list,
        description="Under `kiln serve`: engines whose own worker is still starting (jobs for them are accepted "
        "and wait); empty to a caller without a token (auth on).",
    )
