"""Shared helpers for the service tests (no tests here): real PostgreSQL and Redis, processes, HTTP.

PostgreSQL: a throwaway database per test session on 127.0.0.1:5432 (trust auth, user
postgres), dropped at exit. Redis: database 13 on 127.0.0.1:6379, flushed at start and exit.
Redis databases 13 and 14 are used. Both are the machine's real servers (.ci/run starts them when they are not answering).
Fixtures imported by several modules share one database through the cached helpers here.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent
# The real servers the service tests use; elsewhere than this machine (PostgreSQL with
# trust auth on loopback) point these at a superuser URL and a Redis server.
PG_ADMIN = os.environ.get("KILN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("KILN_TEST_REDIS", "redis://127.0.0.1:6379").rstrip("/")
#: The `kiln` command of the Python running the tests, wherever the checkout or its virtualenv
#: lives: the console script beside the interpreter, else the CLI module run by it.
_SCRIPT = Path(sys.executable).parent / "kiln"
KILN_CMD: list[str] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "cli.main"]


def tool_python(variable: str, makefile_venv: str, make_target: str, what: str) -> Path:
    """Return the interpreter of a tool kept in a venv of its own: $variable, else the Makefile's venv.

    ``makefile_venv`` names the Makefile variable holding the venv's folder (AIRFLOW_VENV, ...),
    which ``make make_target`` builds; the test skips, saying so, when neither is there.
    """
    given = os.environ.get(variable)
    if given:
        python = Path(given)
    else:
        found = re.search(rf"^{makefile_venv}\s*:=\s*(\S+)", (REPO_ROOT / "Makefile").read_text(), re.M)
        assert found is not None, f"the Makefile names no {makefile_venv}"
        python = REPO_ROOT / found[1] / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{what} is not installed: run `make {make_target}` (or set {variable})")
    return python


def _pg_up() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return True
    except Exception:
        return False


@cache
def pg_database() -> str:
    """Create this session's PostgreSQL database (once per process); return its URL."""
    if not _pg_up():
        pytest.fail(f"PostgreSQL is not answering at {PG_ADMIN} (KILN_TEST_POSTGRES); run .ci/run, which starts it")
    return create_pg_database("kiln_test")


def create_pg_database(prefix: str) -> str:
    """Create a PostgreSQL database of its own, dropped at exit; return its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        from services.jobs.db import _ENGINES

        for engine in list(_ENGINES.values()):
            if name in str(engine.url):
                engine.dispose()
        with contextlib.suppress(Exception), psycopg.connect(PG_ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    atexit.register(drop)
    return str(make_url(PG_ADMIN).set(database=name).render_as_string(hide_password=False))


@cache
def migrated_pg(*, own: bool = False) -> str:
    """Return the session's migrated PostgreSQL database, or with ``own`` a new one for this caller.

    The session's database keeps every earlier test's jobs, some left running by workers those
    tests killed; they count against the default tenant's running quota (4), so a test that
    needs its jobs to start whatever ran before takes a database of its own.
    """
    from services.jobs.migrate import upgrade

    url = create_pg_database("kiln_test") if own else pg_database()
    upgrade(url)
    return url


@cache
def redis_url(db: int = 13) -> str:
    """Return a test Redis database's URL (13: end-to-end, 14: API tests), flushed now and at exit."""
    import redis

    url = f"{REDIS_BASE}/{db}"
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.flushdb()
    except Exception:
        pytest.fail(f"Redis is not answering at {REDIS_BASE} (KILN_TEST_REDIS); run .ci/run, which starts it")

    def flush() -> None:
        with contextlib.suppress(Exception):
            client.flushdb()

    atexit.register(flush)
    return url


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free 127.0.0.1 ports for a server a test starts."""
    # Hold all sockets open until every port is picked, so the n ports are distinct.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def die_with_parent() -> None:
    """In a server's child process (``preexec_fn``): ask Linux to SIGKILL it when the test process dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux/glibc: the server's stop() still kills it on a normal exit


@cache
def _elsewhere_root() -> Path:
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="kiln-elsewhere-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def elsewhere(what: str = "cwd") -> Path:
    """Return a new empty directory outside the checkout: where a user starts `kiln`, or their HOME.

    Kiln's processes in the tests start here, never in the checkout, so nothing they do can lean
    on the checkout being their working directory (issue 27: a child that chdir'ed to the
    directory `kiln serve` started from failed in the sandbox, which has no such directory).
    """
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"{what}-", dir=_elsewhere_root()))


