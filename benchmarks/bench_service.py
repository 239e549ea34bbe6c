"""Benchmark the compile service; prints markdown tables (results in docs/benchmarks.md).

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
        [--baseline DIR]

``--openvino-telemetry off`` opts every process of the run (the direct call included) out of
OpenVINO's usage telemetry the documented way, a consent file under $HOME/intel (HOME
points at a scratch directory for the run). openvino.convert_model otherwise sends events
by forking a process per event that tries to reach the internet: here ~0.2 s per
conversion plus up to ~0.8 s of CPU in the background, which dwarfs what is measured.

``--baseline DIR`` runs a second copy of the services from another checkout (e.g.
``git archive <commit> | tar -x -C DIR``) turn by turn with this one, so a before/after
comparison sees the same load. Its processes import DIR's code (PYTHONPATH ahead of the
editable install) and use their own Redis and PostgreSQL databases.

Needs Redis and PostgreSQL on 127.0.0.1 (.ci/run starts them) and wrk (`apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from jobs_support import (  # noqa: E402 - the tests' process helpers, reused
    Proc,
    create_pg_database,
    free_port,
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


def fresh_pg() -> str:
    """Create and migrate a PostgreSQL database of its own (dropped at exit); return its URL."""
    from services.jobs.migrate import upgrade

    url = create_pg_database("kiln_bench")
    upgrade(url)
    return url


class Services:
    """An embedded `kiln serve` and a distributed api + per-engine workers, started once.

    ``tree``: run another checkout's code (the baseline) instead of this one's.
    """

    def __init__(self, root: Path, tree: Path | None = None, redis_db: int = 12) -> None:
        self.root = root
        self.tree = tree
        self.redis_db = redis_db
        self.procs: list[Proc] = []
        self._pg: str | None = None
        root.mkdir(parents=True, exist_ok=True)

    def env(self, **kiln: Any) -> dict[str, str]:
        env = service_env(**kiln)
        if self.tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(self.tree / "tests"), str(self.tree), env["PYTHONPATH"]])
        return env

    def start_embedded(self) -> str:
        port = free_port()
        proc = Proc(
            ["serve", "--port", str(port), "--repo", str(self.root / "emb-repo")],
            self.env(cache_dir=self.root / "emb-cache"),
            self.root / "serve.log",
        )
        self.procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", proc=proc)
        wait_workers(base, {"onnxruntime", "openvino"}, procs=[proc])
        return base

    def distributed_env(self) -> dict[str, Any]:
        if self._pg is None:
            self._pg = fresh_pg()
        return {
            "database_url": self._pg,
            "broker_url": redis_url(self.redis_db),
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
                    self.env(cache_dir=self.root / f"cache-{engine}", **env),
                    self.root / f"worker-{engine}.log",
                )
            )
        api = Proc(
            ["api", "--port", str(port), "--no-access-log", "--workers", str(api_workers), "--http", http],
            self.env(cache_dir=self.root / "api-cache", **env),
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


def _ts(value: str | None) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value).timestamp() if value else float("nan")


@dataclass
class ServiceRun:
    """One job through the service: the client's and the server's view, and per-step timings."""

    wall: float  # client: POST until the SSE stream's `finished`
    server: float  # finished_at - created_at
    work: float  # critical-path step seconds
    submit: float  # client: the POST itself
    # per step: (waited in queue, the step's own seconds, the rest of its claim-to-record span)
    steps: dict[str, tuple[float, float, float]]
    to_first_step: float  # created_at until the first step started
    after_last_step: float  # the last step's recorded finish until the client saw `finished`


_CLIENT: Any = None


def _client() -> Any:
    """One keep-alive HTTP client for the run, as a pipeline would hold.

    httpx's module-level calls build a client (and its TLS context) per call: 30-60 ms of
    the caller's own time here, which is not the service's.
    """
    global _CLIENT
    if _CLIENT is None:
        import httpx

        _CLIENT = httpx.Client(timeout=httpx.Timeout(120.0))
    return _CLIENT


def _submit(base: str, model: Path, spec: dict[str, Any], cache: bool) -> Any:
    with open(model, "rb") as fh:
        files = {
            "model": (model.name, fh, "application/octet-stream"),
            "spec": (None, json.dumps(spec), "application/json"),
        }
        return _client().post(f"{base}/compile", files=files, params={"cache": str(cache).lower()})


def _follow(base: str, job_id: str) -> None:
    """Read the job's event stream until `finished`."""
    with _client().stream("GET", f"{base}/jobs/{job_id}/events") as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "finished":
                return


