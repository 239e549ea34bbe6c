"""Polling GET /jobs/{id}: cached bodies that are never stale, ETag/304, and one version read per round.

The API runs in-process on a SQLite job store and the real Redis (database 14); no worker
runs, so the test moves jobs along through the job store itself, as a worker would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from jobs_support import redis_url

from api.app import create_app
from services.jobs.db import database_url
from services.jobs.scheduling import StepScheduler
from services.jobs.store import JobStore
from services.settings import Settings
from workers.app import create_celery_app


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("polling")
    return Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
    )


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


def _submit(client: TestClient, model: Path) -> str:
    # No worker runs here: the spec asks to queue the job anyway (the test plays the worker).
    r = client.post(
        "/compile",
        files={
            "model": ("cnn.onnx", model.read_bytes()),
            "spec": (None, json.dumps({"targets": ["onnxruntime"], "wait_for_workers": True})),
        },
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_a_polled_job_answers_304_until_it_changes_and_then_shows_the_change(
    client: TestClient, settings: Settings, cnn_onnx: Path
) -> None:
    job_id = _submit(client, cnn_onnx)
    first = client.get(f"/jobs/{job_id}")
    assert first.status_code == 200 and first.json()["status"] == "queued"
    etag = first.headers["etag"]
    again = client.get(f"/jobs/{job_id}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    # A worker claims the first step behind the API's back: the next read must show it,
    # though a body of the job is cached.
    steps = StepScheduler(database_url(settings))
    assert steps.claim_step(job_id, "reference", "w1", stale_after=60) is not None
    moved = client.get(f"/jobs/{job_id}", headers={"If-None-Match": etag})
    assert moved.status_code == 200 and moved.headers["etag"] != etag
    body = moved.json()
    assert body["status"] == "running"
    assert next(s for s in body["steps"] if s["id"] == "reference")["status"] == "running"
    # Cancelled: final once no step is running any more.
    client.delete(f"/jobs/{job_id}")
    assert client.get(f"/jobs/{job_id}").json()["status"] == "cancelled"


def test_concurrent_polls_share_version_reads_and_each_gets_its_own_job(client: TestClient, cnn_onnx: Path) -> None:
    ids = [_submit(client, cnn_onnx) for _ in range(3)]
    app: Any = client.app
    versions = app.state.job_versions

    async def poll_all() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as ac:
            paths = [f"/jobs/{ids[i % 3]}" for i in range(30)] + ["/jobs/nope"]
            return list(await asyncio.gather(*(ac.get(p) for p in paths)))

    before = versions.rounds
    answers = asyncio.run(poll_all())
    rounds = versions.rounds - before
    for i, r in enumerate(answers[:-1]):
        assert r.status_code == 200 and r.json()["id"] == ids[i % 3]
    assert answers[-1].status_code == 404 and answers[-1].json()["code"] == "NOT_FOUND"
    # 31 requests that were waiting together: a handful of queries, not one per request.
    assert 1 <= rounds <= 5, rounds


def test_open_event_streams_poll_together(client: TestClient, settings: Settings, cnn_onnx: Path) -> None:
    ids = [_submit(client, cnn_onnx) for _ in range(3)]
    app: Any = client.app
    versions = app.state.job_versions
    jobs = JobStore(database_url(settings))

    async def follow_then_cancel() -> list[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln", timeout=30) as ac:
            streams = []
            for i in range(6):  # opened at different moments, as clients do
                streams.append(asyncio.create_task(ac.get(f"/jobs/{ids[i % 3]}/events")))
                await asyncio.sleep(0.008)
            await asyncio.sleep(0.6)  # six streams idle on three queued jobs
            for job_id in ids:
                await asyncio.to_thread(jobs.cancel_job, job_id)
            return [r.text for r in await asyncio.gather(*streams)]

    before = versions.rounds
    texts = asyncio.run(follow_then_cancel())
    rounds = versions.rounds - before
    for text in texts:  # each stream saw its job end
        assert '"type": "finished"' in text and '"status": "cancelled"' in text
    # The streams poll on shared ticks (every 50 ms): about one round per tick for all six
    # (~25 here, first reads included), where six streams on their own clocks need ~60.
    assert rounds <= 40, rounds
