"""Kiln as its users install it: the wheel, in a virtualenv of its own, run from anywhere.

The rest of the suite imports the checkout (an editable install) and, until issue 27, started
its processes from inside it, so a file the wheel does not carry, a dependency only the dev
extras bring, or a path resolved against the working directory passed there and failed for
every user. Here the wheel is built from the checkout, installed with the extras `make demo`
installs (onnxruntime, openvino) plus the service's, into a fresh virtualenv outside the
checkout; every command runs from an empty temporary directory with a HOME of its own and no
PYTHONPATH, so nothing of the checkout can be imported.

KILN_TEST_WHEEL_FROM=DIR builds the wheel from another checkout instead (to show what an older
main did with the same test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from jobs_support import (
    REPO_ROOT,
    Proc,
    create_pg_database,
    free_port,
    redis_url,
    submit,
    wait_http,
    wait_job,
    wait_workers,
)

EXTRAS = "onnxruntime,openvino,service"
EXAMPLE = REPO_ROOT / "examples" / "tiny_cnn.onnx"
SPEC = {"targets": ["onnxruntime", "openvino"], "benchmark": {"iterations": 3, "warmup": 1}}

pytestmark = pytest.mark.timeout(1500)


@dataclass
class Installed:
    """A virtualenv holding the Kiln wheel, and a place outside the checkout to run it from."""

    venv: Path
    wheel: Path
    root: Path

    def env(self, home: Path, **kiln: object) -> dict[str, str]:
        """The environment a user's shell gives `kiln`: the venv on PATH, their HOME, no test paths."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KILN_", "PYTHON", "VIRTUAL_ENV")) and k not in ("HOME", "PATH")
        }
        env.update(HOME=str(home), PATH=f"{self.venv / 'bin'}{os.pathsep}/usr/local/bin:/usr/bin:/bin")
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        env.update({f"KILN_{k.upper()}": str(v) for k, v in kiln.items()})
        # The suite's host gate (conftest): this run's steps take turns with the other tests'.
        if "KILN_HOST_LOCK_DIR" in os.environ:
            env["KILN_HOST_LOCK_DIR"] = os.environ["KILN_HOST_LOCK_DIR"]
        return env

    def place(self, name: str) -> tuple[Path, Path]:
        """Return (an empty working directory, an empty HOME) for one user session."""
        cwd, home = self.root / name / "cwd", self.root / name / "home"
        cwd.mkdir(parents=True)
        home.mkdir(parents=True)
        return cwd, home

    def kiln(self) -> str:
        return str(self.venv / "bin" / "kiln")


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    source = Path(os.environ.get("KILN_TEST_WHEEL_FROM", REPO_ROOT))
    # A copy without the checkout's build leftovers and virtualenvs: the wheel is what
    # setuptools makes of the tracked sources, as a release build would see them.
    tree = root / "src"
    files = _run(["git", "-C", str(source), "ls-files", "-z"]).stdout.split("\0")
    for rel in filter(None, files):
        if (source / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, tree / rel)
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(tree)])
    (wheel,) = dist.glob("kiln-*.whl")
    venv = root / "venv"
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    _run([str(base_python), "-m", "venv", str(venv)])
    # The checkout's constraints pick the versions the suite tested; pip's cache serves them.
    _run(
        [str(venv / "bin" / "pip"), "install", "-q", "-c", str(source / "constraints.txt"), f"{wheel}[{EXTRAS}]"],
        cwd=root,
    )
    shutil.rmtree(tree)
    return Installed(venv=venv, wheel=wheel, root=root)


def test_the_wheel_carries_what_the_service_reads_at_run_time(installed: Installed) -> None:
    import zipfile

    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for needed in (
        "services/jobs/alembic.ini",
        "services/jobs/migrations/script.py.mako",
        "api/ui/static/kiln.js",
        "api/ui/templates/job.html",
        "kiln_client/__init__.py",
    ):
        assert needed in names, f"the wheel lacks {needed}"
    assert not any(n.startswith(("tests/", "kiln_testing/", "benchmarks/")) for n in names)
    # Nothing of the checkout is on the installed interpreter's path.
    cwd, home = installed.place("imports")
    probe = "import api, kiln_client, services; print(api.__file__); print(kiln_client.__file__)"
    out = _run([str(installed.venv / "bin" / "python"), "-c", probe], cwd=cwd, env=installed.env(home)).stdout
    for line in out.splitlines():
        assert line.startswith(str(installed.venv)), out


