"""Accept an uploaded model: validate, detect, plan, store the source, record the job, enqueue.

Runs in a worker thread (it hashes, extracts and copies files). Everything a user can get
wrong is checked before the job is recorded, so a refused upload leaves nothing behind and
an accepted one is durable before the 202 goes out. The job and its first queued steps are
recorded in one transaction, then announced on the broker.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from api.auth import Principal
from api.readiness import EmbeddedWorkers
from api.upload import ReceivedFile, Upload
from services import descriptors
from services.errors import (
    EngineUnavailable,
    Forbidden,
    InvalidSpec,
    KilnError,
    ServiceUnavailable,
    SourceUnreadable,
    UnsupportedFormat,
)
from services.formats import DetectedSource, Format, open_source, safe_extract
from services.formats.archives import archive_kind
from services.graph.device_checks import plans_device_checks
from services.graph.planner import Plan, plan_routes
from services.graph.registry import Registry, load_entry
from services.jobs.idempotency import IdempotencyClaim
from services.jobs.quotas import TenantQuota
from services.jobs.store import JobStore, NewJob
from services.jobs.webhooks import WebhookStore
from services.jobs.worker_registry import WorkerRegistry
from services.pipeline.local import default_model_name
from services.repository.base import ModelRepository
from services.repository.publish import configured_serving_root, normal_serving_root
from services.spec import CompileSpec, load_spec
from services.storage.base import ArtifactStore
from services.tune.plan import replan_tune
from services.validation.evaluation import inspect_evaluation_file
from services.webhooks import WebhookPolicy, new_webhook, stored_spec
from workers.queues import enqueue_steps

__all__ = ["Planner", "check_serving_root", "live_engines", "prepare_job", "resubmit", "start_job", "submit_job"]

#: Plans a job from its detected source, its spec and the default model name.
Planner = Callable[[DetectedSource, CompileSpec, str], Plan]

log = logging.getLogger("kiln.api")


def _open_vetted(path: Path, work: Path, override: Any, sha256: str, vet: bool = True) -> DetectedSource:
    """Detect the upload; every archive's members are vetted, whatever it turns out to hold.

    open_source extracts (and so vets) the archives it unpacks; an archive it does not
    recognise, or one its loader reads whole (Keras, TorchScript, torch.export), is vetted
    here, so ``..``, absolute paths, links and bombs are UNSAFE_INPUT in every case. ``vet``:
    the format's own vetting of the graph (off only in tests of the sandbox).
    """
    kind = archive_kind(path)
    try:
        source = open_source(path, work, override, sha256=sha256, vet=vet)  # hashed while it streamed in
    except UnsupportedFormat:
        if kind:
            safe_extract(path, work / "vet")
        raise
    if kind and source.path == path:
        safe_extract(path, work / "vet")
    return source


def _target_preflights(source: DetectedSource, spec: CompileSpec) -> None:
    """Run each requested target's submission check (its descriptor's ``preflight``), e.g. TensorRT's parser."""
    targets = descriptors.registry().targets
    for target in spec.targets:
        entry = targets[target.value].preflight
        if entry is not None:
            load_entry(entry)(source, spec)


def _check_spec_inputs(source: DetectedSource, spec: CompileSpec) -> None:
    """Refuse, now (422) rather than in its first step, spec ``inputs`` an ONNX model does not have and
    inputs it needs real sample data for (services/validation/onnx_source.py).

    Other formats are checked by the reference step, the first thing a job runs, with the same rules.
    """
    if source.format is not Format.ONNX:
        return
    from services.validation.onnx_source import check_onnx_inputs

    check_onnx_inputs(source.path, spec)


def check_serving_root(spec: CompileSpec, principal: Principal, repository: ModelRepository | None) -> None:
    """Refuse (FORBIDDEN) a non-admin job whose ``serving.root`` differs from the deployment's.

    The serving root is the base path of every model in ovms/config.json and
    tfserving/models.config, other tenants' included, and it is recorded for later publishes:
    it is the operator's setting (KILN_SERVING_ROOT, or an admin's job), not a tenant's. A job
    may name the root already in force (a spec shared with `kiln compile` keeps working).
    """
    requested = spec.serving.root
    if requested is None or repository is None or principal.sees_all:
        return
    configured = configured_serving_root(repository)
    if configured is not None and normal_serving_root(requested) == configured:
        return
    raise Forbidden(
        f"serving.root {requested!r} would move where every model of this repository is served from "
        f"(in force: {configured or 'the repository location'}); only the deployment sets it",
        hint="Leave serving.root out of the spec: the service's KILN_SERVING_ROOT applies. An admin token may change it.",
        field="serving.root",
    )


