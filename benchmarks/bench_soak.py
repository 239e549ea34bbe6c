"""Soak: many jobs while worker processes are SIGKILLed at random; prints a markdown table.

The distributed service (`kiln api` and onnxruntime workers on PostgreSQL and Redis) takes
``--jobs`` submissions of the tiny test CNN (cache off, so every job converts, exports,
checks parity and publishes), all publishing versions of one model name. Meanwhile a killer
SIGKILLs a random worker's whole process group (worker, forkserver, step children) every
``--kill-every`` seconds on average and starts a replacement a second later. At the end:

- lost: jobs not finished (succeeded/failed/cancelled with no step still open) within the
  deadline; failed jobs are listed with their codes;
- duplicated versions: published versions claimed by two jobs, or version directories in
  the repository that no job published (a publish that ran twice);
- time to recover: per step that a kill interrupted, from the kill to the sweep's requeue
  (what ``step_stale_after`` and the heartbeat decide), and to the start of the attempt
  that finished it (which also waits behind whatever is queued then).

    .venv/bin/python benchmarks/bench_soak.py [--jobs 200] [--workers 2] [--kill-every 6] [--seed 0]

PostgreSQL: a fresh database on the server the tests use (KILN_TEST_POSTGRES); Redis: a
private redis-server on a free port (tests/private_servers.py), so nothing shared is flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from jobs_support import Proc, create_pg_database, free_port, service_env, submit, wait_http, wait_workers  # noqa: E402
from private_servers import PrivateRedis  # noqa: E402

from kiln_testing.models import tiny_cnn_onnx  # noqa: E402

SPEC = {"targets": ["onnxruntime"], "benchmark": False, "name": "soak"}
FINAL = ("succeeded", "failed", "cancelled")
OPEN_STEPS = ("pending", "queued", "running")


class Killer(threading.Thread):
    """SIGKILLs a random worker every ``mean`` seconds (exponential gaps) and starts a replacement."""

    def __init__(self, workers: list[Proc], start_worker: Any, mean: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.workers, self.start_worker, self.mean = workers, start_worker, mean
        self.rng = random.Random(seed)
        self.kills: list[tuple[float, str]] = []  # (wall time, "host:pid" of the killed worker)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.expovariate(1 / self.mean)):
            i = self.rng.randrange(len(self.workers))
            victim = self.workers[i]
            self.kills.append((time.time(), victim.pid))
            victim.kill_group(signal.SIGKILL)
            victim.popen.wait(10)
            time.sleep(1.0)
            self.workers[i] = self.start_worker()


def _parse(ts: str | None) -> float | None:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=6.0, help="mean seconds between kills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds to wait for every job")
    args = ap.parse_args()

    import httpx

    root = Path(tempfile.mkdtemp(prefix="kiln-soak-"))
    model = tiny_cnn_onnx(root / "cnn.onnx")
    redis = PrivateRedis()
    env = {
        "database_url": create_pg_database("kiln_soak"),
        "broker_url": redis.url,
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "step_heartbeat_interval": 0.5,
        "step_stale_after": 4,
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    n_started = [0]

    def start_worker() -> Proc:
        n_started[0] += 1
        n = n_started[0]
        return Proc(
            ["worker", "--engine", "onnxruntime", "--concurrency", "2"],
            service_env(cache_dir=root / f"worker-{n}", **env),
            root / f"worker-{n}.log",
        )

    Proc(["migrate"], service_env(cache_dir=root / "api", **env), root / "migrate.log").popen.wait(120)
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"], service_env(cache_dir=root / "api", **env), root / "api.log"
    )
    workers = [start_worker() for _ in range(args.workers)]
    killer = Killer(workers, start_worker, args.kill_every, args.seed)
    try:
        wait_http(f"{base}/healthz", proc=api)
        wait_workers(base, {"onnxruntime"}, procs=workers)
        t0 = time.time()
        killer.start()
        ids = []
        for _ in range(args.jobs):
            r = submit(base, model, SPEC, params={"cache": "false"})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        submitted_s = time.time() - t0
        jobs: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + args.deadline
        with httpx.Client(base_url=base, timeout=30) as http:
            while time.monotonic() < deadline:
                for job_id in ids:
                    if job_id in jobs:
                        continue
                    job = http.get(f"/jobs/{job_id}").json()
                    if job["status"] in FINAL and not any(s["status"] in OPEN_STEPS for s in job["steps"]):
                        jobs[job_id] = job
                if len(jobs) == len(ids):
                    break
                time.sleep(1.0)
            killer.stop_event.set()
            all_done_s = time.time() - t0
            lost = [i for i in ids if i not in jobs]
            for job_id in lost:
                jobs[job_id] = http.get(f"/jobs/{job_id}").json()
        killer.join(30)
    finally:
        killer.stop_event.set()
        for p in [api, *killer.workers]:
            p.stop()
        redis.close()

    done = [j for j in jobs.values() if j["status"] in FINAL]
    failed = [j for j in done if j["status"] != "succeeded"]
    codes: dict[str, int] = {}
    for j in failed:
        for t in j["targets"].values():
            code = (t.get("error") or {}).get("code", "?")
            codes[code] = codes.get(code, 0) + 1
    versions = [j["targets"]["onnxruntime"]["published"]["version"] for j in done if j["status"] == "succeeded"]
    dup_claims = len(versions) - len(set(versions))
    on_disk = sorted(int(p.name) for p in (root / "repo" / "soak").iterdir() if p.name.isdigit())
    unclaimed = sorted(set(on_disk) - set(versions))
    retried = [(j, s) for j in done for s in j["steps"] if s["attempt"] > 1]
    recoveries, detections = [], []
    kill_times = [t for t, _ in killer.kills]

    def since_kill(at: float | None) -> float | None:
        before = [t for t in kill_times if at is not None and t <= at]
        return at - max(before) if before and at is not None else None

    for _, step in retried:
        took = since_kill(_parse(step["started_at"]))
        if took is not None:
            recoveries.append(took)
    from services.jobs.store import JobStore

    store = JobStore(env["database_url"])
    for job_id in {j["id"] for j, _ in retried}:
        for ev in store.events(job_id, 0, limit=1000):
            if ev.type == "step_requeued":
                took = since_kill(ev.at.timestamp())
                if took is not None:
                    detections.append(took)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(
        f"jobs {args.jobs}, workers {args.workers} x concurrency 2, kills every ~{args.kill_every:.0f} s (seed {args.seed})\n"
    )
    print("| measure | value |\n|---|---|")
    rows = [
        ("jobs submitted", len(ids)),
        ("worker SIGKILLs", len(killer.kills)),
        (
            "jobs finished",
            f"{len(done)} ({len(done) - len(failed)} succeeded, {len(failed)} failed: {json.dumps(codes)})",
        ),
        ("**jobs lost** (not finished by the deadline)", f"**{len(lost)}**"),
        ("**duplicated versions** (claimed twice / on disk unclaimed)", f"**{dup_claims} / {len(unclaimed)}**"),
        ("versions published / on disk", f"{len(versions)} / {len(on_disk)}"),
        ("steps rerun after a kill", len(retried)),
        (
            "kill → step requeued by the sweep, median / max",
            f"{statistics.median(detections):.1f} s / {max(detections):.1f} s" if detections else "n/a",
        ),
        (
            "kill → rerun starts (includes waiting behind the queue), median / max",
            f"{statistics.median(recoveries):.1f} s / {max(recoveries):.1f} s" if recoveries else "n/a",
        ),
        ("submit all / all finished", f"{submitted_s:.0f} s / {all_done_s:.0f} s"),
    ]
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(f"\nlogs and repository: {root}")


if __name__ == "__main__":
    main()