def service_env(**kiln: Any) -> dict[str, str]:
    """Return an environment for a `kiln` subprocess with the given KILN_* settings and a HOME of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["HOME"] = str(elsewhere("home"))
    for shared in ("KILN_HOST_LOCK_DIR", "KILN_BENCH_QUIET_WAIT"):  # the test run's own (conftest)
        if shared in os.environ:
            env[shared] = os.environ[shared]
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if "cache_dir" in kiln:
        # Each service's embedded job database beside its cache, never the user's own.
        kiln.setdefault("data_dir", Path(kiln["cache_dir"]) / "data")
    for key, value in kiln.items():
        env[f"KILN_{key.upper()}"] = str(value)
    if "test_gate" in kiln:  # the gated steps read the variable and write their marks there, sandboxed
        env["KILN_SANDBOX_ENV"] = "KILN_TEST_GATE"
        env["KILN_SANDBOX_WRITABLE"] = str(kiln["test_gate"])
    return env


class Proc:
    """A `kiln ...` subprocess in its own process group, logging to a file."""

    def __init__(
        self, args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None, kiln: list[str] | None = None
    ) -> None:
        """``kiln``: the command to run (default: this Python's `kiln`; the installed wheel's in its tests)."""
        self.args, self.log = args, log
        self.cwd = cwd or elsewhere()
        self._fh = open(log, "ab")
        self.popen = subprocess.Popen(
            [*(kiln or KILN_CMD), *args],
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.cwd,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (worker, its forkserver and step children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group(signal.SIGKILL)
                self.popen.wait(5)
        self.kill_group(signal.SIGKILL)  # stragglers of the group (forkserver, children)
        self._fh.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def wait_http(url: str, timeout: float = 60.0, proc: Proc | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise AssertionError(f"process died:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout}s" + (f":\n{proc.tail()}" if proc else ""))


def wait_workers(base: str, engines: set[str], timeout: float = 90.0, procs: list[Proc] | None = None) -> None:
    """Wait until GET /engines shows a live worker for each engine."""
    import httpx

    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for p in procs or []:
            if not p.alive():
                raise AssertionError(f"worker died:\n{p.tail()}")
        body = httpx.get(f"{base}/engines", timeout=5).json()
        live = {e["name"] for e in body["engines"] if e["workers"] > 0}
        if engines <= live:
            return
        time.sleep(0.3)
    raise AssertionError(f"workers for {engines} not live: {json.dumps(body)[:500]}")


@contextlib.contextmanager
def kiln_serve(root: Path, engines: set[str] | None = None, **kiln: Any) -> Iterator[tuple[str, Proc]]:
    """Run `kiln serve` (repository under ``root``, the given KILN_* settings) on a free port.

    Yields (base URL, process) once it answers and, with ``engines``, once each has a live worker.
    """
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache", **kiln),
        root / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", timeout=120, proc=proc)
        if engines:
            wait_workers(base, engines, timeout=240, procs=[proc])
        yield base, proc
    finally:
        proc.stop()


def submit(
    base: str,
    model: Path,
    spec: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Any:
    """POST /compile as a pipeline would (multipart: model file + spec JSON); return the response."""
    import httpx

    with open(model, "rb") as fh:
        files = {
            "model": (model.name, fh, "application/octet-stream"),
            "spec": (None, json.dumps(spec), "application/json"),
        }
        return httpx.post(f"{base}/compile", files=files, headers=headers, params=params, timeout=60)


def read_sse(base: str, job_id: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Follow GET /jobs/{id}/events to its end; return the events' data in order."""
    import httpx

    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{base}/jobs/{job_id}/events", timeout=httpx.Timeout(timeout)) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


def wait_job(
    base: str, job_id: str, timeout: float = 120.0, final: tuple[str, ...] = ("succeeded", "failed", "cancelled")
) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            job = httpx.get(f"{base}/jobs/{job_id}", timeout=5).json()
            if job.get("status") in final:
                return job
        except httpx.HTTPError:
            pass  # the API may be restarting
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish: {json.dumps(job)[:2000]}")


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def python() -> str:
    return sys.executable


# --- step entries for provoking faults in a step child (loaded by "jobs_support:<name>") ---


def ok_step(ctx: Any) -> Any:
    """Write one file and report progress: a step that works."""
    from services.artifacts import Artifact

    ctx.progress("halfway there")
    print("tool output line", flush=True)
    (ctx.out_dir / "out.txt").write_text(ctx.source.sha256)
    return Artifact(root=ctx.out_dir, kind="onnx", entry="out.txt", meta={"answer": 42})


def untidy_step(ctx: Any) -> Any:
    """Works, but leaves the process changed: an environment variable, the working directory."""
    os.environ["KILN_TEST_LEFTOVER"] = "1"
    os.chdir("/")
    return ok_step(ctx)