def _require_workers(plan: Plan, spec: CompileSpec, live_engines: Collection[str] | None) -> None:
    """Refuse a job an engine with no live worker would leave waiting, unless the spec says to wait."""
    if live_engines is None or spec.wait_for_workers:
        return
    # Fallback routes run only when the chosen one fails: their engines are not needed up front.
    needed = [s for s in plan.steps if not s.fallback]
    missing = sorted({s.engine for s in needed} - set(live_engines))
    if missing:
        queues = sorted({s.queue for s in needed if s.engine in missing})
        raise EngineUnavailable(
            f"no live worker serves {', '.join(missing)} (queue {', '.join(queues)}), which this job needs",
            hint="Start a worker for it (`kiln worker --engine <engine>`; GET /engines lists the live ones), "
            'or set "wait_for_workers": true in the spec to queue the job until one comes '
            "(up to KILN_WORKER_WAIT_SECONDS).",
            engines=missing,
            queues=queues,
        )


def _evaluation_upload(upload: Upload, spec: CompileSpec) -> ReceivedFile | None:
    """Return the `evaluation` part, checked as labelled data; refuse a spec and an upload that do not go together."""
    evaluation = upload.files.get("evaluation")
    if spec.evaluation is not None and evaluation is None:
        raise InvalidSpec(
            "spec.evaluation names a file, but the server reads no paths: upload it as the `evaluation` part",
            hint="curl ... -F evaluation=@eval.npz",
            errors=[{"field": "evaluation", "problem": "upload the file as the `evaluation` part"}],
        )
    if evaluation is not None and spec.evaluation is None:
        raise InvalidSpec(
            "the request uploads an `evaluation` file, but the spec has no `evaluation` to say how to score it",
            hint='Add "evaluation": {"data": "eval.npz", "metric": "top1", "max_drop": 0.01} to the spec.',
            errors=[{"field": "evaluation", "problem": "missing: metric and max_drop for the uploaded file"}],
        )
    if evaluation is not None:
        # Its layout is checked now (a bad file is refused before anything is queued); its labels
        # against the model's output by the reference step, which runs the source.
        inspect_evaluation_file(evaluation.path)
    return evaluation


def prepare_job(
    upload: Upload,
    *,
    store: ArtifactStore,
    registry: Registry,
    use_cache: bool,
    principal: Principal,
    scratch_root: Path,
    live_engines: Collection[str] | None = None,
    vet: bool = True,
    webhooks: WebhookPolicy | None = None,
    planner: Planner | None = None,
    repository: ModelRepository | None = None,
    quota: TenantQuota | None = None,
) -> NewJob:
    """Validate, detect and plan ``upload`` and put its files in the store; return the job to record.

    ``planner`` plans the job from its detected source, spec and default name (default: the
    compile planner's routes; a tune job's is services/tune/plan.py's).

    ``live_engines``: the engines with a live worker; a job needing another is refused
    (ENGINE_UNAVAILABLE) unless its spec sets ``wait_for_workers``. None skips the check.
    ``webhooks``: the operator's rules for the spec's notify (none: no internal networks,
    no default secret). ``repository``: the service's, whose serving root a tenant's job may
    not change (:func:`check_serving_root`; None: no check). ``quota``: the caller's
    (services/jobs/quotas.py), checked when the job is recorded; None: none.
    """
    spec_text = upload.fields.get("spec")
    if spec_text is None:
        raise InvalidSpec(
            "the request has no `spec` part",
            hint='Send the CompileSpec as a form field: -F \'spec={"targets":["onnxruntime"]}\'.',
            errors=[{"field": "spec", "problem": "missing"}],
        )
    spec = load_spec(spec_text)
    model = upload.files.get("model")
    if model is None:
        raise SourceUnreadable("the request has no `model` file part", hint="Send the model with -F model=@path.")
    calibration = upload.files.get("calibration")
    if spec.calibration and calibration is None:
        raise InvalidSpec(
            "spec.calibration names a file, but the server reads no paths: upload it as the `calibration` part",
            hint="curl ... -F calibration=@calibration.npz",
            errors=[{"field": "calibration", "problem": "upload the file as the `calibration` part"}],
        )
    if calibration is not None:
        spec = spec.model_copy(update={"calibration": calibration.filename})
    evaluation = _evaluation_upload(upload, spec)
    if evaluation is not None and spec.evaluation is not None:
        spec = spec.model_copy(update={"evaluation": spec.evaluation.model_copy(update={"data": evaluation.filename})})
    check_serving_root(spec, principal, repository)
    webhook = new_webhook(spec, webhooks or WebhookPolicy())
    scratch_root.mkdir(parents=True, exist_ok=True)
    default_name = default_model_name(model.path)  # while the file is there: it is moved into the store below
    with tempfile.TemporaryDirectory(prefix="detect-", dir=scratch_root) as tmp:
        # Detection and archive vetting (UNSAFE_INPUT) happen here, before anything is stored.
        source = _open_vetted(model.path, Path(tmp), spec.source_format, model.sha256, vet)
        if planner is None:
            # Routes only through engines a worker serves: a fallback queued for nobody would wait
            # there (a job that says it waits for workers plans every route and waits, bounded).
            served = None if live_engines is None or spec.wait_for_workers else live_engines
            # GPU-bound targets get a check on the GPU worker's queue when one is live (or the spec requires it).
            gpu = plans_device_checks(spec, live_engines)
            plan = plan_routes(source.format, spec, registry, default_name=default_name, engines=served, gpu_worker=gpu)
        else:
            plan = planner(source, spec, default_name)
        # What is wrong with the request is said first; a missing worker only after.
        _check_spec_inputs(source, spec)
        _target_preflights(source, spec)
        _require_workers(plan, spec, live_engines)
    source_key = f"sources/{model.sha256}"
    store.put_dir(source_key, model.path.parent, move=True)  # the upload's own directory, discarded next
    calibration_key = None
    if calibration is not None:
        calibration_key = f"sources/{calibration.sha256}"
        store.put_dir(calibration_key, calibration.path.parent, move=True)
    evaluation_key = None
    if evaluation is not None:
        evaluation_key = f"sources/{evaluation.sha256}"
        store.put_dir(evaluation_key, evaluation.path.parent, move=True)
    return NewJob(
        name=spec.name or default_name,
        spec=stored_spec(spec),
        plan=plan,
        source_key=source_key,
        source_sha256=model.sha256,
        source_filename=model.filename,
        source_format=source.format.value,
        source_seen=source.seen,
        source_size=model.size,
        calibration_key=calibration_key,
        calibration_sha256=calibration.sha256 if calibration else None,
        calibration_filename=calibration.filename if calibration else None,
        evaluation_key=evaluation_key,
        evaluation_sha256=evaluation.sha256 if evaluation else None,
        evaluation_filename=evaluation.filename if evaluation else None,
        use_cache=use_cache,
        owner=principal.name,
        tenant=principal.tenant,
        webhook=webhook,
        quota=quota,
    )


