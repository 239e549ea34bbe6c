"""A real Triton Inference Server (the ``tritonserver`` binary of the nvidia-pytriton wheel) for tests.

The binary lives in a venv of its own, the Makefile's ``TRITON_VENV`` (``make triton-server``, pinned by
``constraints-triton.txt``): nvidia-pytriton pins numpy<2 and brings tritonclient's
protobuf/grpcio pins, which Kiln's lock cannot meet. That venv also holds onnxruntime and
OpenVINO at Kiln's versions, for the stand-in backends (tests/triton_standins/).

What the wheel ships: ``pytriton/tritonserver/bin/tritonserver`` (Triton 2.51), the Python
backend (``backends/python``) and its stub built for Python 3.8-3.13
(``python_backend_stubs/<X.Y>/triton_python_backend_stub``), with their shared libraries in
``nvidia_pytriton.libs``. No onnxruntime, OpenVINO or TensorRT backend.

How the Python backend stub finds its Python (measured here): the stub links
``libpython<X.Y>.so.1.0`` (the venv's base interpreter's when it has one, see
:meth:`TritonTool.library_path`, else the system's) and starts an isolated
interpreter, so PYTHONPATH is ignored; the interpreter takes its prefix, and so its
site-packages, from the first ``python3`` on PATH. :class:`TritonServer` puts the tool venv's
``bin`` first on PATH, so the stub runs with the tool venv's numpy (1.26; the stub is built
against numpy 1's ABI: with Kiln's numpy 2 every output tensor reached Triton with 0 bytes,
"output tensor shape does not match size of output").
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from jobs_support import die_with_parent, free_ports

__all__ = ["STANDINS", "TOOL_VENV", "TritonServer", "TritonTool", "backend_directory", "find_triton"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def _makefile_tool_venv() -> Path:
    """The folder the Makefile's ``triton-server`` target builds the tool venv in (``TRITON_VENV``)."""
    found = re.search(r"^TRITON_VENV\s*:=\s*(\S+)", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert found is not None, "the Makefile names no TRITON_VENV"
    return REPO_ROOT / found[1]


#: The tool venv ``make triton-server`` builds (``KILN_TRITON_VENV`` overrides it).
TOOL_VENV = Path(os.environ.get("KILN_TRITON_VENV") or _makefile_tool_venv())
#: Test-only Python-based stand-ins for Triton's onnxruntime and openvino backend libraries.
STANDINS = Path(__file__).resolve().parent / "triton_standins"

_START_TIMEOUT = 60.0

#: Triton's datatype names (the KServe v2 protocol's) -> numpy dtypes, and back.
_DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def _triton_dtype(dtype: np.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if np.dtype(v) == dtype)


@dataclass(frozen=True)
class TritonTool:
    """The pieces of the nvidia-pytriton wheel in the tool venv."""

    venv: Path
    site_packages: Path
    python_version: str  # "3.11": the stub that matches the venv's interpreter

    @property
    def server_dir(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def stub(self) -> Path:
        return self.server_dir / "python_backend_stubs" / self.python_version / "triton_python_backend_stub"

    def library_path(self) -> str:
        """LD_LIBRARY_PATH for the server and its stubs: the wheel's libraries, then the venv's own libpython.

        The stub links ``libpython<X.Y>.so.1.0``; where the interpreter the venv was made from
        was built shared (pyenv's is), its libpython comes first, so the stub's interpreter and
        the stdlib it loads are one build. Otherwise the loader takes the system's (Debian's
        libpython3.11 package).
        """
        paths = [str(self.libs)]
        home = re.search(r"^home\s*=\s*(.+)$", (self.venv / "pyvenv.cfg").read_text(), re.M)
        if home is not None:
            lib = Path(home[1].strip()).parent / "lib"
            if (lib / f"libpython{self.python_version}.so.1.0").is_file():
                paths.append(str(lib))
        if os.environ.get("LD_LIBRARY_PATH"):
            paths.append(os.environ["LD_LIBRARY_PATH"])
        return ":".join(paths)

    def missing_stub_libraries(self) -> list[str]:
        """Shared libraries the stub needs that the loader cannot find (the system's libpython, say)."""
        env = {**os.environ, "LD_LIBRARY_PATH": self.library_path()}
        out = subprocess.run(["ldd", str(self.stub)], capture_output=True, text=True, env=env, check=False).stdout
        return [line.split()[0] for line in out.splitlines() if "not found" in line]


def find_triton(venv: Path = TOOL_VENV) -> TritonTool | None:
    """Return the tool venv's Triton, or None when the venv (or the binary in it) is missing."""
    cfg = venv / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    found = re.search(r"^version(?:_info)?\s*=\s*(\d+)\.(\d+)", cfg.read_text(), re.M)
    if found is None:
        return None
    version = f"{found[1]}.{found[2]}"
    tool = TritonTool(venv, venv / "lib" / f"python{version}" / "site-packages", version)
    return tool if tool.binary.is_file() else None


def backend_directory(tool: TritonTool, dest: Path, standins: Iterable[str] = ()) -> Path:
    """Lay out a ``--backend-directory``: the wheel's Python backend with its stub, and ``standins``.

    ``standins`` names directories of tests/triton_standins (``onnxruntime``, ``openvino``):
    each becomes ``dest/<name>/model.py``, a Python-based backend Triton uses for models whose
    config asks for that backend.
    """
    python = dest / "python"
    shutil.copytree(tool.server_dir / "backends" / "python", python)
    shutil.copy2(tool.stub, python / "triton_python_backend_stub")
    for name in standins:
        (dest / name).mkdir(parents=True)
        shutil.copy2(STANDINS / name / "model.py", dest / name / "model.py")
    return dest


class TritonServer:
    """``tritonserver`` on free 127.0.0.1 ports, explicit model control, strict configs; a context manager."""

    def __init__(self, tool: TritonTool, model_repository: Path, backend_dir: Path, workdir: Path) -> None:
        self.tool = tool
        self.model_repository = model_repository
        self.backend_dir = backend_dir
        self.log_path = workdir / "tritonserver.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.http: httpx.Client | None = None

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        http, grpc, metrics = free_ports(3)
        args = [
            str(self.tool.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            "--model-control-mode=explicit",  # each load answers with Triton's own verdict
            "--exit-on-error=false",
            "--strict-model-config=true",  # no auto-complete: the config.pbtxt as Kiln wrote it
            "--strict-readiness=true",
            "--exit-timeout-secs=10",
            "--http-address=127.0.0.1",
            f"--http-port={http}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={grpc}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={metrics}",
            # Shared-memory regions of this server's stubs, distinct from any other test run's.
            f"--backend-config=python,shm-region-prefix-name=kiln-{uuid.uuid4().hex[:12]}",
        ]
        env = dict(os.environ)
        # The stub's isolated interpreter takes its prefix from the first python3 on PATH.
        env["PATH"] = f"{self.tool.venv / 'bin'}:{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = self.tool.library_path()
        for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(var, None)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60.0)
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if self.http.get("/v2/health/live").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tritonserver did not answer in {_START_TIMEOUT:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (Triton unloads its models and its stubs free their shared memory), then SIGKILL."""
        if self.http is not None:
            self.http.close()
            self.http = None
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _client(self) -> httpx.Client:
        assert self.http is not None, "the server is not running"
        return self.http

    def load(self, name: str) -> httpx.Response:
        """``POST /v2/repository/models/<name>/load``: 200, or Triton's error."""
        return self._client().post(f"/v2/repository/models/{name}/load")

    def index(self) -> dict[str, dict[str, Any]]:
        """The repository index by model name: state and reason, as Triton reports them."""
        response = self._client().post("/v2/repository/index")
        response.raise_for_status()
        return {m["name"]: m for m in response.json()}

    def config(self, name: str) -> dict[str, Any]:
        """The model's configuration as Triton holds it (``GET /v2/models/<name>/config``)."""
        response = self._client().get(f"/v2/models/{name}/config")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def poll_failure(self, name: str) -> str | None:
        """The reason Triton logged for refusing ``name``'s directory (its config), if it did."""
        found = re.search(rf"Poll failed for model directory '{re.escape(name)}': (.*)\"\s*$", self.log(), re.M)
        return found[1] if found else None

    def infer_raw(self, name: str, inputs: dict[str, np.ndarray]) -> httpx.Response:
        body = {
            "inputs": [
                {"name": n, "shape": list(a.shape), "datatype": _triton_dtype(a.dtype), "data": a.ravel().tolist()}
                for n, a in inputs.items()
            ]
        }
        return self._client().post(f"/v2/models/{name}/infer", json=body)

    def infer(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Send one inference over Triton's HTTP/JSON API; return its outputs by name."""
        response = self.infer_raw(name, inputs)
        if response.status_code != 200:
            raise AssertionError(f"infer {name}: HTTP {response.status_code}: {response.text}")
        return {
            o["name"]: np.asarray(o["data"], dtype=_DTYPES[o["datatype"]]).reshape(o["shape"])
            for o in response.json()["outputs"]
        }
