"""The step sandbox, proven by a step that tries to escape it (tests/jobs_support.py: escape_step).

Real bubblewrap and Landlock on this host (.ci/run installs bubblewrap): the step reads a
planted secret file and environment variable, the worker's /proc entry, writes outside its
scratch, connects to a listening loopback socket and signals the worker. Each attempt must
fail, nothing may land on the host or reach the listener, and the planted secret must not
appear in the step's log, progress, error or metadata. The same with real engines, a real
`kiln serve` and `kiln api` + worker: tests/test_sandbox_service.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from jobs_support import PLANTED_SECRET, TESTS_DIR

from services.graph.planner import PlanStep
from services.sandbox import host_protection
from services.settings import Settings
from services.storage import LocalArtifactStore
from workers.child import StepRequest, protection, run_in_child

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)

pytestmark = pytest.mark.skipif(
    not host_protection("auto").confined, reason="neither bubblewrap nor Landlock can confine steps on this host"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cnn_onnx: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sandbox")
    os.environ["KILN_S3_SECRET_ACCESS_KEY"] = PLANTED_SECRET  # the worker's own secret, planted
    settings = Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",
        artifact_store=str(root / "store"),
        repository=str(root / "repo"),
        s3_secret_access_key=PLANTED_SECRET,
    )
    store = LocalArtifactStore(root / "store")
    upload = root / "upload"
    upload.mkdir()
    shutil.copy(cnn_onnx, upload / "cnn.onnx")
    store.put_dir("sources/cnn", upload)
    (root / "secret.txt").write_text(PLANTED_SECRET)
    (root / "outside").mkdir()
    yield {"root": root, "settings": settings, "store": store}
    os.environ.pop("KILN_S3_SECRET_ACCESS_KEY", None)


def _request(env: dict[str, Any], entry: str, name: str, aims: dict[str, Any]) -> StepRequest:
    step = PlanStep(
        id=f"convert-{name}",
        kind="convert",
        engine="onnxruntime",
        entry=entry,
        inputs={"model": "source"},
        options={"aims": aims},
        tool="t",
    )
    return StepRequest(
        job_id="job-" + name,
        step=step.to_dict(),
        spec={"targets": ["onnxruntime"], "benchmark": False},
        source_key="sources/cnn",
        source_filename="cnn.onnx",
        input_keys={},
        settings=env["settings"],
        scratch=env["root"] / "scratch" / name,
        use_cache=False,
    )


class _Listener:
    """A loopback TCP server that records every connection it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[Any] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
                self.accepted.append(addr)
                conn.close()
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self.thread.join()
        self.sock.close()


def test_a_step_cannot_read_secrets_write_outside_scratch_open_a_socket_or_signal_the_worker(
    env: dict[str, Any],
) -> None:
    listener = _Listener()
    aims = {
        "secret_file": str(env["root"] / "secret.txt"),
        "outside": str(env["root"] / "outside" / "pwned.txt"),
        "port": listener.port,
        "worker_pid": os.getpid(),
    }
    progress: list[str] = []
    try:
        res = run_in_child(
            _request(env, "jobs_support:escape_step", "escape", aims),
            soft_limit=60,
            hard_limit=90,
            on_progress=progress.append,
        )
    finally:
        listener.close()
    assert res.ok, res.error
    seen = json.loads((env["store"].local_path(res.key) / "out.json").read_text())
    for what in ("secret_file", "secret_env", "worker_environ", "write_outside", "connect", "signal_worker"):
        assert seen[what].startswith("refused"), (what, seen[what])
    assert seen["write_scratch"].startswith("succeeded")  # its own scratch is writable
    assert seen["own_environ"].startswith("succeeded") and "KILN_S3" not in seen["own_environ"]
    assert listener.accepted == []
    assert not (env["root"] / "outside" / "pwned.txt").exists()
    # Redacted wherever the step's words go: its log, its progress, its metadata.
    assert "tool output: [redacted]" in res.log and PLANTED_SECRET not in res.log
    assert progress == ["progress with [redacted]"]
    assert res.meta["note"] == "meta [redacted]"
    assert PLANTED_SECRET not in json.dumps(res.meta)
    assert protection(env["settings"]).mode == host_protection("auto").mode


def test_a_link_planted_in_a_steps_output_is_refused_not_followed(env: dict[str, Any]) -> None:
    aims = {"secret_file": str(env["root"] / "secret.txt")}
    res = run_in_child(_request(env, "jobs_support:link_planting_step", "link", aims), soft_limit=60, hard_limit=90)
    assert not res.ok and res.error["code"] == "CONVERSION_FAILED"
    assert "points outside it" in res.error["message"]
    stored = list((env["root"] / "store").rglob("model.onnx"))
    assert all(PLANTED_SECRET not in p.read_text(errors="replace") for p in stored if not p.is_symlink())


def test_the_protection_summary_says_what_is_in_force() -> None:
    prot = host_protection("auto")
    line = prot.summary()
    assert line.startswith("sandbox: ")
    if prot.mode == "bwrap+landlock":
        assert "bubblewrap + Landlock ABI" in line and "own scratch" in line
    off = host_protection("off")
    assert off.mode == "off" and "OFF" in off.summary()


def test_the_view_reads_kilns_own_packages_however_they_were_installed(tmp_path: Path) -> None:
    # An editable install (setuptools' import-hook finder) puts no sys.path entry for the
    # checkout: `kiln worker`'s forkserver then failed every step with "No module named 'cli'".
    # A fresh interpreter outside the checkout sees sys.path as the `kiln` script does.
    import subprocess
    import sys

    probe = (
        "import importlib.util, json, pathlib\n"
        "from services.sandbox import sandbox_view\n"
        f"view = sandbox_view(pathlib.Path({str(tmp_path / 'root')!r}), environ={{}})\n"
        "pkgs = {n: importlib.util.find_spec(n).submodule_search_locations for n in ('services', 'workers', 'cli', 'api')}\n"
        "print(json.dumps({'read': [str(p) for p in view.read], 'pkgs': {n: list(v) for n, v in pkgs.items()}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    seen = json.loads(out.stdout)
    read = [Path(p) for p in seen["read"]]
    for name, folders in seen["pkgs"].items():
        assert folders, name
        for folder in map(Path, folders):
            assert any(folder.resolve() == p or p in folder.resolve().parents for p in read), (name, folder, read)
