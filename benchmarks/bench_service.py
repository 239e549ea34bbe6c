"""Benchmark the compile service; prints markdown tables (results in docs/benchmarks/service.md).

1. Service overhead: a job's end-to-end time through the API and the queue (client's view:
   POST /compile until the SSE stream ends) against a direct in-process
   ``services.pipeline.compile_model`` of the same model and spec, cache off. Embedded
   (`kiln serve`: SQLite, filesystem broker) and distributed (`kiln api` + one `kiln worker`
   per engine on Redis and PostgreSQL). The variants take turns run by run, so load from
   other processes on a shared machine hits all of them alike.
2. An identical resubmission: the server-side job time when every step comes from the cache.
3. ``GET /jobs/{id}`` throughput under concurrent load, measured with wrk (HTTP/1.1,
   keep-alive) on the same 2 cores as the server.
4. A 1 GiB upload: throughput to the 202, and the API process's resident memory growth.

    .venv/bin/python benchmarks/bench_service.py [--runs 5] [--sections overhead,cache,throughput,upload]

Needs Redis and PostgreSQL on 127.0.0.1 (.ci/run starts them) and wrk (`apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from test_jobs_support import (  # noqa: E402 - the tests' process helpers, reused
    Proc,
    free_port,
    migrated_pg,
    read_sse,
    redis_url,
    service_env,
    submit,
    wait_http,
    wait_job,
    wait_workers,
)

SPEC: dict[str, Any] = {"targets": ["onnxruntime", "openvino"], "benchmark": {"iterations": 20, "warmup": 2}}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Services:
    """An embedded `kiln serve` and a distributed api + per-engine workers, started once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []

    def start_embedded(self) -> str:
        port = free_port()
        proc = Proc(
            ["serve", "--port", str(port), "--repo", str(self.root / "emb-repo")],
            service_env(cache_dir=self.root / "emb-cache"),
            self.root / "serve.log",
        )
        self.procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", proc=proc)
        wait_workers(base, {"onnxruntime", "openvino"}, procs=[proc])
        return base

    def distributed_env(self) -> dict[str, Any]:
        return {
            "database_url": migrated_pg(),
            "broker_url": redis_url(12),
            "repository": str(self.root / "dist-repo"),
            "artifact_store": str(self.root / "dist-store"),
        }

    def start_distributed(self, api_workers: int = 1, http: str = "auto") -> str:
        env = self.distributed_env()
        port = free_port()
        for engine in ("onnxruntime", "openvino"):
            self.procs.append(
                Proc(
                    ["worker", "--engine", engine, "--concurrency", "2"],
                    service_env(cache_dir=self.root / f"cache-{engine}", **env),
                    self.root / f"worker-{engine}.log",
                )
            )
        api = Proc(
            ["api", "--port", str(port), "--no-access-log", "--workers", str(api_workers), "--http", http],
            service_env(cache_dir=self.root / "api-cache", **env),
            self.root / "api.log",
        )
        self.procs.append(api)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", proc=api)
        wait_workers(base, {"onnxruntime", "openvino"}, procs=self.procs)
        self.api_pid = api.pid
        return base

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def _critical_path(steps: list[dict[str, Any]], seconds: dict[str, float]) -> float:
    """Return the longest chain of step seconds through the plan's dependencies."""
    done: dict[str, float] = {}
    for st in steps:  # plan order is dependency order
        deps = [d for d in st["inputs"].values() if d != "source"] + list(st.get("after", []))
        done[st["id"]] = seconds.get(st["id"], 0.0) + max((done[d] for d in deps if d in done), default=0.0)
    return max(done.values())


def _service_run(base: str, model: Path, spec: dict[str, Any], cache: bool) -> tuple[float, float, float]:
    """Return (client end-to-end seconds, server seconds, critical-path step seconds) of one job."""
    started = time.perf_counter()
    r = submit(base, model, spec, params={"cache": str(cache).lower()})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    read_sse(base, job_id)
    wall = time.perf_counter() - started
    job = wait_job(base, job_id)
    assert job["status"] == "succeeded", job
    work = _critical_path(job["plan"]["steps"], {s["id"]: s["seconds"] or 0.0 for s in job["steps"]})
    return wall, float(job["server_seconds"]), work


def _direct_run(model: Path, spec: dict[str, Any], root: Path) -> tuple[float, float]:
    """Return (seconds, critical-path step seconds) of an in-process compile_model."""
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    started = time.perf_counter()
    result = compile_model(
        model,
        load_spec(spec),
        store=LocalArtifactStore(root / "direct-store"),
        repository=LocalModelRepository(root / "direct-repo"),
        use_cache=False,
    )
    assert result.ok, {t: r.error for t, r in result.targets.items()}
    wall = time.perf_counter() - started
    plan = result.plan.to_dict()["steps"]
    return wall, _critical_path(plan, {sid: o.seconds for sid, o in result.steps.items()})