def probe_step(ctx: Any) -> Any:
    """Records what the process looks like: the leftover variable (or "-") and the working directory."""
    from services.artifacts import Artifact

    (ctx.out_dir / "out.txt").write_text(f"{os.environ.get('KILN_TEST_LEFTOVER', '-')} {os.getcwd()}")
    return Artifact(root=ctx.out_dir, kind="onnx", entry="out.txt")


def device_step(ctx: Any) -> Any:
    """Records whether the step can open and read the device node named in its aims (a GPU's, or a stand-in)."""
    from services.artifacts import Artifact

    device = ctx.step.options["aims"]["device"]
    try:
        with open(device, "rb", buffering=0) as fh:
            opened = f"succeeded: read {len(fh.read(4))} bytes"
    except OSError as exc:
        opened = f"refused: {type(exc).__name__}: {exc.strerror}"
    (ctx.out_dir / "out.json").write_text(json.dumps({"opened": opened}))
    return Artifact(root=ctx.out_dir, kind="onnx", entry="out.json")


def segfault_step(ctx: Any) -> Any:
    import ctypes

    ctx.progress("about to crash")
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def sigkill_step(ctx: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does


def stubborn_sleep_step(ctx: Any) -> Any:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores the soft limit; only SIGKILL stops it
    time.sleep(120)


def sleep_step(ctx: Any) -> Any:
    time.sleep(120)


def raising_step(ctx: Any) -> Any:
    raise RuntimeError("the converter could not handle op FancyOp")


def path_raising_step(ctx: Any) -> Any:
    """Fails like a tool naming the host file it choked on, after some output of its own."""
    print("loading the model", flush=True)
    raise ValueError(f"cannot parse {ctx.source.path}: unexpected end of data")


def gated_s3_publish(ctx: Any) -> Any:
    """The real publish step, held at a gate halfway through writing the version to S3.

    After the first batch of the version's files is uploaded (the model, not yet its manifest)
    it marks $KILN_TEST_GATE/<job id>/mid-publish and waits for .../release-publish.
    """
    import services.repository.s3 as s3_repo
    from services.pipeline.publish import run_publish_step

    gate = Path(os.environ["KILN_TEST_GATE"]) / ctx.job_id
    gate.mkdir(parents=True, exist_ok=True)
    real_upload = s3_repo.upload_files
    calls = []

    def upload_then_wait(*args: Any, **kwargs: Any) -> Any:
        result = real_upload(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            (gate / "mid-publish").touch()
            deadline = time.monotonic() + 120
            while not (gate / "release-publish").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return result

    s3_repo.upload_files = upload_then_wait  # type: ignore[assignment]
    try:
        return run_publish_step(ctx)
    finally:
        s3_repo.upload_files = real_upload  # type: ignore[assignment]


def gated_registry() -> Any:
    """The default converter graph with the onnxruntime exporter held at a per-job gate (below)."""
    import dataclasses

    from services.graph.registry import Registry, default_registry
    from services.spec import TargetName

    reg = Registry()
    for conv in default_registry().converters:
        reg.add_converter(conv)
    for exp in default_registry().exporters:
        if exp.target is TargetName.ONNXRUNTIME:
            exp = dataclasses.replace(exp, entry="jobs_support:slow_export_onnxruntime")
        reg.add_exporter(exp)
    return reg


def slow_export_onnxruntime(ctx: Any) -> Any:
    """The real onnxruntime exporter, held at a gate: $KILN_TEST_GATE/<job id>/release must exist.

    Marks $KILN_TEST_GATE/<job id>/started-<pid> first, so a test knows the step is running and
    which process runs it.
    """
    from services.exporters.onnxruntime import export_onnxruntime

    gate = Path(os.environ["KILN_TEST_GATE"]) / ctx.job_id
    gate.mkdir(parents=True, exist_ok=True)
    (gate / f"started-{os.getpid()}").touch()
    deadline = time.monotonic() + 120
    while not (gate / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return export_onnxruntime(ctx)


# --- a step that acts as a model that got code execution would (tests/test_sandbox.py) ---

#: The planted secret: in the worker's environment (KILN_S3_SECRET_ACCESS_KEY) and in a file beside the test.
PLANTED_SECRET = "kiln-planted-secret-7f3a9c1e"


def escape_step(ctx: Any) -> Any:
    """Try what a hostile model would; record each attempt's outcome in out.json (the artifact).

    ``ctx.step.options["aims"]`` carries the test's targets: the secret file, a path outside
    scratch to write, a listening loopback port and the worker's pid.
    """
    import socket

    from services.artifacts import Artifact

    aims = ctx.step.options["aims"]
    seen: dict[str, str] = {}

    def attempt(what: str, action: Any) -> None:
        try:
            seen[what] = "succeeded: " + str(action())[:200]
        except Exception as exc:
            seen[what] = f"refused: {type(exc).__name__}: {exc}"[:300]

    attempt("secret_file", lambda: Path(aims["secret_file"]).read_text())
    attempt("secret_env", lambda: os.environ["KILN_S3_SECRET_ACCESS_KEY"])
    attempt("own_environ", lambda: Path("/proc/self/environ").read_bytes().decode(errors="replace"))
    attempt("worker_environ", lambda: Path(f"/proc/{aims['worker_pid']}/environ").read_bytes()[:100])
    attempt("write_outside", lambda: Path(aims["outside"]).write_text("pwned"))
    attempt("connect", lambda: socket.create_connection(("127.0.0.1", aims["port"]), timeout=3).close())
    attempt("signal_worker", lambda: os.kill(aims["worker_pid"], 0))
    attempt("write_scratch", lambda: (ctx.scratch / "mine.txt").write_text("ok"))
    # What a step prints, reports or fails with is redacted even when it knows a secret.
    print(f"tool output: {PLANTED_SECRET}", flush=True)
    ctx.progress(f"progress with {PLANTED_SECRET}")
    (ctx.out_dir / "out.json").write_text(json.dumps(seen))
    return Artifact(root=ctx.out_dir, kind="onnx", entry="out.json", meta={"note": f"meta {PLANTED_SECRET}"})


def link_planting_step(ctx: Any) -> Any:
    """Leaves a link to a host file in its output, hoping the worker copies the file into the artifact."""
    from services.artifacts import Artifact

    (ctx.out_dir / "model.onnx").symlink_to(ctx.step.options["aims"]["secret_file"])
    return Artifact(root=ctx.out_dir, kind="onnx", entry="model.onnx")


def sandboxed_host_pid(pid: int, environ_marker: str) -> int:
    """Return, as this process sees it, the pid of a step child that knows itself as ``pid``.

    Under bubblewrap step children run in a PID namespace of their own, so the pid a step writes
    down is the sandbox's; the host's is the process whose innermost NSpid is ``pid`` and whose
    environment holds ``environ_marker`` (e.g. ``KILN_TEST_GATE=<the test's gate folder>``).
    Without a namespace the numbers are the same.
    """
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            nspid = next(line.split()[1:] for line in status.read_text().splitlines() if line.startswith("NSpid:"))
            if len(nspid) > 1 and nspid[-1] == str(pid):
                if environ_marker.encode() in (status.parent / "environ").read_bytes():
                    return int(status.parent.name)
        except (OSError, StopIteration, ValueError):
            continue
    return pid


def limits_step(ctx: Any) -> Any:
    """Try to exceed each per-step resource limit; record each attempt's outcome in out.json (the artifact).

    ``ctx.step.options["aims"]``: how much to try (the test sets limits below these).
    """
    import resource
    import subprocess

    from services.artifacts import Artifact

    aims = ctx.step.options["aims"]
    seen: dict[str, str] = {}

    def attempt(what: str, action: Any) -> None:
        try:
            seen[what] = "succeeded: " + str(action())[:200]
        except BaseException as exc:  # MemoryError included
            seen[what] = f"refused: {type(exc).__name__}: {exc}"[:300]

    def allocate() -> int:
        block = bytearray(aims["allocate"])  # one mapping past the address-space limit
        return len(block)

    def open_many() -> int:
        held = [open(os.devnull) for _ in range(aims["files"])]
        n = len(held)
        for f in held:
            f.close()
        return n

    def spawn_many() -> int:
        procs = []
        try:
            for _ in range(aims["processes"]):
                procs.append(subprocess.Popen(["sleep", "5"]))
            return len(procs)
        finally:
            for p in procs:
                p.kill()
                p.wait()

    def write_big() -> int:
        with open(ctx.scratch / "big.bin", "wb") as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(aims["write_mib"]):
                f.write(chunk)
        return aims["write_mib"]

    attempt("address_space", allocate)
    attempt("open_files", open_many)
    attempt("processes", spawn_many)
    attempt("file_size", write_big)
    seen["limits"] = json.dumps(
        {
            n: resource.getrlimit(getattr(resource, n))[1]
            for n in ("RLIMIT_AS", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE")
        }
    )
    (ctx.out_dir / "out.json").write_text(json.dumps(seen))
    if aims.get("spin_seconds"):  # burn CPU past the step's CPU limit
        end = time.monotonic() + aims["spin_seconds"]
        while time.monotonic() < end:
            pass
    return Artifact(root=ctx.out_dir, kind="onnx", entry="out.json")