def _service_run(base: str, model: Path, spec: dict[str, Any], cache: bool) -> ServiceRun:
    started = time.perf_counter()
    r = _submit(base, model, spec, cache)
    assert r.status_code == 202, r.text
    submitted = time.perf_counter()
    job_id = r.json()["id"]
    _follow(base, job_id)
    seen_finished = time.time()
    wall = time.perf_counter() - started
    job = wait_job(base, job_id)
    assert job["status"] == "succeeded", job
    work = _critical_path(job["plan"]["steps"], {s["id"]: s["seconds"] or 0.0 for s in job["steps"]})
    steps = {}
    for st in job["steps"]:
        q, b, e = _ts(st["queued_at"]), _ts(st["started_at"]), _ts(st["finished_at"])
        steps[st["id"]] = (b - q, st["seconds"] or 0.0, e - b - (st["seconds"] or 0.0))
    return ServiceRun(
        wall=wall,
        server=float(job["server_seconds"]),
        work=work,
        submit=submitted - started,
        steps=steps,
        to_first_step=_ts(job["started_at"]) - _ts(job["created_at"]),
        after_last_step=seen_finished - _ts(job["finished_at"]),
    )


def _direct_run(model: Path, spec: dict[str, Any], root: Path) -> tuple[float, float, dict[str, float]]:
    """Return (seconds, critical-path step seconds, each step's seconds) of an in-process compile_model."""
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
    seconds = {sid: o.seconds for sid, o in result.steps.items()}
    return wall, _critical_path(plan, seconds), seconds


