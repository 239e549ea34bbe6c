"""The `kiln` command as a user runs it: exit codes, messages, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from jobs_support import KILN_CMD


def run(
    *args: str, cwd: Path | None = None, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {})}
    return subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_compile_onnxruntime_and_openvino(cnn_onnx: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    proc = run(
        "compile",
        str(cnn_onnx),
        "--target",
        "onnxruntime",
        "--target",
        "openvino",
        "--precision",
        "fp16",
        "--repo",
        str(repo),
        "--name",
        "cnn",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "succeeded" in proc.stdout and "Traceback" not in proc.stderr
    assert "▶ optimize" in proc.stderr and "✔ export:openvino" in proc.stderr
    # The summary table: one row per target with its route, parity, latency and artifact.
    for column in ("target", "status", "route", "parity", "p50 latency", "artifact"):
        assert column in proc.stdout, column
    assert "onnx → optimize ⇒ onnxruntime" in proc.stdout and "ms (b1)" in proc.stdout
    assert (repo / "cnn-onnxruntime" / "1" / "model.onnx").is_file()
    assert (repo / "cnn-openvino" / "1" / "model.xml").is_file()
    assert (repo / "cnn-openvino" / "1" / "model.bin").is_file()


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"\x08\x07\x12\x07pytorch\x1a\x03" + b"\xff" * 40, "SOURCE_UNREADABLE"),  # ONNX head, corrupt body
        (b"GIF89a definitely not a model", "UNSUPPORTED_FORMAT"),
        (b"", "SOURCE_UNREADABLE"),
    ],
)
def test_corrupt_model_fails_cleanly(content: bytes, code: str, tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(content)
    proc = run(
        "compile", str(model), "-t", "onnxruntime", "--repo", str(tmp_path / "repo"), "--cache-dir", str(tmp_path / "c")
    )
    assert proc.returncode == 2
    assert code in proc.stderr
    assert "hint" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "repo" / "model").exists()


def test_truncated_onnx(cnn_onnx: Path, tmp_path: Path) -> None:
    model = tmp_path / "t.onnx"
    model.write_bytes(cnn_onnx.read_bytes()[:3000])
    proc = run(
        "compile", str(model), "-t", "onnxruntime", "--repo", str(tmp_path / "repo"), "--cache-dir", str(tmp_path / "c")
    )
    assert proc.returncode == 2, proc.stderr
    assert "SOURCE_UNREADABLE" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_spec_and_unknown_target(cnn_onnx: Path, tmp_path: Path) -> None:
    proc = run("compile", str(cnn_onnx), "-t", "coreml", "--repo", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "INVALID_SPEC" in proc.stderr and "onnxruntime" in proc.stderr
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"targets": ["onnxruntime"], "source_format": "tensorrt_plan"}))
    proc = run("compile", str(cnn_onnx), "--spec", str(spec), "--repo", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "NO_ROUTE" in proc.stderr


def test_inspect_and_routes(cnn_onnx: Path) -> None:
    proc = run("inspect", str(cnn_onnx), "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["format"] == "onnx" and body["opset"] == {"ai.onnx": 17}
    assert body["ops"]["Conv"] == 2 and body["inputs"][0]["shape"] == [None, 3, 32, 32]
    proc = run("routes", "--json")
    assert proc.returncode == 0
    routes = json.loads(proc.stdout)
    names = {c["name"] for c in routes["converters"]}
    assert "onnx-to-openvino-ir" in names
    assert {e["target"] for e in routes["exporters"]} == {"onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"}
    proc = run("routes")
    assert "reachable targets per source format" in proc.stdout


def test_schema_command() -> None:
    proc = run("schema")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["title"] == "CompileSpec"


def test_a_failing_target_exits_non_zero_with_its_code(cnn_onnx: Path, tmp_path: Path) -> None:
    # fp16 weights cannot be bit-exact: zero tolerances fail the target's parity check.
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tolerances": {"atol": 0.0, "rtol": 0.0}, "benchmark": False}))
    proc = run(
        "compile",
        str(cnn_onnx),
        "--target",
        "onnxruntime",
        "--precision",
        "fp16",
        "--spec",
        str(spec),
        "--repo",
        str(tmp_path / "repo"),
        "--name",
        "cnn",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "PARITY_FAILED" in proc.stdout and "FAIL abs" in proc.stdout  # the row names code and numbers
    assert "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "repo" / "cnn" / "1").exists()  # nothing failed is published


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("model", ["cnn_onnx", "transformer_onnx"])
def test_issue_matrix_through_the_command(model: str, precision: str, request, tmp_path: Path) -> None:
    # What the compile-core issue asks of `kiln compile` itself: both test models, both
    # targets, every precision, each published with a parity report inside tolerance.
    repo = tmp_path / "repo"
    proc = run(
        "compile",
        str(request.getfixturevalue(model)),
        "-t",
        "onnxruntime",
        "-t",
        "openvino",
        "-p",
        precision,
        "--repo",
        str(repo),
        "--name",
        "m",
        "--no-benchmark",
        "--json",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for target, files in (("onnxruntime", {"model.onnx"}), ("openvino", {"model.xml", "model.bin"})):
        t = result["targets"][target]
        assert t["status"] == "succeeded" and t["parity"]["passed"], t
        version = repo / f"m-{target}" / "1"
        assert files | {"kiln-manifest.json"} <= {p.name for p in version.iterdir()}
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        assert manifest["precision"] == precision and manifest["parity"]["passed"]