def test_kiln_compile_and_inspect_from_an_empty_directory(installed: Installed) -> None:
    cwd, home = installed.place("compile")
    shutil.copy(EXAMPLE, cwd / "tiny_cnn.onnx")
    env = installed.env(home)
    _run(
        [
            installed.kiln(),
            "compile",
            "tiny_cnn.onnx",
            "--target",
            "onnxruntime",
            "--target",
            "openvino",
            "--repo",
            "model-repository",
            "--name",
            "tiny-cnn",
        ],
        cwd=cwd,
        env=env,
        timeout=600,
    )
    triton = cwd / "model-repository" / "triton"
    assert (triton / "tiny-cnn-onnxruntime" / "1" / "model.onnx").is_file()
    assert (triton / "tiny-cnn-openvino" / "1" / "model.xml").is_file()
    # Its defaults live under this user's HOME: the step cache and the signing key made for them.
    assert (home / ".cache" / "kiln" / "store").is_dir()
    assert (home / ".local" / "share" / "kiln" / "signing-key.pem").is_file()
    verified = _run([installed.kiln(), "verify", str(triton / "tiny-cnn-onnxruntime" / "1")], cwd=cwd, env=env)
    assert verified.stdout.startswith("verified "), verified.stdout
    shown = _run([installed.kiln(), "inspect", "tiny_cnn.onnx", "--json"], cwd=cwd, env=env, timeout=300).stdout
    assert json.loads(shown)["inputs"][0]["name"] == "input"


@pytest.fixture
def services() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for s in started:
        s.stop()


def _compiles_through(base: str, started: list[Proc], model: Path) -> dict[str, object]:
    wait_workers(base, {"onnxruntime", "openvino"}, timeout=240, procs=started)
    r = submit(base, model, SPEC)
    assert r.status_code == 202, r.text
    job = wait_job(base, r.json()["id"], timeout=600)
    logs = "\n".join(s.tail() for s in started)
    assert job["status"] == "succeeded", f"{json.dumps(job)[:3000]}\n{logs}"
    for target in ("onnxruntime", "openvino"):
        assert job["targets"][target]["parity"]["passed"] is True
        assert job["targets"][target]["published"]["version"] >= 1
    return job


def test_kiln_serve_from_an_empty_directory_compiles_and_shows_the_job(
    installed: Installed, services: list[Proc]
) -> None:
    cwd, home = installed.place("serve")
    port = free_port()
    serve = Proc(
        ["serve", "--port", str(port), "--repo", "model-repository"],
        installed.env(home),
        installed.root / "serve.log",
        cwd=cwd,
        kiln=[installed.kiln()],
    )
    services.append(serve)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", timeout=120, proc=serve)
    job = _compiles_through(base, services, EXAMPLE)
    published = job["targets"]["onnxruntime"]["published"]  # type: ignore[index]
    # The repository path given relative to where `kiln serve` started resolves there.
    uri = Path(published["uri"])
    assert uri.is_relative_to(cwd / "model-repository") and (uri / "model.onnx").is_file(), published
    page = httpx.get(f"{base}/ui/jobs/{job['id']}", timeout=30)
    assert page.status_code == 200 and job["id"] in page.text and "succeeded" in page.text
    # The page's own script and style come from the wheel's static files.
    for asset in ("/ui/static/kiln.js", "/ui/static/kiln.css"):
        assert httpx.get(f"{base}{asset}", timeout=30).status_code == 200, asset


def test_kiln_api_and_kiln_worker_on_postgresql_and_redis(installed: Installed, services: list[Proc]) -> None:
    cwd, home = installed.place("cluster")
    settings = {
        "database_url": create_pg_database("kiln_wheel"),
        "broker_url": redis_url(),
        "repository": str(cwd / "model-repository"),
        "artifact_store": str(cwd / "store"),
    }
    # The job store's migrations ship in the wheel: the installed `kiln migrate` applies them.
    _run([installed.kiln(), "migrate"], cwd=cwd, env=installed.env(home, **settings), timeout=120)
    port = free_port()
    for engine in ("onnxruntime", "openvino"):
        services.append(
            Proc(
                ["worker", "--engine", engine, "--concurrency", "1"],
                installed.env(home, cache_dir=cwd / f"cache-{engine}", **settings),
                installed.root / f"worker-{engine}.log",
                cwd=cwd,
                kiln=[installed.kiln()],
            )
        )
    api = Proc(
        ["api", "--port", str(port), "--no-access-log"],
        installed.env(home, cache_dir=cwd / "cache-api", **settings),
        installed.root / "api.log",
        cwd=cwd,
        kiln=[installed.kiln()],
    )
    services.append(api)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz", timeout=120, proc=api)
    _compiles_through(base, services, EXAMPLE)
