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


def test_each_step_runs_under_its_resource_limits(env: dict[str, Any], tmp_path: Path) -> None:
    """Address space, open files, processes and file size are rlimits each step child sets (and cannot raise);
    CPU time per step is the worker's to count. Limits set low here, and a tenant of its own (a fresh child)."""
    import dataclasses

    limited = env["settings"].model_copy(
        update={
            "step_max_address_space": 3 << 30,
            "step_max_open_files": 256,
            "step_max_processes": 64,
            "step_max_output_bytes": 4 << 20,
            "step_max_cpu_seconds": 3,
        }
    )
    aims = {"allocate": 4 << 30, "files": 400, "processes": 200, "write_mib": 8}
    req = dataclasses.replace(_request(env, "jobs_support:limits_step", "limits", aims), settings=limited, tenant="lim")
    res = run_in_child(req, soft_limit=120, hard_limit=150)
    assert res.ok, res.error
    seen = json.loads((env["store"].local_path(res.key) / "out.json").read_text())
    assert seen["address_space"].startswith("refused: MemoryError"), seen
    assert seen["open_files"].startswith("refused: OSError") and "Too many open files" in seen["open_files"], seen
    if os.geteuid() != 0:  # the kernel exempts the host's root user from RLIMIT_NPROC (workers run as uid 10001)
        assert seen["processes"].startswith("refused:") and "temporarily unavailable" in seen["processes"], seen
    assert seen["file_size"].startswith("refused: OSError") and "too large" in seen["file_size"], seen
    assert json.loads(seen["limits"]) == {
        "RLIMIT_AS": 3 << 30,
        "RLIMIT_NOFILE": 256,
        "RLIMIT_NPROC": 64,
        "RLIMIT_FSIZE": 4 << 20,
    }
    # CPU: a step that spins past its 3 CPU seconds is stopped, well before its 120 s time limit.
    spin = dataclasses.replace(
        _request(env, "jobs_support:limits_step", "spin", {**aims, "spin_seconds": 60}), settings=limited, tenant="lim"
    )
    res = run_in_child(spin, soft_limit=120, hard_limit=150)
    assert not res.ok and res.error["code"] == "TIMEOUT" and "CPU seconds" in res.error["message"], res.error


#: A real character device that bubblewrap's fresh /dev does not have: it stands in for a GPU's
#: nodes on this host, which has no NVIDIA GPU (the GPU machine runs the real ones: docker/gpu_check.py).
STAND_IN_DEVICE = Path("/dev/cpu_dma_latency")


@pytest.mark.skipif(not STAND_IN_DEVICE.exists(), reason="the stand-in device node is not on this host")
def test_a_gpu_workers_steps_open_the_gpus_device_nodes_and_a_cpu_workers_do_not(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU worker's blocker (issue 29): inside bubblewrap a step saw an empty /dev, so CUDA
    found no device. A worker serving a GPU engine binds the GPU's device nodes in and Landlock
    allows them; a CPU worker's steps still cannot open them."""
    import workers.child as child
    from services.sandbox import gpu_devices

    monkeypatch.setattr(child, "gpu_devices", lambda: gpu_devices([str(STAND_IN_DEVICE)]))
    monkeypatch.setattr(child, "_DEVICES", ())

    def opened(name: str) -> str:
        res = run_in_child(
            # The run's name in its aims too: steps with the same options share one stored output.
            _request(env, "jobs_support:device_step", name, {"device": str(STAND_IN_DEVICE), "run": name}),
            soft_limit=60,
            hard_limit=90,
        )
        assert res.ok, res.error
        return str(json.loads((env["store"].local_path(res.key) / "out.json").read_text())["opened"])

    child._fix_devices(["onnxruntime", "openvino"])
    assert child._DEVICES == ()
    assert opened("cpu-worker").startswith("refused"), "a CPU worker's step opened a device it was not given"
    child._fix_devices(["gpu-cu13"])
    assert child._DEVICES == (STAND_IN_DEVICE,)
    assert opened("gpu-worker").startswith("succeeded"), "the GPU worker's step could not open its device"


def test_only_character_devices_that_exist_are_taken_as_the_gpus(tmp_path: Path) -> None:
    from services.sandbox import GPU_DEVICE_PATTERNS, gpu_devices

    (tmp_path / "nvidia0").write_text("a plain file is not a device")
    assert gpu_devices([str(tmp_path / "nvidia*"), "/dev/null", "/dev/no-such-node*"]) == (Path("/dev/null"),)
    # This host has no NVIDIA driver: its patterns find nothing, so a CPU host binds nothing.
    assert gpu_devices(GPU_DEVICE_PATTERNS) == tuple(
        sorted(p for p in Path("/dev").glob("nvidia*") if p.is_char_device())
    )
