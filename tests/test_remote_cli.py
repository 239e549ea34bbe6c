"""`kiln compile --server` and `kiln jobs` against a real `kiln serve`: the local run's flags, output and exit codes."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_support import KILN_CMD, Proc, free_port, service_env, wait_http

CLI = Path(__file__).resolve().parents[1] / "cli"


def run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_SERVER", "KILN_TOKEN")}
    env.update({"COLUMNS": "200", **(env_extra or {})})
    return subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("remote-cli")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc=proc)  # ready means its workers are up (tests/test_ready.py)
        yield url
    finally:
        proc.stop()


def _paths(value: Any, prefix: str = "") -> set[str]:
    """Return every key path of a JSON value (list items merged under `[]`)."""
    if isinstance(value, dict):
        found = set()
        for key, sub in value.items():
            found.add(f"{prefix}.{key}")
            found |= _paths(sub, f"{prefix}.{key}")
        return found
    if isinstance(value, list):
        return set().union(*(_paths(item, f"{prefix}[]") for item in value)) if value else set()
    return set()


def test_a_remote_compile_prints_what_a_local_one_does(server: str, cnn_onnx: Path, tmp_path: Path) -> None:
    flags = [
        "--target",
        "onnxruntime",
        "--target",
        "openvino",
        "--name",
        "shape",
        "--input",
        "input:1x3x32x32,4x3x32x32,8x3x32x32",
    ]
    local = run(
        "compile", str(cnn_onnx), *flags, "--json", "--repo", str(tmp_path / "repo"), "--cache-dir", str(tmp_path / "c")
    )
    remote = run("compile", str(cnn_onnx), *flags, "--json", "--server", server)
    assert local.returncode == 0 and remote.returncode == 0, (local.stderr[-2000:], remote.stderr[-2000:])
    mine, theirs = json.loads(local.stdout), json.loads(remote.stdout)
    assert list(theirs) == list(mine) == ["job_id", "ok", "plan", "targets"]
    assert theirs["ok"] is True and theirs["plan"]["routes"] == mine["plan"]["routes"]
    for target in ("onnxruntime", "openvino"):
        assert list(theirs["targets"][target]) == list(mine["targets"][target])
        assert theirs["targets"][target]["published"]["name"] == f"shape-{target}"
    assert _paths(theirs) == _paths(mine)  # the same shape all the way down
    # Progress on stderr, the summary table on stdout, as a local run prints them.
    shown = run("compile", str(cnn_onnx), *flags, "--server", server)
    assert shown.returncode == 0, shown.stderr
    assert "▶ export:openvino (openvino)" in shown.stderr and "✔ publish:onnxruntime" in shown.stderr
    assert "kiln job " in shown.stdout and "ok abs" in shown.stdout and "shape-openvino" in shown.stdout
    # The server read KILN_SERVER as well as --server.
    quiet = run("compile", str(cnn_onnx), *flags, "-q", env_extra={"KILN_SERVER": server})
    assert quiet.returncode == 0 and "▶" not in quiet.stderr and "kiln jobs logs" in quiet.stderr


def test_remote_exit_codes_are_the_local_ones(server: str, cnn_onnx: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"  # fp16 weights cannot be bit-exact: zero tolerances fail parity
    spec.write_text(json.dumps({"tolerances": {"atol": 0.0, "rtol": 0.0}, "benchmark": False}))
    failed = run("compile", str(cnn_onnx), "-t", "onnxruntime", "-p", "fp16", "--spec", str(spec), "--server", server)
    assert failed.returncode == 1, failed.stderr
    assert "PARITY_FAILED" in failed.stdout and "FAIL abs" in failed.stdout and "hint:" in failed.stderr
    bad = run("compile", str(cnn_onnx), "-t", "nonsense", "--server", server)
    assert bad.returncode == 2 and "error INVALID_SPEC" in bad.stderr
    local_place = run("compile", str(cnn_onnx), "-t", "onnxruntime", "--repo", str(tmp_path), "--server", server)
    assert local_place.returncode == 2 and "--repo names a place on this machine" in local_place.stderr
    down = run("compile", str(cnn_onnx), "-t", "onnxruntime", "--server", f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "error SERVICE_UNAVAILABLE" in down.stderr
    for proc in (failed, bad, local_place, down):
        assert "Traceback" not in proc.stderr + proc.stdout


def test_kiln_jobs_lists_shows_logs_downloads_and_cancels(server: str, cnn_onnx: Path, tmp_path: Path) -> None:
    done = run("compile", str(cnn_onnx), "-t", "onnxruntime", "--name", "jobs-cmd", "--json", "--server", server)
    job_id = json.loads(done.stdout)["job_id"]
    listed = run("jobs", "list", "--name", "jobs-cmd", "--json", "--server", server)
    assert listed.returncode == 0 and [j["id"] for j in json.loads(listed.stdout)["data"]] == [job_id]
    table = run("jobs", "list", env_extra={"KILN_SERVER": server})
    assert job_id in table.stdout and "succeeded" in table.stdout
    shown = run("jobs", "show", job_id, "--server", server)
    assert "jobs-cmd (cnn.onnx, onnx): succeeded" in shown.stdout and "ok abs" in shown.stdout
    assert json.loads(run("jobs", "show", job_id, "--json", "--server", server).stdout)["id"] == job_id
    logs = run("jobs", "logs", job_id, "--tail", "1", "--server", server)
    assert logs.returncode == 0 and logs.stdout.split()[1] == "finished"
    fetched = run("jobs", "download", job_id, "--dest", str(tmp_path / "dl"), "--server", server)
    assert fetched.returncode == 0 and (tmp_path / "dl" / "jobs-cmd-onnxruntime" / "model.onnx").is_file()
    ended = run("jobs", "cancel", job_id, "--server", server)
    assert ended.returncode == 0 and ended.stdout.strip() == f"job {job_id}: succeeded"  # already over
    missing = run("jobs", "show", "0" * 32, "--server", server)
    assert missing.returncode == 1 and "error NOT_FOUND" in missing.stderr and "Traceback" not in missing.stderr
    no_server = run("jobs", "list")
    assert no_server.returncode == 2 and "--server" in no_server.stderr


def test_no_cli_module_imports_cli_main() -> None:
    offenders = []
    for path in sorted(CLI.glob("*.py")):
        if path.name == "main.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "cli.main" for n in names):
                offenders.append(path.name)
    assert offenders == []


def test_a_remote_tune_prints_the_search_and_publishes_on_the_server(server: str, cnn_onnx: Path) -> None:
    flags = ["--targets", "onnxruntime,openvino", "--precisions", "fp32", "--rounds", "5", "--warmup", "1"]
    done = run("tune", str(cnn_onnx), *flags, "--name", "remote-tuned", "--json", "--server", server)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(done.stdout)  # the report `kiln tune --json` prints locally, from the server's job
    assert {"candidates", "recommendation", "profiles", "cache", "wall_s"} <= set(body)
    timed = [c for c in body["candidates"] if c["status"] == "timed"]
    assert {c["target"] for c in timed} == {"onnxruntime", "openvino"}
    assert body["recommendation"]["id"] in {c["id"] for c in timed}
    assert body["published"]["name"] == "remote-tuned" and body["job_id"]
    assert "building fp32" in done.stderr  # the search's lines, as they came
    # Nothing can meet the constraint: exit 1 with the code, as a local run.
    none = run("tune", str(cnn_onnx), "--targets", "onnxruntime", "--precisions", "fp32", "--rounds", "3",
               "--max-p99-ms", "0.000001", "--server", server)  # fmt: skip
    assert none.returncode == 1 and "NO_CANDIDATE" in none.stderr, none.stderr[-2000:]
    refused = run("tune", str(cnn_onnx), "--repo", "/tmp/x", "--server", server)
    assert refused.returncode == 2 and "--repo" in refused.stderr