def submit_job(
    upload: Upload,
    *,
    jobs: JobStore,
    workers: WorkerRegistry,
    store: ArtifactStore,
    registry: Registry,
    celery_app: Any,
    use_cache: bool,
    principal: Principal,
    scratch_root: Path,
    worker_max_age: float | None = None,
    vet: bool = True,
    idempotency: IdempotencyClaim | None = None,
    embedded: EmbeddedWorkers | None = None,
    webhooks: WebhookPolicy | None = None,
    planner: Planner | None = None,
    prepare: Callable[[Upload, set[str] | None], Planner] | None = None,
    repository: ModelRepository | None = None,
    quota: TenantQuota | None = None,
) -> str:
    """Accept ``upload`` for ``principal``'s tenant: record the job with its first steps queued, enqueue them; return its id.

    With ``worker_max_age``, a job needing an engine without a worker that heartbeated that
    recently is refused unless its spec says to wait. The upload's temporary files are
    removed whatever happens. ``idempotency``: the request's key, recorded with the job
    (KeyTaken when another job holds it; nothing is recorded then). ``embedded``: `kiln
    serve`'s own workers; the engines they are still starting count as served (the job waits).
    ``planner``: as for :func:`prepare_job`; ``prepare`` returns it from the upload and the live
    engines (None: no check), once those are known (a tune's default targets are the live ones).
    """
    try:
        live = live_engines(workers, worker_max_age, embedded)
        if prepare is not None:
            planner = prepare(upload, live)
        new = prepare_job(
            upload,
            store=store,
            registry=registry,
            use_cache=use_cache,
            principal=principal,
            scratch_root=scratch_root,
            live_engines=live,
            vet=vet,
            webhooks=webhooks,
            planner=planner,
            repository=repository,
            quota=quota,
        )
        advance = jobs.submit_job(new, any_names=principal.sees_all, idempotency=idempotency)
        start_job(jobs, celery_app, new.id, advance.queued)
    finally:
        upload.cleanup()
    return new.id


def live_engines(
    workers: WorkerRegistry, worker_max_age: float | None, embedded: EmbeddedWorkers | None = None
) -> set[str] | None:
    """Return the engines a live worker serves (with `kiln serve`'s still starting); None without a check."""
    if worker_max_age is None:
        return None
    live = {e for w in workers.live_workers(worker_max_age) for e in w.engines}
    if embedded is not None:
        live |= set(embedded.starting(live))
    return live


