"""Hostile models against a real service: refused at submission, and held by the sandbox when vetting is off.

- A real `kiln serve`: a snooping SavedModel (ReadFile of /proc/self/environ, WriteFile, PrintV2),
  a TorchScript archive that reads a file and prints, an ONNX model with onnxruntime-extensions'
  Python-op domain and a TFLite model with Flex (TensorFlow) custom ops are each refused with
  400 UNSAFE_INPUT naming the ops.
- With vetting off (KILN_VET_UPLOADS=false: the only way a model reaches a step untested), a
  real `kiln serve` and a real `kiln api` + `kiln worker` (PostgreSQL, Redis) run SavedModels
  whose serving functions really try: print the process environment, read a planted secret
  file, write outside scratch, and open a TCP connection (TensorFlow's RpcClient) to a
  listening loopback socket. None gets anywhere, and the planted secret (a file, and the
  worker's KILN_S3_SECRET_ACCESS_KEY) appears in no response, log, event or published file.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import (
    PLANTED_SECRET,
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

from services.sandbox import host_protection

pytestmark = pytest.mark.skipif(
    not host_protection("auto").confined, reason="neither bubblewrap nor Landlock can confine steps on this host"
)
SPEC = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}


class _Listener:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[Any] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            try:
                conn, addr = self.sock.accept()
                self.accepted.append(addr)
                conn.close()
            except OSError:
                continue


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build the hostile models (TensorFlow in a subprocess) and the targets they aim at."""
    root = tmp_path_factory.mktemp("hostile")
    listener = _Listener()
    (root / "secret.txt").write_text(PLANTED_SECRET)
    (root / "outside").mkdir()
    aims = {"secret": str(root / "secret.txt"), "outside": str(root / "outside" / "pwned"), "port": listener.port}
    script = f"""
import shutil, tensorflow as tf
root, aims = {str(root)!r}, {json.dumps(aims)}
from tensorflow.distribute.experimental.rpc.kernels import gen_rpc_ops
def save(name, body):
    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, x):
            with tf.control_dependencies(body()):
                return {{"y": tf.identity(x * 2.0)}}
    m = M(); tf.saved_model.save(m, f"{{root}}/{{name}}", signatures={{"serving_default": m.serve}})
    shutil.make_archive(f"{{root}}/{{name}}", "zip", f"{{root}}/{{name}}")
def environ():
    env = tf.io.read_file("/proc/self/environ")
    return [tf.print("ENVIRON", env), tf.io.write_file(aims["outside"], env)]
save("environ_write", environ)
save("secret", lambda: [tf.print("SECRET", tf.io.read_file(aims["secret"]))])
save("connect", lambda: [gen_rpc_ops.rpc_client(server_address=f"127.0.0.1:{{aims['port']}}", timeout_in_ms=3000,
                                                 shared_name="k", list_registered_methods=True)[1]])
@tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
def flex(x):
    return x * 2.0 + tf.cast(tf.strings.length(tf.io.read_file(aims["secret"])), tf.float32)
c = tf.lite.TFLiteConverter.from_concrete_functions([flex.get_concrete_function()], flex)
c.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS, tf.lite.OpsSet.SELECT_TF_OPS]
open(f"{{root}}/flex.tflite", "wb").write(c.convert())
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    import onnx
    import torch
    from onnx import TensorProto, helper

    secret = aims["secret"]

    class Snoop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.path: str = secret

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = torch.from_file(self.path, False, 8, dtype=torch.uint8)
            print(s)
            return x + s.float().sum() * 0

    torch.jit.script(Snoop()).save(str(root / "snoop.pt"))
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("x", "y")]
    g = helper.make_graph(
        [helper.make_node("PyReverseMatrix", ["x"], ["y"], domain="ai.onnx.contrib")], "g", io[:1], io[1:]
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), root / "pyop.onnx")
    yield {"root": root, "listener": listener, "aims": aims}
    listener.running = False


def _serve(root: Path, **kiln: Any) -> Iterator[str]:
    port = free_port()
    env = service_env(cache_dir=root / "cache", s3_secret_access_key=PLANTED_SECRET, **kiln)
    proc = Proc(["serve", "--port", str(port), "--repo", str(root / "repo")], env, root / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=proc, timeout=120)
        yield base
    finally:
        proc.stop()
    assert PLANTED_SECRET not in (root / "serve.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def vetted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory.mktemp("vetted"))


def test_kiln_serve_refuses_each_hostile_format_at_submission_naming_the_ops(
    vetted: str, hostile: dict[str, Any]
) -> None:
    root = hostile["root"]
    expected = {
        "environ_write.zip": ["PrintV2", "ReadFile", "WriteFile"],
        "snoop.pt": ["aten::from_file", "prim::Print"],
        "pyop.onnx": ["ai.onnx.contrib::PyReverseMatrix"],
        "flex.tflite": ["FlexReadFile", "FlexStringLength"],
    }
    for name, ops in expected.items():
        r = submit(vetted, root / name, SPEC)
        assert r.status_code == 400, (name, r.text)
        body = r.json()
        assert body["code"] == "UNSAFE_INPUT" and body["details"]["ops"] == ops, (name, body)
    assert httpx.get(f"{vetted}/jobs").json()["count"] == 0  # nothing was recorded


def _everything_said(base: str, job_id: str) -> str:
    """Return every response a client can get about a job, as one text."""
    said = [httpx.get(f"{base}/jobs/{job_id}").text, httpx.get(f"{base}/jobs/{job_id}/logs").text]
    said += [json.dumps(e) for e in read_sse(base, job_id)]
    return "\n".join(said)


def _check_held(base: str, hostile: dict[str, Any], repo: Path) -> None:
    root = hostile["root"]
    jobs = {name: submit(base, root / f"{name}.zip", SPEC) for name in ("environ_write", "secret", "connect")}
    for name, r in jobs.items():
        assert r.status_code == 202, (name, r.text)
        job = wait_job(base, r.json()["id"], timeout=300)
        said = _everything_said(base, r.json()["id"])
        assert PLANTED_SECRET not in said, name
        assert "KILN_S3_SECRET_ACCESS_KEY" not in said, name  # not even the name: the environment is scrubbed
        # The reference step ran the serving function in the sandbox, and it failed there.
        ref = next(s for s in job["steps"] if s["id"] == "reference")
        assert ref["status"] == "failed", (name, ref)
        if name == "environ_write":
            assert "ENVIRON" in said  # tf.print ran: it printed the sandbox's own, scrubbed environment
    assert not Path(hostile["aims"]["outside"]).exists()
    assert hostile["listener"].accepted == []
    published = [p for p in repo.rglob("*") if p.is_file()]
    assert all(PLANTED_SECRET not in p.read_text(errors="replace") for p in published)


def test_with_vetting_off_kiln_serve_runs_hostile_savedmodels_sandboxed(
    tmp_path_factory: pytest.TempPathFactory, hostile: dict[str, Any]
) -> None:
    root = tmp_path_factory.mktemp("unvetted-serve")
    for base in _serve(root, vet_uploads="false"):
        wait_workers(base, {"tensorflow", "onnxruntime"}, timeout=180)
        _check_held(base, hostile, root / "repo")


def test_with_vetting_off_kiln_api_and_a_worker_run_hostile_savedmodels_sandboxed(
    tmp_path_factory: pytest.TempPathFactory, hostile: dict[str, Any]
) -> None:
    root = tmp_path_factory.mktemp("unvetted-cluster")
    port = free_port()
    env = {
        "database_url": migrated_pg(),
        "broker_url": redis_url(),
        "repository": str(root / "repo"),
        "artifact_store": str(root / "store"),
        "vet_uploads": "false",
        "s3_secret_access_key": PLANTED_SECRET,
    }
    worker = Proc(
        ["worker", "--engine", "tensorflow", "--engine", "onnxruntime"],
        service_env(cache_dir=root / "worker", **env),
        root / "worker.log",
    )
    api = Proc(["api", "--port", str(port)], service_env(cache_dir=root / "api", **env), root / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=api)
        wait_workers(base, {"tensorflow", "onnxruntime"}, procs=[worker], timeout=180)
        _check_held(base, hostile, root / "repo")
    finally:
        worker.stop()
        api.stop()
    logs = (root / "worker.log").read_text(errors="replace")
    assert PLANTED_SECRET not in logs and PLANTED_SECRET not in (root / "api.log").read_text(errors="replace")
    assert "sandbox: bubblewrap" in logs or "sandbox: Landlock" in logs  # the worker said what protects it