def bench_overhead(models: list[tuple[str, Path]], runs: int, root: Path, embedded: str, dist: str) -> list[str]:
    lines = [
        "| model | mode | end-to-end (s) | vs direct | critical-path step work (s) | service plumbing (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, model in models:
        _direct_run(model, SPEC, root)  # warm: imports and first-use costs out of the way
        _service_run(embedded, model, SPEC, cache=False)
        _service_run(dist, model, SPEC, cache=False)
        rows: dict[str, list[tuple[float, ...]]] = {"direct": [], "embedded": [], "distributed": []}
        for _ in range(runs):
            rows["direct"].append(_direct_run(model, SPEC, root))
            rows["embedded"].append(_service_run(embedded, model, SPEC, cache=False))
            rows["distributed"].append(_service_run(dist, model, SPEC, cache=False))
        direct = _median([r[0] for r in rows["direct"]])
        lines.append(
            f"| {label} | direct compile_model | {direct:.2f} | - | {_median([r[1] for r in rows['direct']]):.2f} | - |"
        )
        for mode in ("embedded", "distributed"):
            wall = _median([r[0] for r in rows[mode]])
            server = _median([r[1] for r in rows[mode]])
            work = _median([r[2] for r in rows[mode]])
            lines.append(
                f"| {label} | {mode} | {wall:.2f} | {wall - direct:+.2f} s ({(wall / direct - 1) * 100:+.0f}%) "
                f"| {work:.2f} | {server - work:.2f} |"
            )
        print(f"  {label}: {rows}", file=sys.stderr)
    return lines


def bench_cache(model: Path, runs: int, embedded: str, dist: str) -> list[str]:
    lines = [
        "| deployment | server time, median (s) | max (s) | client end-to-end, median (s) |",
        "|---|---:|---:|---:|",
    ]
    for label, base in (("embedded", embedded), ("distributed", dist)):
        _service_run(base, model, SPEC, cache=True)
        walls, servers, _ = zip(*(_service_run(base, model, SPEC, cache=True) for _ in range(runs)), strict=True)
        lines.append(f"| {label} | {_median(list(servers)):.3f} | {max(servers):.3f} | {_median(list(walls)):.3f} |")
    return lines


def _wrk(url: str, seconds: int, connections: int, threads: int = 2) -> tuple[float, str, str]:
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1)  # type: ignore[union-attr]
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1)  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    assert errors is None, out
    return rps, p50, p99


def _cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def _api_and_db_pids(api_pid: int) -> list[int]:
    """The API process tree and the PostgreSQL server's processes (the CPU a GET costs)."""
    import psutil

    api = psutil.Process(api_pid)
    pids = [api_pid, *(c.pid for c in api.children(recursive=True))]
    pids += [p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("postgres")]
    return pids