def start_job(jobs: JobStore, celery_app: Any, job_id: str, queued: list[tuple[str, str]]) -> None:
    """Announce the job's ``queued`` steps on the broker; a broker outage fails the job and answers 503."""
    try:
        enqueue_steps(celery_app, job_id, queued)
    except KilnError:
        raise
    except Exception as exc:
        err = ServiceUnavailable(f"the broker did not take job {job_id}: {type(exc).__name__}: {exc}", job_id=job_id)
        log.error("%s", err)
        jobs.fail_job(job_id, err)
        raise err from exc


def resubmit(
    jobs: JobStore,
    store: ArtifactStore,
    registry: Registry,
    celery_app: Any,
    job_id: str,
    spec: dict[str, Any] | None,
    *,
    principal: Principal,
    use_cache: bool,
    idempotency: IdempotencyClaim | None = None,
    webhooks: WebhookPolicy | None = None,
    repository: ModelRepository | None = None,
    quota: TenantQuota | None = None,
) -> str:
    """Queue a new job on ``job_id``'s stored source with its spec, or ``spec``; return the new job's id.

    The source is already in the store under its content address, so nothing is uploaded or
    detected again; the new spec is validated and planned like an upload's. Only a job of
    ``principal``'s tenant can be resubmitted (an admin: any), and the new job stays in
    that job's tenant. ``idempotency`` and ``webhooks`` as for :func:`submit_job` (without
    ``webhooks``, the process's settings'); a webhook to the same URL keeps the job's secret.
    """
    old = jobs.get_job(job_id, principal.tenant_filter)
    if not store.exists(old.source_key):
        raise SourceUnreadable(
            f"the source of job {job_id} is no longer in the artifact store", hint="Submit the model again."
        )
    new_spec = load_spec(spec if spec is not None else old.spec)
    check_serving_root(new_spec, principal, repository)
    if new_spec.calibration and not old.calibration_key:
        raise InvalidSpec(
            "spec.calibration is set, but the job being resubmitted had no calibration upload",
            hint="Submit with POST /compile and a `calibration` part.",
            errors=[{"field": "calibration", "problem": "no calibration file to reuse"}],
        )
    if new_spec.evaluation is not None and not old.evaluation_key:
        raise InvalidSpec(
            "spec.evaluation is set, but the job being resubmitted had no evaluation upload",
            hint="Submit with POST /compile and an `evaluation` part.",
            errors=[{"field": "evaluation", "problem": "no labelled data to reuse"}],
        )
    if new_spec.evaluation is not None and old.evaluation_filename:
        # The stored file is what is scored, whatever name the edited spec gives it.
        data = new_spec.evaluation.model_copy(update={"data": old.evaluation_filename})
        new_spec = new_spec.model_copy(update={"evaluation": data})
    name = new_spec.name or old.name
    webhook = None
    if new_spec.notify is not None:
        if webhooks is None:
            from services.settings import get_settings

            webhooks = WebhookPolicy.from_settings(get_settings())
        previous = WebhookStore(jobs.db).secret_for(job_id, new_spec.notify.url)
        webhook = new_webhook(new_spec, webhooks, previous)
    old_plan = Plan.from_dict(old.plan)
    if old_plan.kind == "tune":  # the same search again (over the spec's targets, which may be edited)
        plan = replan_tune(old_plan, [t.value for t in new_spec.targets], name)
    else:
        plan = plan_routes(Format(old.source_format), new_spec, registry, default_name=name)
    new = NewJob(
        name=name,
        spec=stored_spec(new_spec),
        plan=plan,
        source_key=old.source_key,
        source_sha256=old.source_sha256,
        source_filename=old.source_filename,
        source_format=old.source_format,
        source_seen=old.source_seen,
        source_size=old.source_size,
        calibration_key=old.calibration_key if new_spec.calibration else None,
        calibration_sha256=old.calibration_sha256 if new_spec.calibration else None,
        calibration_filename=old.calibration_filename if new_spec.calibration else None,
        evaluation_key=old.evaluation_key if new_spec.evaluation else None,
        evaluation_sha256=old.evaluation_sha256 if new_spec.evaluation else None,
        evaluation_filename=old.evaluation_filename if new_spec.evaluation else None,
        use_cache=use_cache,
        owner=principal.name,
        tenant=old.tenant,
        webhook=webhook,
        quota=quota,
    )
    advance = jobs.submit_job(new, any_names=principal.sees_all, idempotency=idempotency)
    start_job(jobs, celery_app, new.id, advance.queued)
    return new.id