def bench_overhead(
    models: list[tuple[str, Path]], runs: int, root: Path, bases: dict[str, str]
) -> tuple[list[str], list[str]]:
    """Return the overhead table and the per-step breakdown table (of the first model)."""
    lines = [
        "| model | mode | end-to-end (s) | vs direct | critical-path step work (s) | service plumbing (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    breakdown: list[str] = []
    for n, (label, model) in enumerate(models):
        _direct_run(model, SPEC, root)  # warm: imports and first-use costs out of the way
        for base in bases.values():
            _service_run(base, model, SPEC, cache=False)
        direct_rows: list[tuple[float, float, dict[str, float]]] = []
        rows: dict[str, list[ServiceRun]] = {mode: [] for mode in bases}
        for _ in range(runs):  # turn by turn: load from elsewhere hits every variant alike
            direct_rows.append(_direct_run(model, SPEC, root))
            for mode, base in bases.items():
                rows[mode].append(_service_run(base, model, SPEC, cache=False))
        direct = _median([r[0] for r in direct_rows])
        lines.append(
            f"| {label} | direct compile_model | {direct:.2f} | - | {_median([r[1] for r in direct_rows]):.2f} | - |"
        )
        for mode, runs_ in rows.items():
            wall = _median([r.wall for r in runs_])
            server = _median([r.server for r in runs_])
            work = _median([r.work for r in runs_])
            lines.append(
                f"| {label} | {mode} | {wall:.2f} | {wall - direct:+.2f} s ({(wall / direct - 1) * 100:+.0f}%) "
                f"| {work:.2f} | {server - work:.2f} |"
            )
            print(f"  {label} {mode}: {[(round(r.wall, 3), round(r.server, 3)) for r in runs_]}", file=sys.stderr)
        print(f"  {label} direct: {[round(r[0], 3) for r in direct_rows]}", file=sys.stderr)
        if n == 0:
            breakdown = _breakdown(label, direct_rows, rows)
    return lines, breakdown


def _breakdown(
    label: str, direct_rows: list[tuple[float, float, dict[str, float]]], rows: dict[str, list[ServiceRun]]
) -> list[str]:
    """Median per step: the direct call's seconds against each service variant's wait / work / rest."""
    modes = list(rows)
    head = "| step (" + label + ") | direct (ms) | " + " | ".join(f"{m}: wait / work / rest (ms)" for m in modes) + " |"
    out = [head, "|---|---:|" + "---:|" * len(modes)]
    for sid in direct_rows[0][2]:
        cells = [f"{_median([r[2][sid] for r in direct_rows]) * 1000:.0f}"]
        for m in modes:
            parts = [_median([r.steps[sid][i] for r in rows[m]]) * 1000 for i in range(3)]
            cells.append(" / ".join(f"{x:.0f}" for x in parts))
        out.append(f"| {sid} | " + " | ".join(cells) + " |")
    for what, attr in (
        ("POST /compile (client)", "submit"),
        ("created → first step starts", "to_first_step"),
        ("last step recorded → client sees `finished`", "after_last_step"),
    ):
        cells = ["-"] + [f"{_median([getattr(r, attr) for r in rows[m]]) * 1000:.0f}" for m in modes]
        out.append(f"| {what} | " + " | ".join(cells) + " |")
    return out


def bench_cache(model: Path, runs: int, bases: dict[str, str]) -> list[str]:
    lines = [
        "| deployment | server time, median (s) | max (s) | client end-to-end, median (s) |",
        "|---|---:|---:|---:|",
    ]
    for label, base in bases.items():
        _service_run(base, model, SPEC, cache=True)
        got = [_service_run(base, model, SPEC, cache=True) for _ in range(runs)]
        servers = [r.server for r in got]
        lines.append(
            f"| {label} | {_median(servers):.3f} | {max(servers):.3f} | {_median([r.wall for r in got]):.3f} |"
        )
    return lines


def _wrk(
    url: str, seconds: int, connections: int, threads: int = 2, headers: dict[str, str] | None = None
) -> tuple[float, str, str]:
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency"]
    for k, v in (headers or {}).items():
        cmd += ["-H", f"{k}: {v}"]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
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


def _poll_targets(base: str, model: Path) -> list[tuple[str, str, dict[str, str]]]:
    """Submit a job that finishes and one that stays running; return (label, url, headers) to poll."""
    import httpx

    finished = submit(base, model, SPEC).json()["id"]
    assert wait_job(base, finished)["status"] == "succeeded"
    # No tensorflow worker runs here: this job stays `running` at its SavedModel step,
    # so every GET has to find out whether it changed (finished jobs are served from memory).
    running = submit(base, model, {"targets": ["tfserving"]}).json()["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it waits at the step no worker takes
        steps = httpx.get(f"{base}/jobs/{running}").json()["steps"]
        if not any(st["status"] == "running" for st in steps) and any(st["status"] == "queued" for st in steps):
            break
        time.sleep(0.2)
    out: list[tuple[str, str, dict[str, str]]] = [
        ("finished (7 steps)", f"{base}/jobs/{finished}", {}),
        ("running (5 steps)", f"{base}/jobs/{running}", {}),
    ]
    etag = httpx.get(f"{base}/jobs/{running}").headers.get("etag")
    if etag:  # a poller sending back the ETag it got: 304 while nothing changed
        out.append(("running, If-None-Match", f"{base}/jobs/{running}", {"If-None-Match": etag}))
    return out


def bench_throughput(model: Path, root: Path, seconds: int, baseline: Path | None) -> list[str]:
    lines = [
        "| code | job polled | API processes | HTTP parser | connections | requests/s | p50 | p99 "
        "| CPU ms per request (API + PostgreSQL) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    trees: dict[str, Path | None] = {"this": None}
    if baseline is not None:
        trees["baseline"] = baseline
    for api_workers, http in ((1, "h11"), (1, "httptools"), (2, "httptools")):
        sets = {
            name: Services(root / f"tp{api_workers}{http}-{name}", tree=tree, redis_db=12 if tree is None else 11)
            for name, tree in trees.items()
        }
        try:
            polls = {}
            for name, svc in sets.items():
                base = svc.start_distributed(api_workers=api_workers, http=http)
                polls[name] = _poll_targets(base, model)
            for i, (label, _, _) in enumerate(polls["this"]):
                for conns in (16, 64):
                    for name, svc in sets.items():  # turn by turn
                        if i >= len(polls[name]):
                            continue
                        _, url, headers = polls[name][i]
                        _wrk(url, 2, conns, headers=headers)  # warm-up
                        pids = _api_and_db_pids(svc.api_pid)
                        cpu0 = _cpu_seconds(pids)
                        rps, p50, p99 = _wrk(url, seconds, conns, headers=headers)
                        cpu_ms = (_cpu_seconds(pids) - cpu0) / (rps * seconds) * 1000
                        lines.append(
                            f"| {name} | {label} | {api_workers} | {http} | {conns} | {rps:.0f} | {p50} | {p99} "
                            f"| {cpu_ms:.2f} |"
                        )
        finally:
            for svc in sets.values():
                svc.stop()
    return lines


def bench_isolation(model: Path, root: Path, runs: int = 30) -> list[str]:
    """The price of running a step outside the worker: a fresh child (fork, set up) or an idle one reused."""
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
        entry="jobs_support:ok_step",
        inputs={"model": "source"},
        tool="none",
    ).to_dict()
    rows = []
    for fresh in (True, False):
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
                scratch=root / "iso" / f"{fresh}-{i}",
                use_cache=False,
            )
            if fresh:
                child.shutdown_children()  # no idle child left: this step forks a new one
            started = time.perf_counter()
            res = child.run_in_child(req, soft_limit=60, hard_limit=90)
            assert res.ok, res.error
            if i:  # the first one also starts the forkserver
                totals.append((time.perf_counter() - started) * 1000)
                inner.append(res.seconds * 1000)
        totals.sort()
        what = "in a freshly forked child" if fresh else "in the idle child that ran the previous step"
        rows.append(
            f"| a trivial step {what}, end to end | {_median(totals):.0f} | {totals[int(len(totals) * 0.9)]:.0f} "
            f"| {_median(inner):.0f} |"
        )
    child.shutdown_children()
    return [
        "| what | median (ms) | p90 (ms) | of which the step itself (executor, store put), median (ms) |",
        "|---|---:|---:|---:|",
        *rows,
    ]


def _rss_tree(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _upload_once(root: Path, big: Path, size: int, tree: Path | None) -> tuple[float, int, int]:
    """POST ``big`` to a fresh `kiln api` (``tree``'s code when given); return (seconds to 202, RSS before, peak)."""
    port = free_port()
    env = Services(root, tree=tree).env(cache_dir=root / f"up-cache-{port}", max_upload_bytes=2 * size)
    api = Proc(["api", "--port", str(port), "--no-access-log"], env, root / "upload-api.log")
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
                "%{http_code} %{time_total}",
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
        assert out[0] == "202", out
        return float(out[1]), before, peak[0]
    finally:
        api.stop()
        shutil.rmtree(root / f"up-cache-{port}", ignore_errors=True)


def bench_upload(root: Path, size: int, baseline: Path | None = None, runs: int = 3) -> list[str]:
    """Upload one file ``runs`` times to this code's API (and the baseline's, turn by turn)."""
    big = root / "big.onnx"
    with open(big, "wb") as fh:
        fh.write(b"\x08\x08")  # looks like an ONNX ModelProto to detection; the job is never run
        chunk = os.urandom(1 << 20)
        for _ in range(size // len(chunk)):
            fh.write(chunk)
    trees: dict[str, Path | None] = {"this": None}
    if baseline is not None:
        trees["baseline"] = baseline.resolve()
    results: dict[str, list[tuple[float, int, int]]] = {k: [] for k in trees}
    try:
        for _ in range(runs):
            for label, tree in trees.items():
                results[label].append(_upload_once(root, big, size, tree))
    finally:
        big.unlink(missing_ok=True)
    mib = size / 2**20
    rows = [
        f"| code | upload | time to 202, median of {runs} (s) | throughput (MiB/s) | API RSS before (MiB) "
        "| peak during (MiB) | growth, worst (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, res in results.items():
        total = statistics.median(r[0] for r in res)
        growth = max(r[2] - r[1] for r in res)
        rows.append(
            f"| {label} | {mib:.0f} MiB ONNX-headed file, curl -F | {total:.2f} | {mib / total:.0f} "
            f"| {statistics.median(r[1] for r in res) / 2**20:.0f} | {max(r[2] for r in res) / 2**20:.0f} "
            f"| {growth / 2**20:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sections", default="isolation,overhead,cache,throughput,upload")
    parser.add_argument("--wrk-seconds", type=int, default=10)
    parser.add_argument("--upload-mib", type=int, default=1024)
    parser.add_argument("--baseline", type=Path, help="another checkout to run side by side (before/after)")
    parser.add_argument("--openvino-telemetry", choices=["on", "off"], default="on", help="see the module doc")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-service-"))
    if args.openvino_telemetry == "off":
        home = root / "home"
        (home / "intel").mkdir(parents=True)
        (home / "intel" / "openvino_telemetry").write_text("0")  # what `opt_in_out --opt_out` writes
        os.environ["HOME"] = str(home)  # read by this process and inherited by every service process
    print(
        f"# Service benchmarks ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, "
        f"OpenVINO telemetry {args.openvino_telemetry})\n"
    )
    try:
        from kiln_testing.models import tiny_cnn_onnx, tiny_transformer_onnx

        models = [
            ("tiny CNN", tiny_cnn_onnx(root / "cnn.onnx")),
            ("transformer block", tiny_transformer_onnx(root / "tf.onnx")),
        ]
        if sections & {"overhead", "cache"}:
            sets = [Services(root / "this")]
            if args.baseline is not None:
                sets.append(Services(root / "baseline", tree=args.baseline.resolve(), redis_db=11))
            try:
                bases: dict[str, str] = {}
                for svc in sets:
                    tag = "" if svc.tree is None else " (baseline)"
                    bases[f"embedded{tag}"] = svc.start_embedded()
                    bases[f"distributed{tag}"] = svc.start_distributed()
                if "overhead" in sections:
                    print(f"## Service overhead (targets onnxruntime + openvino, cache off, median of {args.runs})\n")
                    table, breakdown = bench_overhead(models, args.runs, root, bases)
                    print("\n".join(table) + "\n")
                    print("## Where the time goes, per step (median; rest = claim-to-record time outside the step)\n")
                    print("\n".join(breakdown) + "\n")
                if "cache" in sections:
                    print(f"## Identical resubmission, every step from the cache (median of {args.runs})\n")
                    print("\n".join(bench_cache(models[0][1], args.runs, bases)) + "\n")
            finally:
                for svc in sets:
                    svc.stop()
        if "isolation" in sections:
            print("## Process isolation per step (median of 30)\n")
            print("\n".join(bench_isolation(models[0][1], root)) + "\n")
        if "throughput" in sections:
            print(f"## GET /jobs/{{id}} under load (wrk -t2, {args.wrk_seconds} s, same 2 cores)\n")
            print("\n".join(bench_throughput(models[0][1], root, args.wrk_seconds, args.baseline)) + "\n")
        if "upload" in sections:
            print("## Upload (streamed to disk, hashed on the way)\n")
            print("\n".join(bench_upload(root, args.upload_mib * 2**20, args.baseline)) + "\n")
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
