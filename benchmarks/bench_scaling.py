"""Jobs per minute with 1, 2, 4 workers on one queue (Redis broker, PostgreSQL job store).

    .venv/bin/python benchmarks/bench_scaling.py [--workers 1,2,4] [--jobs 40] [--rounds 2] [--redis redis://127.0.0.1:6379]

For each N: a fresh PostgreSQL database, a flushed Redis database, one `kiln api` and N
`kiln worker --engine onnxruntime --concurrency 1` processes. A warm-up of 2·N jobs lets
every worker start its forkserver and first step child; then ``--jobs`` tiny jobs (the
tests' small CNN as ONNX to onnxruntime at fp32, cache off, no latency benchmark, 2
parity samples, each under its own model name) are submitted at once from 8 client
threads, and the time is the server's: the first job's ``created_at`` to the last job's
``finished_at``. Throughput is jobs per minute;
the scaling efficiency is throughput(N) / (N · throughput(1)), the goal being >= 0.8 up
to the core count. ``--rounds`` repeats every N in alternating order and reports medians.
The load average before and after each measured batch is printed with it, since on a
shared machine other processes take cores the workers would use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SPEC: dict[str, Any] = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(n: int, jobs: int, root: Path, model: Path, redis_db: int, tag: str) -> dict[str, Any]:
    from bench_service import fresh_pg
    from jobs_support import Proc, free_port, redis_url, service_env, submit, wait_http, wait_job, wait_workers

    redis_url.cache_clear()  # flush the database again for this N
    env = {
        "database_url": fresh_pg(),
        "broker_url": redis_url(redis_db),
        "repository": str(root / f"repo-{n}-{tag}"),
        "artifact_store": str(root / f"store-{n}-{tag}"),
    }
    port = free_port()
    procs = [
        Proc(
            ["worker", "--engine", "onnxruntime", "--concurrency", "1"],
            service_env(cache_dir=root / f"cache-{n}-{tag}-{i}", **env),
            root / f"worker-{n}-{tag}-{i}.log",
        )
        for i in range(n)
    ]
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"],
        service_env(cache_dir=root / "api-cache", **env),
        root / "api.log",
    )
    procs.append(api)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=api, timeout=120)
        wait_workers(base, {"onnxruntime"}, procs=procs, timeout=180)

        def one(name: str) -> dict[str, Any]:
            r = submit(base, model, {**SPEC, "name": name}, params={"cache": "false"})
            assert r.status_code == 202, r.text
            return wait_job(base, r.json()["id"], timeout=900)

        def batch(count: int, label: str) -> tuple[float, int]:
            # Submitted from a pool, so the client's one-at-a-time uploads do not set the pace;
            # the time is the server's own, first job created until last job finished.
            with ThreadPoolExecutor(8) as pool:
                done = list(pool.map(one, [f"m-{n}-{tag}-{label}-{i}" for i in range(count)]))
            first = min(datetime.fromisoformat(j["created_at"]) for j in done)
            last = max(datetime.fromisoformat(j["finished_at"]) for j in done)
            return (last - first).total_seconds(), sum(j["status"] == "succeeded" for j in done)

        batch(2 * n, "warm")
        load_before = _load()
        seconds, ok = batch(jobs, "run")
        return {"n": n, "seconds": seconds, "ok": ok, "per_min": jobs / seconds * 60, "load": (load_before, _load())}
    finally:
        for p in procs:
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--redis", default=os.environ.get("KILN_TEST_REDIS", "redis://127.0.0.1:6379"))
    parser.add_argument("--redis-db", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every N, in alternating order")
    args = parser.parse_args()
    os.environ["KILN_TEST_REDIS"] = args.redis  # read by jobs_support at import
    from kiln_testing.models import tiny_cnn_onnx

    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        root = Path(tmp)
        model = tiny_cnn_onnx(root / "cnn.onnx")
        ns = [int(x) for x in args.workers.split(",")]
        runs: dict[int, list[dict[str, Any]]] = {n: [] for n in ns}
        for i in range(args.rounds):
            # Alternate the order (1,2,4 then 4,2,1) so a drift in the machine's load hits every N alike.
            for n in ns if i % 2 == 0 else ns[::-1]:
                r = measure(n, args.jobs, root, model, args.redis_db, tag=str(i))
                runs[n].append(r)
                print(
                    f"N={n}: {r['per_min']:.1f} jobs/min ({r['ok']}/{args.jobs} ok), load {r['load']}", file=sys.stderr
                )
        rate = {n: statistics.median(r["per_min"] for r in rs) for n, rs in runs.items()}
        base = rate[ns[0]] / ns[0]
        print(
            f"{args.jobs} jobs per N and round, {args.rounds} round(s), median jobs/min "
            f"(tiny CNN ONNX → onnxruntime fp32, cache off); {os.cpu_count()} cores\n"
        )
        print("| workers | jobs ok | jobs/min (median) | per round | efficiency (÷N) | load avg (1 min) per round |")
        print("|---:|---:|---:|---|---:|---|")
        for n in ns:
            rs = runs[n]
            ok = sum(r["ok"] for r in rs)
            rounds = ", ".join(f"{r['per_min']:.1f}" for r in rs)
            loads = ", ".join(f"{r['load'][0].split()[0]}→{r['load'][1].split()[0]}" for r in rs)
            print(
                f"| {n} | {ok}/{args.jobs * len(rs)} | {rate[n]:.1f} | {rounds} | {rate[n] / (base * n):.2f} | {loads} |"
            )


if __name__ == "__main__":
    sys.exit(main())
