"""Benchmark the web dashboard's server side; prints markdown tables (results in docs/benchmarks.md).

1. The job page of a finished 5-target job (onnxruntime, openvino, tflite, tfserving,
   tensorrt: grid, parity headroom, benchmark charts): time per GET /ui/jobs/{id}, next to
   the JSON GET /jobs/{id} of the same job, taken turn by turn.
2. The jobs list with 10,000 jobs in PostgreSQL: GET /ui/ (first page, filters, a deep
   page), with and without the list indexes of migration 0003, taken turn by turn.
3. 200 job pages open at once, each following its job's HTML event stream (measured once
   every page got its first render): GET /jobs/{id} throughput (wrk, 16 connections) with
   and without them, turn by turn. Goal: >= 0.8.

The jobs are written straight into the job store (their steps marked as run, with parity
and benchmark results of the shape the workers record): what is measured is the API
reading and rendering them, not a conversion. `kiln api` runs as its own process on
PostgreSQL, as deployed; the client shares the machine's cores.

    .venv/bin/python benchmarks/bench_dashboard.py [--jobs 10000] [--streams 200] [--seconds 5]

Needs PostgreSQL and Redis on 127.0.0.1 (.ci/run starts them) and wrk (`apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from jobs_support import Proc, create_pg_database, free_port, redis_url, service_env, wait_http  # noqa: E402

TARGETS = ["onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"]


def _sha(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _result(target: str, precision: str, i: int) -> dict[str, Any]:
    bench = [
        {
            "batch_size": b,
            "p50_ms": 0.4 * b + i % 7 * 0.01,
            "p90_ms": 0.5 * b,
            "p99_ms": 0.7 * b,
            "mean_ms": 0.45 * b,
            "throughput": 2000.0 / b,
            "iterations": 50,
            "warmup": 5,
        }
        for b in (1, 8, 32)
    ]
    parity = {
        "outputs": [
            {
                "name": f"out{k}",
                "max_abs": 1e-5,
                "max_rel": 1e-4,
                "cosine": 0.99999,
                "top1": 1.0,
                "within_allclose": True,
            }
            for k in range(2)
        ],
        "tolerances": {"atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.9999, "min_top1": 1.0},
        "samples": 8,
        "inputs_from": "random",
        "passed": True,
        "failures": [],
    }
    published = {"name": f"m{i}-{target}", "version": 1, "uri": f"/repo/m{i}-{target}/1", "files": []}
    return {"status": "succeeded", "parity": parity, "benchmark": bench, "published": published}


def insert_jobs(url: str, n: int, targets_of: Any, final: bool = True) -> list[str]:
    """Write ``n`` jobs with their steps, as run, straight into the store; return their ids."""
    from sqlalchemy import insert

    from services.formats import Format
    from services.graph.planner import plan_routes
    from services.jobs.models import Job, JobEvent, JobStep
    from services.jobs.store import JobStore
    from services.spec import load_spec

    store = JobStore(url)
    plans: dict[tuple[tuple[str, ...], str], Any] = {}
    ids = []
    now = datetime.now(UTC)
    jobs: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    statuses = ("succeeded", "succeeded", "succeeded", "failed", "cancelled")
    for i in range(n):
        targets = tuple(targets_of(i))
        precision = ("fp32", "fp16", "int8")[i % 3]
        spec = load_spec({"targets": list(targets), "precision": precision})
        if (targets, precision) not in plans:
            plans[(targets, precision)] = plan_routes(Format.ONNX, spec, default_name="m").to_dict()
        plan = plans[(targets, precision)]
        job_id = uuid.uuid4().hex
        ids.append(job_id)
        created = now - timedelta(seconds=n - i)
        status = statuses[i % len(statuses)] if final else "running"
        jobs.append(
            {
                "id": job_id,
                "status": status,
                "name": f"model-{i % 400}",
                "spec": spec.model_dump(mode="json"),
                "precision": precision,
                "plan": plan,
                "source_key": f"sources/{_sha(i % 900)}",
                "source_sha256": _sha(i % 900),
                "source_filename": "model.onnx",
                "source_format": "onnx",
                "source_size": 1000,
                "created_at": created,
                "started_at": created,
                "finished_at": created + timedelta(seconds=30) if final else None,
                "result": {t: _result(t, precision, i) for t in targets} if final else None,
                "cached": False,
            }
        )
        for pos, step in enumerate(plan["steps"]):
            steps.append(
                {
                    "job_id": job_id,
                    "step_id": step["id"],
                    "position": pos,
                    "kind": step["kind"],
                    "engine": step["engine"],
                    "queue": step.get("queue") or f"kiln.{step['engine']}",
                    "target": step.get("target"),
                    "status": "succeeded" if final or pos == 0 else ("running" if pos == 1 else "pending"),
                    "attempt": 1,
                    "worker": "kiln-bench@host",
                    "seconds": 1.5,
                    "cached": False,
                    "queued_at": created,
                    "started_at": created,
                    "finished_at": created + timedelta(seconds=2),
                    "meta": {},
                }
            )
        events.append({"job_id": job_id, "type": "finished" if final else "step_started", "at": created, "data": {}})
        if len(jobs) >= 1000:
            _flush(store, insert, Job, JobStep, JobEvent, jobs, steps, events)
    _flush(store, insert, Job, JobStep, JobEvent, jobs, steps, events)
    return ids


def _flush(store: Any, insert: Any, job: Any, step: Any, event: Any, *rows: list[dict[str, Any]]) -> None:
    jobs, steps, events = rows
    if not jobs:
        return
    with store.db.write() as s:
        s.execute(insert(job), jobs)
        s.execute(insert(step), steps)
        s.execute(insert(event), events)
    for r in rows:
        r.clear()


def _timed_gets(client: Any, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(url)
        out.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
    return out


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.1f} | {xs[int(len(xs) * 0.95) - 1]:.1f}"


def bench_job_page(base: str, job_id: str, rounds: int = 10, per_round: int = 20) -> list[str]:
    import httpx

    page_times: list[float] = []
    json_times: list[float] = []
    with httpx.Client(base_url=base, timeout=30) as client:
        _timed_gets(client, f"/ui/jobs/{job_id}", 5)  # warm-up
        _timed_gets(client, f"/jobs/{job_id}", 5)
        for _ in range(rounds):  # turn by turn
            page_times += _timed_gets(client, f"/ui/jobs/{job_id}", per_round)
            json_times += _timed_gets(client, f"/jobs/{job_id}", per_round)
        size = len(client.get(f"/ui/jobs/{job_id}").content)
    return [
        "| request (finished 5-target job) | median ms | p95 ms |",
        "|---|---:|---:|",
        f"| GET /ui/jobs/{{id}} (HTML page, {size // 1024} KiB) | {_ms(page_times)} |",
        f"| GET /jobs/{{id}} (JSON, cached body) | {_ms(json_times)} |",
    ]


LIST_QUERIES = [
    ("first page (newest 25)", "/ui/"),
    ("status=failed", "/ui/?status=failed"),
    ("precision=int8", "/ui/?precision=int8"),
    ("target=tflite", "/ui/?target=tflite"),
    ("engine=openvino & precision=int8", "/ui/?engine=openvino&precision=int8"),
    ("source sha256 prefix (12 hex)", "/ui/?sha=" + _sha(17)[:12]),
    ("source sha256 (whole, as the compare view asks)", "/ui/?sha=" + _sha(17)),
    ("sort=name, page 200", "/ui/?sort=name&page=200"),
    ("JSON GET /jobs?limit=25", "/jobs?limit=25"),
]


#: Migration 0003's indexes for the list's filters.
LIST_INDEXES = {
    "ix_jobs_precision": "jobs (precision)",
    "ix_job_steps_target_job_id": "job_steps (target, job_id)",
    "ix_job_steps_engine_job_id": "job_steps (engine, job_id)",
}


def _set_indexes(url: str, present: bool) -> None:
    from sqlalchemy import text

    from services.jobs.db import get_engine

    with get_engine(url).begin() as conn:
        for name, on in LIST_INDEXES.items():
            conn.execute(
                text(f"CREATE INDEX IF NOT EXISTS {name} ON {on}" if present else f"DROP INDEX IF EXISTS {name}")
            )
        conn.execute(text("ANALYZE jobs"))
        conn.execute(text("ANALYZE job_steps"))


def bench_list(base: str, url: str, n_jobs: int, rounds: int = 4, per_round: int = 10) -> list[str]:
    import httpx

    times: dict[tuple[str, bool], list[float]] = {}
    with httpx.Client(base_url=base, timeout=60) as client:
        for path in (p for _, p in LIST_QUERIES):
            _timed_gets(client, path, 2)
        for _ in range(rounds):
            for present in (False, True):  # turn by turn
                _set_indexes(url, present)
                for label, path in LIST_QUERIES:
                    times.setdefault((label, present), []).extend(_timed_gets(client, path, per_round))
        count = re.search(r"([\d,]+) jobs", client.get("/ui/").text)
    lines = [
        f"| jobs list, {n_jobs:,} jobs in PostgreSQL ({count.group(1) if count else '?'} listed) "
        "| without 0003 indexes: median ms | p95 ms | with: median ms | p95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, _ in LIST_QUERIES:
        lines.append(f"| {label} | {_ms(times[(label, False)])} | {_ms(times[(label, True)])} |")
    return lines


class Streams:
    """``n`` open HTML event streams (the job pages' live part), in a thread of their own."""

    def __init__(self, base: str, job_ids: list[str], n: int) -> None:
        self.base, self.job_ids, self.n = base, job_ids, n
        self.open = 0
        self.events = 0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, client: Any, job_id: str) -> None:
        async with client.stream("GET", f"/ui/jobs/{job_id}/stream") as r:
            assert r.status_code == 200
            first = True
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    self.events += 1
                    if first:  # open = the page shows its job: the first render is done
                        self.open += 1
                        first = False

    async def _main(self) -> None:
        import httpx

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limits = httpx.Limits(max_connections=self.n + 10)
        async with httpx.AsyncClient(base_url=self.base, timeout=None, limits=limits) as client:
            tasks = [asyncio.create_task(self._one(client, self.job_ids[i % len(self.job_ids)])) for i in range(self.n)]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        deadline = time.monotonic() + 120
        while self.open < self.n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.open == self.n, f"only {self.open} of {self.n} streams opened"
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def _wrk(url: str, seconds: int, connections: int = 16) -> float:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", url], capture_output=True, text=True, check=True
    ).stdout
    assert "Non-2xx" not in out, out
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def bench_streams(base: str, running: list[str], n_streams: int, seconds: int, rounds: int = 3) -> list[str]:
    polled = running[0]  # a running job: every GET checks whether it changed
    url = f"{base}/jobs/{polled}"
    _wrk(url, 2)  # warm-up
    without: list[float] = []
    with_streams: list[float] = []
    for _ in range(rounds):  # turn by turn
        without.append(_wrk(url, seconds))
        with Streams(base, running, n_streams):
            with_streams.append(_wrk(url, seconds))
    ratio = statistics.median(with_streams) / statistics.median(without)
    return [
        f"| GET /jobs/{{id}} of a running job, wrk 16 connections, {seconds} s x {rounds} | requests/s (median) |",
        "|---|---:|",
        f"| no job page open | {statistics.median(without):.0f} ({', '.join(f'{x:.0f}' for x in without)}) |",
        f"| {n_streams} job pages following their streams | {statistics.median(with_streams):.0f} "
        f"({', '.join(f'{x:.0f}' for x in with_streams)}) |",
        f"| ratio (goal >= 0.8) | **{ratio:.2f}** |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()

    import tempfile

    from services.jobs.migrate import upgrade

    url = create_pg_database("kiln_bench_dash")
    upgrade(url)
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-dash-"))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}")
    t0 = time.monotonic()
    five = insert_jobs(url, 1, lambda i: TARGETS)[0]
    running = insert_jobs(url, 50, lambda i: ["onnxruntime", "openvino"], final=False)
    insert_jobs(url, args.jobs - 51, lambda i: TARGETS[: 1 + i % 3] if i % 5 else ["tflite", "onnxruntime"])
    print(f"inserted {args.jobs} jobs in {time.monotonic() - t0:.0f} s")
    port = free_port()
    env = service_env(
        database_url=url, broker_url=redis_url(12), cache_dir=root / "cache", repository=str(root / "repo")
    )
    api = Proc(["api", "--port", str(port), "--no-access-log"], env, root / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=api)
        for section in (
            bench_job_page(base, five),
            bench_list(base, url, args.jobs),
            bench_streams(base, running, args.streams, args.seconds),
        ):
            print()
            print("\n".join(section), flush=True)
    finally:
        api.stop()
        _set_indexes(url, True)


if __name__ == "__main__":
    main()
