"""Cold starts of `kiln serve`: does a submit right after /readyz answers 200 succeed, every time?

Each round starts `kiln serve` on a fresh data dir (a new SQLite job store, no worker ever
registered), submits examples/tiny_cnn.onnx for onnxruntime and openvino as soon as /healthz
answers ("early", while the embedded worker starts) and again the moment /readyz first
answers 200 ("ready"), waits for both jobs and stops the server. It records when /healthz
and /readyz first answered, what /readyz said before, both submits' statuses and both jobs'
outcomes. tests/test_ready.py does the same for fewer rounds.

Run: ``PYTHONPATH=. python benchmarks/bench_cold_start.py [--rounds 20]``; results in
docs/benchmarks.md ("Cold starts of kiln serve").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from jobs_support import Proc, free_port, service_env, submit, wait_job  # noqa: E402

MODEL = ROOT / "examples" / "tiny_cnn.onnx"
SPEC: dict[str, Any] = {"targets": ["onnxruntime", "openvino"], "benchmark": False, "validation": {"samples": 2}}


def _first_ok(url: str, start: float, proc: Proc, timeout: float = 180) -> tuple[float, list[str]]:
    """Return seconds from ``start`` until ``url`` answered 200, and the statuses it answered before."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise SystemExit(f"kiln serve died:\n{proc.tail()}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return time.monotonic() - start, seen
            status = r.json().get("status", str(r.status_code))
            if not seen or seen[-1] != status:
                seen.append(status)
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise SystemExit(f"{url} never answered 200")


def one_round(root: Path) -> dict[str, Any]:
    root.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    try:
        healthz, _ = _first_ok(f"{url}/healthz", start, proc)
        early = submit(url, MODEL, {**SPEC, "name": "early"})
        readyz, before = _first_ok(f"{url}/readyz", start, proc)
        right = submit(url, MODEL, {**SPEC, "name": "ready"})
        jobs = [wait_job(url, r.json()["id"])["status"] if r.status_code == 202 else None for r in (early, right)]
    finally:
        proc.stop()
    return {
        "healthz_s": round(healthz, 2),
        "readyz_s": round(readyz, 2),
        "readyz_before": before,
        "early_submit": early.status_code,
        "ready_submit": right.status_code,
        "early_job": jobs[0],
        "ready_job": jobs[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-cold-") as tmp:
        for i in range(args.rounds):
            row = one_round(Path(tmp) / f"round-{i}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = [r for r in rows if r["ready_submit"] == 202 and r["ready_job"] == "succeeded"]
    early_ok = [r for r in rows if r["early_submit"] == 202 and r["early_job"] == "succeeded"]
    summary = {
        "rounds": len(rows),
        "ready_submit_succeeded": len(ok),
        "early_submit_succeeded": len(early_ok),
        "rounds_that_saw_starting": sum("starting" in r["readyz_before"] for r in rows),
        "healthz_s_median": statistics.median(r["healthz_s"] for r in rows),
        "readyz_s_median": statistics.median(r["readyz_s"] for r in rows),
        "readyz_s_max": max(r["readyz_s"] for r in rows),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
