"""The job store on SQLite and on the real PostgreSQL: migrations, guarded transitions, recovery, tokens, tenants."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from jobs_support import create_pg_database, migrated_pg
from sqlalchemy import select, text, update

from services.errors import (
    HTTP_STATUS,
    Forbidden,
    IdempotencyKeyReused,
    InvalidSpec,
    NotFound,
    QuotaExceeded,
    ServiceUnavailable,
)
from services.formats import Format
from services.graph.planner import plan_routes
from services.jobs.idempotency import KEY_LIFETIME, IdempotencyClaim, KeyTaken, KnownKey
from services.jobs.migrate import upgrade
from services.jobs.model_names import published_names
from services.jobs.models import DashboardSession, IdempotencyKey, Job, JobStep
from services.jobs.quotas import QuotaStore, TenantQuota
from services.jobs.scheduling import StepDeferred
from services.jobs.store import JobFilter, JobStore, NewJob
from services.jobs.stores import JobStores
from services.jobs.tokens import TokenStore, hash_token
from services.jobs.webhooks import NewWebhook
from services.spec import load_spec


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('jobs') / 'jobs.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def jobs(request: pytest.FixtureRequest, sqlite_url: str) -> JobStores:
    # One database per backend for the module; every test works on its own jobs.
    return JobStores.open(sqlite_url if request.param == "sqlite" else migrated_pg())


def _new_job(jobs: JobStores, targets: tuple[str, ...] = ("onnxruntime", "openvino")) -> str:
    spec = load_spec({"targets": list(targets)})
    plan = plan_routes(Format.ONNX, spec, default_name="cnn")
    return jobs.jobs.create_job(
        NewJob(
            name="cnn",
            spec=spec.model_dump(mode="json"),
            plan=plan,
            source_key="sources/abc",
            source_sha256="ab" * 32,
            source_filename="cnn.onnx",
            source_format="onnx",
        )
    )


def _run(jobs: JobStores, job_id: str, step_id: str, *, status: str = "succeeded", error: dict | None = None):
    claim = jobs.steps.claim_step(job_id, step_id, "w1", stale_after=60)
    assert claim is not None, step_id
    return jobs.steps.finish_step(
        job_id,
        step_id,
        claim.attempt,
        status=status,
        seconds=0.1,
        artifact_key=f"steps/{step_id}" if status == "succeeded" else None,
        meta={"parity": {"passed": True}} if step_id.startswith("export") else None,
        error=error,
    )


def test_migrations_create_exactly_the_models(tmp_path: Path) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from services.jobs.db import get_engine
    from services.jobs.models import Base

    for url in (f"sqlite:///{tmp_path / 'm.db'}", migrated_pg()):
        upgrade(url)
        upgrade(url)  # idempotent
        with get_engine(url).connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def test_steps_run_in_dependency_order_and_the_last_one_ends_the_job(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    first = jobs.steps.advance(job_id)
    # Only the reference step reads the source first; everything else waits for it.
    assert first.queued == [("reference", "onnxruntime")]
    adv = _run(jobs, job_id, "reference")
    assert adv.queued == [("optimize", "onnxruntime")]
    adv = _run(jobs, job_id, "optimize")
    assert sorted(adv.queued) == [("export:onnxruntime", "onnxruntime"), ("optimize/onnx-to-openvino-ir", "openvino")]
    for sid in ("export:onnxruntime", "publish:onnxruntime", "optimize/onnx-to-openvino-ir", "export:openvino"):
        adv = _run(jobs, job_id, sid)
        assert adv.final_status is None
    adv = _run(jobs, job_id, "publish:openvino")
    assert adv.final_status == "succeeded"
    job = jobs.jobs.get_job(job_id)
    assert job.status == "succeeded" and job.finished_at is not None and job.cached is False
    assert {t: r["status"] for t, r in job.result.items()} == {"onnxruntime": "succeeded", "openvino": "succeeded"}
    assert job.result["openvino"]["artifact"] == "steps/export:openvino"
    assert [e.type for e in jobs.jobs.events(job_id)][-1] == "finished"


def test_a_failed_step_skips_its_dependents_and_the_other_target_goes_on(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    _run(jobs, job_id, "reference")
    _run(jobs, job_id, "optimize")
    err = {"code": "PARITY_FAILED", "message": "too far", "hint": "h", "details": {"parity": {"passed": False}}}
    adv = _run(jobs, job_id, "export:onnxruntime", status="failed", error=err)
    assert adv.queued == []
    job = jobs.jobs.get_job(job_id)
    publish = next(s for s in job.steps if s.step_id == "publish:onnxruntime")
    assert publish.status == "skipped" and publish.error["code"] == "PARITY_FAILED"
    for sid in ("optimize/onnx-to-openvino-ir", "export:openvino"):
        _run(jobs, job_id, sid)
    adv = _run(jobs, job_id, "publish:openvino")
    assert adv.final_status == "failed"
    result = jobs.jobs.get_job(job_id).result
    assert result["openvino"]["status"] == "succeeded"
    assert result["onnxruntime"]["status"] == "failed"
    assert result["onnxruntime"]["error"]["code"] == "PARITY_FAILED"
    assert result["onnxruntime"]["parity"] == {"passed": False}


def test_a_failed_conversion_hands_the_target_to_its_next_route(jobs: JobStores) -> None:
    job_id = _new_job(jobs, ("onnxruntime", "openvino"))
    jobs.steps.advance(job_id)
    _run(jobs, job_id, "reference")
    _run(jobs, job_id, "optimize")
    steps = {s.step_id: s for s in jobs.jobs.get_job(job_id).steps}
    # The fallback route's steps wait, pending, while the first route may still work.
    assert steps["optimize/onnx-to-savedmodel"].status == "pending"
    err = {
        "code": "CONVERSION_FAILED",
        "message": "No conversion rule found for operations: Det-17",
        "hint": "h",
        "details": {"step": "optimize/onnx-to-openvino-ir", "tool": "openvino.convert_model"},
    }
    adv = _run(jobs, job_id, "optimize/onnx-to-openvino-ir", status="failed", error=err)
    assert adv.queued == [("optimize/onnx-to-savedmodel", "tensorflow")]
    failed = [e for e in jobs.jobs.events(job_id) if e.type == "route_failed"]
    assert len(failed) == 1 and failed[0].step == "optimize/onnx-to-openvino-ir"
    assert failed[0].data["target"] == "openvino" and failed[0].data["rank"] == 1
    assert failed[0].data["tool"] == "openvino.convert_model" and failed[0].data["code"] == "CONVERSION_FAILED"
    assert failed[0].data["next_route"] == "onnx → optimize → savedmodel → openvino_ir ⇒ openvino"
    for sid in ("export:onnxruntime", "publish:onnxruntime", "optimize/onnx-to-savedmodel"):
        _run(jobs, job_id, sid)
    _run(jobs, job_id, "optimize/onnx-to-savedmodel/savedmodel-to-openvino-ir")
    _run(jobs, job_id, "export:openvino@2")
    claim = jobs.steps.claim_step(job_id, "publish:openvino@2", "w1", stale_after=60)
    assert claim is not None and [(a["rank"], a["status"]) for a in claim.route_attempts] == [
        (1, "failed"),
        (2, "running"),
    ]
    assert claim.route_attempts[0]["message"] == err["message"]
    adv = jobs.steps.finish_step(job_id, "publish:openvino@2", claim.attempt, status="succeeded", seconds=0.1, meta={})
    assert adv.final_status == "succeeded"
    job = jobs.jobs.get_job(job_id)
    result = job.result["openvino"]
    assert result["status"] == "succeeded" and result["artifact"] == "steps/export:openvino@2"
    assert result["route"] == "onnx → optimize → savedmodel → openvino_ir ⇒ openvino"
    assert [(a["rank"], a["status"]) for a in result["attempts"]] == [(1, "failed"), (2, "succeeded")]
    # The first route's export and publish were skipped for the failure; nothing else was.
    skipped = {s.step_id: s.error["code"] for s in job.steps if s.status == "skipped"}
    assert skipped == {"export:openvino": "CONVERSION_FAILED", "publish:openvino": "CONVERSION_FAILED"}


def test_a_fallback_route_never_needed_is_skipped_as_such(jobs: JobStores) -> None:
    job_id = _new_job(jobs, ("openvino",))
    jobs.steps.advance(job_id)
    for sid in ("reference", "optimize", "optimize/onnx-to-openvino-ir", "export:openvino"):
        assert _run(jobs, job_id, sid).final_status is None
    adv = _run(jobs, job_id, "publish:openvino")
    assert adv.final_status == "succeeded"
    job = jobs.jobs.get_job(job_id)
    fallback = {s.step_id: (s.status, (s.meta or {}).get("not_needed"), s.error) for s in job.steps if s.attempt == 0}
    assert set(fallback) == {
        "optimize/onnx-to-savedmodel",
        "optimize/onnx-to-savedmodel/savedmodel-to-openvino-ir",
        "export:openvino@2",
        "publish:openvino@2",
    }
    assert all(status == "skipped" and why and err is None for status, why, err in fallback.values())
    assert [a["status"] for a in job.result["openvino"]["attempts"]] == ["succeeded"]
    assert not [e for e in jobs.jobs.events(job_id) if e.type in ("route_failed", "step_skipped")]


def test_a_source_error_does_not_fall_back(jobs: JobStores) -> None:
    job_id = _new_job(jobs, ("openvino",))
    jobs.steps.advance(job_id)
    err = {"code": "SOURCE_UNREADABLE", "message": "not an ONNX model", "hint": "h", "details": {"step": "reference"}}
    adv = _run(jobs, job_id, "reference", status="failed", error=err)
    assert adv.final_status == "failed" and adv.queued == []
    job = jobs.jobs.get_job(job_id)
    assert job.result["openvino"]["error"]["code"] == "SOURCE_UNREADABLE"
    assert [a["status"] for a in job.result["openvino"]["attempts"]] == ["failed"]
    assert not any(s.status == "running" or s.status == "queued" for s in job.steps)


def test_a_redelivered_step_is_not_run_twice(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    claim = jobs.steps.claim_step(job_id, "reference", "w1", stale_after=60)
    assert claim is not None and claim.attempt == 1
    assert jobs.steps.claim_step(job_id, "reference", "w2", stale_after=60) is None  # still running, fresh heartbeat
    assert jobs.steps.finish_step(job_id, "reference", 1, status="succeeded", seconds=0.1, artifact_key="steps/r")
    assert jobs.steps.claim_step(job_id, "reference", "w2", stale_after=60) is None  # done
    assert jobs.steps.claim_step(job_id, "export:openvino", "w2", stale_after=60) is None  # not queued yet


def test_concurrent_advances_enqueue_each_step_once(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    _run(jobs, job_id, "reference")
    claim = jobs.steps.claim_step(job_id, "optimize", "w1", stale_after=60)
    assert claim is not None
    with jobs.db.write() as s:  # finish it without advancing, as if the worker died right after
        s.execute(
            update(JobStep)
            .where(JobStep.job_id == job_id, JobStep.step_id == "optimize")
            .values(status="succeeded", artifact_key="steps/opt")
        )
    queued: list[tuple[str, str]] = []
    lock = threading.Lock()

    def advance() -> None:
        adv = jobs.steps.advance(job_id)
        with lock:
            queued.extend(adv.queued)

    threads = [threading.Thread(target=advance) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(queued) == [("export:onnxruntime", "onnxruntime"), ("optimize/onnx-to-openvino-ir", "openvino")]


def test_a_step_whose_worker_stopped_heartbeating_is_requeued_and_taken_over(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    claim = jobs.steps.claim_step(job_id, "reference", "dead-worker", stale_after=60)
    assert claim is not None
    assert jobs.steps.requeue_stale(stale_after=60, lost_after=600) == []
    with jobs.db.write() as s:
        s.execute(
            update(JobStep)
            .where(JobStep.job_id == job_id, JobStep.step_id == "reference")
            .values(heartbeat_at=JobStore.now() - timedelta(seconds=120))
        )
    assert jobs.steps.requeue_stale(stale_after=60, lost_after=600) == [(job_id, "reference", "onnxruntime")]
    taken = jobs.steps.claim_step(job_id, "reference", "live-worker", stale_after=60)
    assert taken is not None and taken.attempt == 2
    # The dead worker's late result is refused; the live one's is recorded.
    assert jobs.steps.finish_step(job_id, "reference", 1, status="succeeded", seconds=1, artifact_key="steps/x") is None
    assert jobs.steps.heartbeat(job_id, "reference", 1) == (False, False)
    assert jobs.steps.finish_step(job_id, "reference", 2, status="succeeded", seconds=1, artifact_key="steps/y")
    assert "step_requeued" in [e.type for e in jobs.jobs.events(job_id)]


def test_a_queued_step_whose_message_was_lost_is_announced_again(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    with jobs.db.write() as s:
        s.execute(
            update(JobStep)
            .where(JobStep.job_id == job_id, JobStep.step_id == "reference")
            .values(queued_at=JobStore.now() - timedelta(seconds=1000))
        )
    found = jobs.steps.requeue_stale(stale_after=60, lost_after=600)
    assert (job_id, "reference", "onnxruntime") in found
    assert jobs.steps.requeue_stale(stale_after=60, lost_after=600) == []  # re-announced once per period


def test_cancel_stops_queued_steps_and_tells_running_ones(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    claim = jobs.steps.claim_step(job_id, "reference", "w1", stale_after=60)
    assert claim is not None
    assert jobs.jobs.cancel_job(job_id) is True
    assert jobs.jobs.cancel_job(job_id) is False  # already final
    assert jobs.steps.heartbeat(job_id, "reference", 1) == (True, True)  # the worker learns to stop
    job = jobs.jobs.get_job(job_id)
    assert job.status == "cancelled"
    assert {s.status for s in job.steps if s.step_id != "reference"} == {"cancelled"}
    adv = jobs.steps.finish_step(job_id, "reference", 1, status="cancelled", seconds=0.1, error={"code": "CANCELLED"})
    assert adv is not None and adv.queued == []  # nothing runs after a cancel
    assert jobs.jobs.get_job(job_id).status == "cancelled"


def test_a_queued_job_cancelled_never_runs(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    jobs.jobs.cancel_job(job_id)
    assert jobs.steps.claim_step(job_id, "reference", "w1", stale_after=60) is None
    assert next(s for s in jobs.jobs.get_job(job_id).steps if s.step_id == "reference").status == "cancelled"


def test_fail_job_records_why(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.jobs.fail_job(job_id, ServiceUnavailable("broker down"))
    job = jobs.jobs.get_job(job_id)
    assert job.status == "failed" and job.error["code"] == "SERVICE_UNAVAILABLE"
    assert [e.type for e in jobs.jobs.events(job_id)][-2:] == ["failed", "finished"]


def test_list_jobs_filters_and_pages(jobs: JobStores) -> None:
    ids = [_new_job(jobs, ("onnxruntime",)) for _ in range(3)]
    jobs.jobs.cancel_job(ids[0])
    page, count = jobs.jobs.list_jobs(status="cancelled", limit=10)
    assert ids[0] in [j.id for j in page] and all(j.status == "cancelled" for j in page)
    page, count = jobs.jobs.list_jobs(name="cnn", limit=2, offset=0)
    assert len(page) == 2 and count >= 3
    assert page[0].created_at >= page[1].created_at


def test_tokens_are_stored_hashed_and_can_be_revoked(jobs: JobStores) -> None:
    name = f"ci-{id(jobs)}-{threading.get_ident()}"
    token = jobs.tokens.create_token(name, ["read"])
    rec = jobs.tokens.verify_token(token)
    assert rec is not None and rec.scopes == "read"
    assert rec.token_sha256 == hash_token(token) and token not in rec.token_sha256
    assert jobs.tokens.verify_token(token + "x") is None
    assert jobs.tokens.revoke_token(name)
    assert jobs.tokens.verify_token(token) is None


def test_workers_are_live_while_they_heartbeat(jobs: JobStores) -> None:
    host = f"w-{id(jobs)}"
    jobs.workers.worker_heartbeat(
        host, engines=["onnxruntime"], versions={"onnxruntime": {"onnxruntime": "1"}}, pid=1, concurrency=2
    )
    assert host in [w.hostname for w in jobs.workers.live_workers(30)]
    jobs.workers.worker_stopped(host)
    assert host not in [w.hostname for w in jobs.workers.live_workers(30)]


def test_job_rows_round_trip_timezones(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    job = jobs.jobs.get_job(job_id)
    assert job.created_at.tzinfo is not None
    with jobs.db.read() as s:
        assert s.get(Job, job_id).created_at == job.created_at


def test_a_worker_continues_with_a_ready_step_of_its_own_engines(jobs: JobStores) -> None:
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    claim = jobs.steps.claim_step(job_id, "reference", "w1", stale_after=60)
    assert claim is not None
    adv = jobs.steps.finish_step(
        job_id,
        "reference",
        1,
        status="succeeded",
        seconds=0.1,
        artifact_key="steps/ref",
        continue_on=["onnxruntime"],
        worker="w1",
    )
    # optimize (onnxruntime) is taken at once by w1, not queued: no broker round trip.
    assert adv.queued == [] and adv.claimed is not None and adv.claimed.step_id == "optimize"
    adv = jobs.steps.finish_step(
        job_id,
        "optimize",
        1,
        status="succeeded",
        seconds=0.1,
        artifact_key="steps/opt",
        continue_on=["onnxruntime"],
        worker="w1",
    )
    # Two steps became ready: w1 keeps its engine's, the OpenVINO one goes to its queue.
    assert adv.claimed.step_id == "export:onnxruntime" and adv.claimed.input_keys == {
        "model": "steps/opt",
        "reference": "steps/ref",
    }
    assert adv.queued == [("optimize/onnx-to-openvino-ir", "openvino")]
    steps = {s.step_id: s for s in jobs.jobs.get_job(job_id).steps}
    assert steps["export:onnxruntime"].status == "running" and steps["export:onnxruntime"].worker == "w1"
    assert jobs.steps.claim_step(job_id, "export:onnxruntime", "w2", stale_after=60) is None  # it is w1's


def test_kiln_migrate_and_token_commands_work_from_any_directory(tmp_path: Path) -> None:
    import subprocess

    from jobs_support import KILN_CMD, service_env

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = service_env(database_url=url, cache_dir=tmp_path)
    done = subprocess.run([*KILN_CMD, "migrate"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
    made = subprocess.run(
        [*KILN_CMD, "token", "create", "ci", "--scope", "read"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    rec = TokenStore(url).verify_token(token)
    assert rec is not None and rec.name == "ci" and rec.scopes == "read"


def test_a_submitted_job_is_recorded_with_its_first_steps_queued_in_one_go(jobs: JobStores) -> None:
    spec = load_spec({"targets": ["onnxruntime"]})
    new = NewJob(
        name="cnn",
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name="cnn"),
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
    )
    adv = jobs.jobs.submit_job(new)
    assert adv.queued == [("reference", "onnxruntime")]
    steps = {s.step_id: s.status for s in jobs.jobs.get_job(new.id).steps}
    assert steps["reference"] == "queued" and {v for k, v in steps.items() if k != "reference"} == {"pending"}
    assert [e.type for e in jobs.jobs.events(new.id)] == ["submitted", "planned", "step_queued"]
    assert jobs.steps.advance(new.id).queued == []  # nothing is queued twice


def test_job_versions_move_with_every_change_and_leave_out_unknown_jobs(jobs: JobStores) -> None:
    a, b = _new_job(jobs), _new_job(jobs)
    before = jobs.jobs.job_versions([a, b, "nope"])
    assert set(before) == {a, b} and before[a].status == "queued"
    assert before[a].version == jobs.jobs.job_version(a)
    jobs.steps.advance(a)
    jobs.steps.claim_step(a, "reference", "w1", stale_after=60)
    after = jobs.jobs.job_versions([a, b])
    assert after[a].version > before[a].version and after[a].status == "running"
    assert after[b] == before[b]
    assert jobs.jobs.job_versions([]) == {}


def test_a_step_recording_events_waits_for_the_jobs_lock(jobs: JobStores) -> None:
    # Events of one job are committed in id order only if every writer of them holds the
    # job's row lock: a writer that did not could commit an older id after a newer one, and
    # a reader keyed on the newest id would miss the change.
    job_id = _new_job(jobs)
    jobs.steps.advance(job_id)
    claim = jobs.steps.claim_step(job_id, "reference", "w1", stale_after=60)
    assert claim is not None
    writers = {
        "progress": lambda: jobs.steps.progress(job_id, "reference", ["halfway"]),
        "heartbeat with progress": lambda: jobs.steps.heartbeat(job_id, "reference", claim.attempt, ["more"]),
        "release": lambda: jobs.steps.release_step(job_id, "reference", claim.attempt, "test"),
    }
    for name, write in writers.items():
        with jobs.db.write() as s:
            jobs.db.lock_job(s, job_id)  # another transaction holds the job
            t = threading.Thread(target=write)
            t.start()
            t.join(0.3)
            assert t.is_alive(), f"{name} did not wait for the job's lock"
        t.join(10)
        assert not t.is_alive()
    types = [e.type for e in jobs.jobs.events(job_id)]
    assert types[-3:] == ["progress", "progress", "step_requeued"]


# --- tenants, model names, sessions ---------------------------------------------------------


def _tenant_job(jobs: JobStores, tenant: str, name: str, *, any_names: bool = False) -> str:
    spec = load_spec({"targets": ["onnxruntime"], "name": name})
    new = NewJob(
        name=name,
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name=name),
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
        tenant=tenant,
    )
    jobs.jobs.submit_job(new, any_names=any_names)
    return new.id


def test_a_tenant_finds_only_its_own_jobs(jobs: JobStores) -> None:
    a = _tenant_job(jobs, "team-a", f"a-{uuid.uuid4().hex[:8]}")
    b = _tenant_job(jobs, "team-b", f"b-{uuid.uuid4().hex[:8]}")
    assert jobs.jobs.get_job(a, "team-a").tenant == "team-a"
    assert jobs.jobs.get_job(b).tenant == "team-b"  # no tenant: the service's (and admins') view
    for call in (
        lambda: jobs.jobs.get_job(b, "team-a"),
        lambda: jobs.jobs.job_status(b, "team-a"),
        lambda: jobs.jobs.cancel_job(b, "team-a"),
    ):
        with pytest.raises(NotFound, match=f"no job {b}"):
            call()
    assert jobs.jobs.get_job(b).status == "queued"  # the refused cancel changed nothing
    page, count = jobs.jobs.list_jobs(filters=JobFilter(tenant="team-a"), limit=500)
    assert a in {j.id for j in page} and b not in {j.id for j in page}
    assert {j.tenant for j in page} == {"team-a"} and count == len(page)
    assert jobs.jobs.job_versions([a, b])[b].tenant == "team-b"
    assert jobs.jobs.cancel_job(b, "team-b") is True


def test_a_model_name_belongs_to_the_first_tenant_publishing_under_it(jobs: JobStores) -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    _tenant_job(jobs, "team-a", name)
    _tenant_job(jobs, "team-a", name)  # its own name, again
    with pytest.raises(Forbidden) as refused:
        _tenant_job(jobs, "team-b", name)
    assert refused.value.details["names"] == [name] and "another tenant" in refused.value.message
    assert jobs.jobs.list_jobs(filters=JobFilter(tenant="team-b", name=name))[1] == 0  # nothing recorded
    # Several targets publish under <name>-<target>: each is claimed, and a taken one refuses the job.
    spec = load_spec({"targets": ["onnxruntime", "openvino"], "name": name[:-1]})
    plan = plan_routes(Format.ONNX, spec, default_name=name)
    assert published_names(plan) == sorted({f"{name[:-1]}-onnxruntime", f"{name[:-1]}-openvino"})
    # An admin may publish under any name; the name stays its owner's.
    _tenant_job(jobs, "default", name, any_names=True)
    assert jobs.model_names.owner(name) == "team-a"
    assert name in jobs.model_names.owned_by("team-a") and name not in jobs.model_names.owned_by("default")


def test_two_tenants_racing_for_a_new_name_cannot_both_get_it(jobs: JobStores) -> None:
    name = f"race-{uuid.uuid4().hex[:8]}"
    outcomes: dict[str, str] = {}

    def claim(tenant: str) -> None:
        try:
            _tenant_job(jobs, tenant, name)
            outcomes[tenant] = "ok"
        except Forbidden:
            outcomes[tenant] = "forbidden"

    threads = [threading.Thread(target=claim, args=(f"racer-{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes.values()) == ["forbidden"] * 5 + ["ok"], outcomes
    winner = next(t for t, o in outcomes.items() if o == "ok")
    assert jobs.model_names.owner(name) == winner


def test_tokens_carry_their_tenant_and_the_admin_token_is_kept_in_step_with_its_secret(jobs: JobStores) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    token = jobs.tokens.create_token(name, ["write"], "team-a")
    assert jobs.tokens.verify_token(token).tenant == "team-a"
    with pytest.raises(InvalidSpec, match="not a tenant name"):
        jobs.tokens.create_token(f"{name}-bad", ["read"], "Team A")
    admin_name = f"admin-{uuid.uuid4().hex[:8]}"
    first = f"kiln_{uuid.uuid4().hex[:8]}_{uuid.uuid4().hex}"
    assert jobs.tokens.ensure_token(admin_name, first, ["admin"]) is True
    assert jobs.tokens.ensure_token(admin_name, first, ["admin"]) is False  # every start: unchanged
    rotated = f"kiln_{uuid.uuid4().hex[:8]}_{uuid.uuid4().hex}"
    assert jobs.tokens.ensure_token(admin_name, rotated, ["admin"]) is True
    assert jobs.tokens.verify_token(first) is None  # the old secret stops working
    rec = jobs.tokens.verify_token(rotated)
    assert rec is not None and rec.name == admin_name and rec.scopes == "admin" and rec.tenant == "default"


def test_a_dashboard_session_ends_on_sign_out_on_expiry_and_with_its_token(jobs: JobStores) -> None:
    name = f"s-{uuid.uuid4().hex[:8]}"
    token = jobs.tokens.create_token(name, ["read"], "team-s")
    rec = jobs.tokens.verify_token(token)
    session = jobs.sessions.open_session(rec.id, lifetime=3600)
    assert token not in session and jobs.sessions.session_token(session).name == name
    assert jobs.sessions.session_token(session + "x") is None
    with jobs.db.read() as s:  # only the session id's hash is stored
        assert s.scalar(select(DashboardSession.id_sha256).where(DashboardSession.token_id == rec.id)) == (
            hashlib.sha256(session.encode()).hexdigest()
        )
    jobs.sessions.close_session(session)
    assert jobs.sessions.session_token(session) is None
    expired = jobs.sessions.open_session(rec.id, lifetime=0.001)
    time.sleep(0.05)
    assert jobs.sessions.session_token(expired) is None
    live = jobs.sessions.open_session(rec.id, lifetime=3600)
    jobs.tokens.revoke_token(name)
    assert jobs.sessions.session_token(live) is None


def test_migration_0004_gives_existing_jobs_and_names_to_the_default_tenant(tmp_path: Path) -> None:
    import json

    from services.jobs.db import get_engine

    spec = load_spec({"targets": ["onnxruntime", "openvino"], "name": "legacy"})
    plan = plan_routes(Format.ONNX, spec, default_name="legacy").to_dict()
    for url in (f"sqlite:///{tmp_path / 'old.db'}", create_pg_database("kiln_m0004")):
        upgrade(url, "0003")
        with get_engine(url).begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, status, name, spec, plan, source_key, source_sha256, source_filename, "
                    "source_format, source_seen, source_size, use_cache, cancel_requested, created_at) VALUES "
                    "('j1', 'succeeded', 'legacy', :spec, :plan, 'sources/x', :sha, 'm.onnx', 'onnx', '', 0, "
                    "true, false, CURRENT_TIMESTAMP)"
                ),
                {"spec": json.dumps(spec.model_dump(mode="json")), "plan": json.dumps(plan), "sha": "ab" * 32},
            )
            conn.execute(
                text(
                    "INSERT INTO api_tokens (id, name, token_sha256, scopes, created_at) "
                    "VALUES ('t1', 'old', :h, 'read write', CURRENT_TIMESTAMP)"
                ),
                {"h": "cd" * 32},
            )
        upgrade(url)
        stores = JobStores.open(url)
        assert stores.jobs.get_job("j1", "default").tenant == "default"
        assert [t.tenant for t in stores.tokens.list_tokens()] == ["default"]
        assert stores.model_names.owned_by("default") == {"legacy-onnxruntime", "legacy-openvino"}


def _keyed_job(jobs: JobStores, claim: IdempotencyClaim, name: str) -> str:
    spec = load_spec({"targets": ["onnxruntime"]})
    new = NewJob(
        name=name,
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name=name),
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
        tenant=claim.tenant,
    )
    jobs.jobs.submit_job(new, idempotency=claim)
    return new.id


def test_racing_submits_with_one_idempotency_key_record_one_job(jobs: JobStores) -> None:
    claim = IdempotencyClaim("team-a", f"key-{uuid.uuid4().hex}", "f" * 64)
    name = f"keyed-{uuid.uuid4().hex[:8]}"
    outcomes: list[str] = []

    def submit() -> None:
        try:
            outcomes.append("recorded " + _keyed_job(jobs, claim, name))
        except KeyTaken as taken:
            outcomes.append("answered " + taken.known.job_id)

    threads = [threading.Thread(target=submit) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    recorded = [o.split()[1] for o in outcomes if o.startswith("recorded")]
    assert len(recorded) == 1 and len(outcomes) == 5, outcomes
    assert {o.split()[1] for o in outcomes} == set(recorded)  # the losers were told the winner's job
    assert jobs.idempotency.find("team-a", claim.key) == KnownKey(recorded[0], claim.fingerprint)
    assert jobs.jobs.list_jobs(filters=JobFilter(name=name))[1] == 1  # the losers' jobs were rolled back
    # A key is per tenant: another tenant's key of the same spelling is another key.
    other = _keyed_job(jobs, IdempotencyClaim("team-b", claim.key, "e" * 64), f"{name}-b")
    assert jobs.idempotency.find("team-b", claim.key) == KnownKey(other, "e" * 64)
    with pytest.raises(IdempotencyKeyReused) as reused:
        KnownKey(recorded[0], claim.fingerprint).answer(IdempotencyClaim("team-a", claim.key, "0" * 64))
    assert reused.value.details["job_id"] == recorded[0]


def test_an_idempotency_key_lives_a_day_and_goes_with_its_job(jobs: JobStores) -> None:
    claim = IdempotencyClaim("team-a", f"key-{uuid.uuid4().hex}", "f" * 64)
    name = f"keyed-{uuid.uuid4().hex[:8]}"
    first = _keyed_job(jobs, claim, name)
    with jobs.db.write() as s:  # a day and a second ago
        s.execute(
            update(IdempotencyKey)
            .where(IdempotencyKey.key == claim.key)
            .values(created_at=jobs.jobs.now() - KEY_LIFETIME - timedelta(seconds=1))
        )
    assert jobs.idempotency.find("team-a", claim.key) is None
    second = _keyed_job(jobs, claim, name)  # the expired key is taken over by the new job
    assert jobs.idempotency.find("team-a", claim.key) == KnownKey(second, claim.fingerprint)
    assert first != second
    jobs.jobs.delete_job(second)
    assert jobs.idempotency.find("team-a", claim.key) is None


@pytest.mark.parametrize(("events", "state"), [(["finished"], "due"), (["succeeded"], "not_sent")])
def test_a_jobs_end_makes_its_webhook_due_only_for_the_events_it_asked_for(
    jobs: JobStores, events: list[str], state: str
) -> None:
    spec = load_spec({"targets": ["onnxruntime"]})
    name = f"hooked-{uuid.uuid4().hex[:8]}"
    new = NewJob(
        name=name,
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name=name),
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
        webhook=NewWebhook(url="https://hooks.example.com/k?token=t", events=events, secret="x" * 20),
    )
    jobs.jobs.submit_job(new)
    assert jobs.webhooks.state(new.id) == {"state": "waiting", "event": None, "attempts": 0, "last_error": None}
    assert new.id not in jobs.webhooks.due()
    jobs.jobs.cancel_job(new.id)
    assert jobs.webhooks.state(new.id)["state"] == state  # type: ignore[index]
    assert (new.id in jobs.webhooks.due(limit=500)) == (state == "due")
    if state == "due":
        claim = jobs.webhooks.claim(new.id)
        assert claim is not None and claim.attempt == 1 and claim.event == "cancelled"
        assert jobs.webhooks.claim(new.id) is None  # held by the first sender
        jobs.webhooks.failed(claim, "HTTP 502", retry_in=None)
        assert jobs.webhooks.state(new.id)["state"] == "gave_up"  # type: ignore[index]
        last = jobs.jobs.events(new.id)[-1]
        assert last.type == "webhook_gave_up" and last.data["url"] == "https://hooks.example.com"


# --- fair sharing: per-tenant quotas (services/jobs/quotas.py) ---------------------------------


def _quota_job(jobs: JobStores, tenant: str, quota: TenantQuota) -> str:
    spec = load_spec({"targets": ["onnxruntime"]})
    new = NewJob(
        name=tenant,
        spec=spec.model_dump(mode="json"),
        plan=plan_routes(Format.ONNX, spec, default_name=tenant),  # the tenant's own model name
        source_key="sources/abc",
        source_sha256="ab" * 32,
        source_filename="cnn.onnx",
        source_format="onnx",
        tenant=tenant,
        quota=quota,
    )
    jobs.jobs.submit_job(new)
    return new.id


def test_a_tenant_past_its_queued_quota_is_refused_and_nothing_is_recorded(jobs: JobStores) -> None:
    tenant = f"q-{uuid.uuid4().hex[:8]}"
    quota = TenantQuota(max_running=4, max_queued=2)
    first = [_quota_job(jobs, tenant, quota) for _ in range(2)]
    before = jobs.jobs.list_jobs(filters=JobFilter(tenant=tenant))[1]
    with pytest.raises(QuotaExceeded) as info:
        _quota_job(jobs, tenant, quota)
    assert info.value.code == "QUOTA_EXCEEDED" and HTTP_STATUS["QUOTA_EXCEEDED"] == 429
    assert info.value.details == {"tenant": tenant, "queued": 2, "max_queued": 2, "running": 0, "max_running": 4}
    assert jobs.jobs.list_jobs(filters=JobFilter(tenant=tenant))[1] == before  # the refused job is not there
    _quota_job(jobs, f"{tenant}-other", quota)  # another tenant's quota is its own
    jobs.steps.claim_step(first[0], "reference", "w1", stale_after=60)  # one starts: a place frees up
    _quota_job(jobs, tenant, quota)
    usage = QuotaStore(jobs.jobs.db).usage(tenant)
    assert (usage.running, usage.queued) == (1, 2)


def test_a_job_past_its_tenants_running_quota_waits_while_others_start(jobs: JobStores) -> None:
    tenant = f"r-{uuid.uuid4().hex[:8]}"
    quota = TenantQuota(max_running=1, max_queued=10)
    a1, a2 = _quota_job(jobs, tenant, quota), _quota_job(jobs, tenant, quota)
    b1 = _quota_job(jobs, f"{tenant}-b", quota)
    assert jobs.steps.claim_step(a1, "reference", "w1", stale_after=60, max_running=4) is not None
    with pytest.raises(StepDeferred):  # the job's own limit (its token's, 1) counts, not the setting's 4
        jobs.steps.claim_step(a2, "reference", "w1", stale_after=60, max_running=4)
    assert jobs.jobs.get_job(a2).status == "queued"
    assert jobs.steps.claim_step(b1, "reference", "w1", stale_after=60, max_running=4) is not None
    jobs.jobs.cancel_job(a1)  # a1 ends: a2 may start
    assert jobs.steps.claim_step(a2, "reference", "w1", stale_after=60, max_running=4) is not None


def test_tokens_carry_their_own_quotas(jobs: JobStores) -> None:
    name = f"quota-{uuid.uuid4().hex[:8]}"
    token = jobs.tokens.create_token(name, ["write"], "team-q", max_running_jobs=1, max_queued_jobs=3)
    rec = jobs.tokens.verify_token(token)
    assert rec is not None and (rec.max_running_jobs, rec.max_queued_jobs) == (1, 3)
    with pytest.raises(InvalidSpec):
        jobs.tokens.create_token(f"{name}-0", ["write"], "team-q", max_queued_jobs=0)