def bench_throughput(model: Path, root: Path, seconds: int) -> list[str]:
    lines = [
        "| job polled | API processes | HTTP parser | connections | requests/s | p50 | p99 | CPU ms per request (API + PostgreSQL) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for api_workers, http in ((1, "h11"), (1, "httptools"), (2, "httptools")):
        svc = Services(root / f"tp{api_workers}{http}")
        svc.root.mkdir(parents=True, exist_ok=True)
        try:
            base = svc.start_distributed(api_workers=api_workers, http=http)
            finished = submit(base, model, SPEC).json()["id"]
            assert wait_job(base, finished)["status"] == "succeeded"
            # No tensorflow worker runs here: this job stays `running` at its SavedModel step,
            # so every GET reads the job store (finished jobs are served from memory).
            running = submit(base, model, {"targets": ["tfserving"]}).json()["id"]
            for label, job_id in (("finished (7 steps)", finished), ("running (5 steps)", running)):
                url = f"{base}/jobs/{job_id}"
                _wrk(url, 2, 16)  # warm-up
                for conns in (16, 64):
                    pids = _api_and_db_pids(svc.api_pid)
                    cpu0 = _cpu_seconds(pids)
                    rps, p50, p99 = _wrk(url, seconds, conns)
                    cpu_ms = (_cpu_seconds(pids) - cpu0) / (rps * seconds) * 1000
                    lines.append(
                        f"| {label} | {api_workers} | {http} | {conns} | {rps:.0f} | {p50} | {p99} | {cpu_ms:.2f} |"
                    )
        finally:
            svc.stop()
    return lines


def bench_isolation(model: Path, root: Path, runs: int = 30) -> list[str]:
    """The price of running a step in its own process: fork from the forkserver, set up, report, exit."""
    import shutil as _shutil

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    from services.graph.planner import PlanStep
    from services.settings import Settings
    from services.storage import LocalArtifactStore
    from workers import child

    child.configure(["onnxruntime", "openvino"])
    settings = Settings(cache_dir=root / "iso-cache", artifact_store=str(root / "iso-store"))
    up = root / "iso-up"
    up.mkdir()
    _shutil.copy(model, up / "m.onnx")
    LocalArtifactStore(root / "iso-store").put_dir("sources/m", up)
    step = PlanStep(
        id="trivial",
        kind="convert",
        engine="onnxruntime",
        entry="test_jobs_support:ok_step",
        inputs={"model": "source"},
        tool="none",
    ).to_dict()
    totals, inner = [], []
    for i in range(runs + 1):
        req = child.StepRequest(
            job_id="iso",
            step=step,
            spec={"targets": ["onnxruntime"]},
            source_key="sources/m",
            source_filename="m.onnx",
            input_keys={},
            settings=settings,
            scratch=root / "iso" / str(i),
            use_cache=False,
        )
        started = time.perf_counter()
        res = child.run_in_child(req, soft_limit=60, hard_limit=90)
        assert res.ok, res.error
        if i:  # the first one also starts the forkserver
            totals.append((time.perf_counter() - started) * 1000)
            inner.append(res.seconds * 1000)
    totals.sort()
    return [
        "| what | median (ms) | p90 (ms) |",
        "|---|---:|---:|",
        f"| a trivial step in a child process, end to end | {_median(totals):.0f} | {totals[int(len(totals) * 0.9)]:.0f} |",
        f"| of which the step itself (executor, store put) | {_median(inner):.0f} | - |",
    ]


def _rss_tree(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def bench_upload(root: Path, size: int) -> list[str]:
    big = root / "big.onnx"
    with open(big, "wb") as fh:
        fh.write(b"\x08\x08")  # looks like an ONNX ModelProto to detection; the job is never run
        chunk = os.urandom(1 << 20)
        for _ in range(size // len(chunk)):
            fh.write(chunk)
    port = free_port()
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"],
        service_env(cache_dir=root / "up-cache", max_upload_bytes=2 * size),
        root / "upload-api.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=api)
        import httpx

        httpx.get(f"{base}/jobs")  # first request: lazy imports out of the way
        before = _rss_tree(api.pid)
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_tree(api.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        out = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{time_total} %{time_pretransfer}",
                "-F",
                f"model=@{big}",
                "-F",
                'spec={"targets":["onnxruntime"]};type=application/json',
                f"{base}/compile",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        done.set()
        sampler.join()
        code, total = out[0], float(out[1])
        assert code == "202", out
        mib = size / 2**20
        return [
            "| upload | time to 202 (s) | throughput (MiB/s) | API RSS before (MiB) | peak during (MiB) | growth (MiB) |",
            "|---|---:|---:|---:|---:|---:|",
            f"| {mib:.0f} MiB ONNX-headed file, curl -F | {total:.2f} | {mib / total:.0f} | {before / 2**20:.0f} "
            f"| {peak[0] / 2**20:.0f} | {(peak[0] - before) / 2**20:.1f} |",
        ]
    finally:
        api.stop()
        big.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sections", default="isolation,overhead,cache,throughput,upload")
    parser.add_argument("--wrk-seconds", type=int, default=10)
    parser.add_argument("--upload-mib", type=int, default=1024)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-service-"))
    print(
        f"# Service benchmarks ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()})\n"
    )
    try:
        from models import tiny_cnn_onnx, tiny_transformer_onnx

        models = [
            ("tiny CNN", tiny_cnn_onnx(root / "cnn.onnx")),
            ("transformer block", tiny_transformer_onnx(root / "tf.onnx")),
        ]
        if sections & {"overhead", "cache"}:
            svc = Services(root)
            try:
                embedded = svc.start_embedded()
                dist = svc.start_distributed()
                if "overhead" in sections:
                    print(f"## Service overhead (targets onnxruntime + openvino, cache off, median of {args.runs})\n")
                    print("\n".join(bench_overhead(models, args.runs, root, embedded, dist)) + "\n")
                if "cache" in sections:
                    print(f"## Identical resubmission, every step from the cache (median of {args.runs})\n")
                    print("\n".join(bench_cache(models[0][1], args.runs, embedded, dist)) + "\n")
            finally:
                svc.stop()
        if "isolation" in sections:
            print("## Process isolation per step (forkserver child, median of 30)\n")
            print("\n".join(bench_isolation(models[0][1], root)) + "\n")
        if "throughput" in sections:
            print(f"## GET /jobs/{{id}} under load (wrk -t2, {args.wrk_seconds} s, same 2 cores)\n")
            print("\n".join(bench_throughput(models[0][1], root, args.wrk_seconds)) + "\n")
        if "upload" in sections:
            print("## Upload (streamed to disk, hashed on the way)\n")
            print("\n".join(bench_upload(root, args.upload_mib * 2**20)) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
