"""The `kiln` command as a user runs it: exit codes, messages, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
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
    assert (repo / "triton" / "cnn-onnxruntime" / "1" / "model.onnx").is_file()
    assert (repo / "triton" / "cnn-openvino" / "1" / "model.xml").is_file()
    assert (repo / "triton" / "cnn-openvino" / "1" / "model.bin").is_file()


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
    from services.descriptors import registry

    assert {e["target"] for e in routes["exporters"]} == set(registry().targets)
    assert set(registry().targets) >= {"onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"}
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
    assert not (tmp_path / "repo" / "triton" / "cnn" / "1").exists()  # nothing failed is published


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
        version = repo / "triton" / f"m-{target}" / "1"
        assert files | {"kiln-manifest.json"} <= {p.name for p in version.iterdir()}
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        assert manifest["precision"] == precision and manifest["parity"]["passed"]


def test_an_int8_fallback_is_a_warning_in_the_summary(cnn_onnx: Path, tmp_path: Path) -> None:
    # No calibration data: int8 is calibrated on generated samples, and the summary says so.
    args = ["compile", str(cnn_onnx), "-t", "onnxruntime", "-p", "int8", "--no-benchmark", "--name", "m"]
    proc = run(*args, "--repo", str(tmp_path / "repo"), "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(1 warning)" in proc.stdout
    assert "warning onnxruntime: int8 was calibrated on generated samples" in proc.stdout
    manifest = json.loads((tmp_path / "repo" / "triton" / "m" / "1" / "kiln-manifest.json").read_text())
    assert len(manifest["warnings"]) == 1 and "generated samples" in manifest["warnings"][0]
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).standard_normal((8, 3, 32, 32)).astype(np.float32))
    proc = run(*args, "--calibration", str(calib), "--repo", str(tmp_path / "repo2"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["targets"]["onnxruntime"]["warnings"] == []


def _s3_env(s3_server) -> dict[str, str]:
    return {
        "KILN_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "KILN_S3_REGION": s3_server.region,
        "KILN_S3_ACCESS_KEY_ID": s3_server.access_key_id,
        "KILN_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
    }


def _s3_keys(s3_server, prefix: str) -> set[str]:
    listing = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1 :] for o in listing.get("Contents", [])}


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_s3_repository_is_published_to_s3_and_not_to_a_folder(
    how: str, s3_server, cnn_onnx: Path, tmp_path: Path
) -> None:
    prefix = f"cli-{how}/repo"
    url = f"s3://{s3_server.bucket}/{prefix}"
    args = ["compile", str(cnn_onnx), "-t", "onnxruntime", "--no-benchmark", "--name", "m", "--json"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    env = {**_s3_env(s3_server), **({"KILN_REPOSITORY": url} if how == "environment" else {})}
    proc = run(*args, *(["--repo", url] if how == "flag" else []), cwd=tmp_path, env_extra=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["targets"]["onnxruntime"]["published"]["uri"] == f"{url}/triton/m/1"
    assert {"triton/m/1/model.onnx", "triton/m/1/kiln-manifest.json", "triton/m/config.pbtxt"} <= _s3_keys(
        s3_server, prefix
    )
    assert not (tmp_path / "s3:").exists() and list(tmp_path.iterdir()) == [tmp_path / "cache"]

    # Unchanged model and spec: the version that holds this artifact stands, no duplicate.
    again = run(*args, *(["--repo", url] if how == "flag" else []), cwd=tmp_path, env_extra=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["targets"]["onnxruntime"]["published"]["version"] == 1
    assert not any(k.startswith("triton/m/2/") for k in _s3_keys(s3_server, prefix))


def test_an_unreachable_or_unknown_repository_fails_before_compiling(s3_server, cnn_onnx: Path, tmp_path: Path) -> None:
    args = ["compile", str(cnn_onnx), "-t", "onnxruntime", "--no-benchmark", "--cache-dir", str(tmp_path / "c")]
    proc = run(*args, "--repo", "s3://no-such-bucket-kiln/x", cwd=tmp_path, env_extra=_s3_env(s3_server))
    assert proc.returncode == 1 and "error NOT_FOUND" in proc.stderr and "no-such-bucket-kiln" in proc.stderr
    assert "▶ reference" not in proc.stderr  # nothing was compiled for a repository that is not there
    proc = run(*args, "--repo", "gs://bucket/x", cwd=tmp_path)
    assert proc.returncode == 2 and "error INVALID_SPEC" in proc.stderr and "s3://bucket/prefix" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no folder named after the URL


def test_recompiling_an_unchanged_model_adds_no_version_unless_asked(cnn_onnx: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    args = ["compile", str(cnn_onnx), "-t", "onnxruntime", "--no-benchmark", "--name", "m", "--json"]
    args += ["--repo", str(repo), "--cache-dir", str(tmp_path / "cache")]

    def version(*extra: str) -> int:
        proc = run(*args, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(json.loads(proc.stdout)["targets"]["onnxruntime"]["published"]["version"])

    assert [version(), version()] == [1, 1]
    assert version("--no-cache") == 2  # a forced rebuild is a new version
    assert version() == 2  # the newest identical version stands
    assert version("--version", "1") == 1  # asking for a version that already holds this artifact
    assert version("--version", "7") == 7  # asking for a new one publishes it
    assert version("-p", "fp16") == 8  # a different artifact is a new version
    assert sorted(int(p.name) for p in (repo / "triton" / "m").iterdir() if p.is_dir()) == [1, 2, 7, 8]


def test_input_max_batch_and_serving_root_flags_reach_the_repository(cnn_onnx: Path, tmp_path: Path) -> None:
    """--input NAME:MIN,OPT,MAX, --max-batch-size and --serving-root end up in the configs servers read."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo = tmp_path / "repo"
    proc = run(
        "compile", str(cnn_onnx), "-t", "onnxruntime", "--repo", str(repo), "--name", "cnn", "--no-benchmark",
        "--input", "input:1x3x32x32,2x3x32x32,4x3x32x32", "--max-batch-size", "4", "--serving-root", "/models",
        "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = text_format.Parse((repo / "triton" / "cnn" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.max_batch_size == 4 and list(cfg.input[0].dims) == [3, 32, 32]
    ovms = json.loads((repo / "ovms" / "config.json").read_text())
    assert ovms["model_config_list"][0]["config"]["base_path"] == "/models/triton/cnn"
    manifest = json.loads((repo / "triton" / "cnn" / "1" / "kiln-manifest.json").read_text())
    assert manifest["spec"]["inputs"]["input"] == {
        "shape": None, "min": [1, 3, 32, 32], "opt": [2, 3, 32, 32], "max": [4, 3, 32, 32], "dtype": None,
        "range": None, "value": None,
    }  # fmt: skip


def test_dry_run_prints_the_plan_and_runs_nothing(cnn_onnx: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    proc = run(
        "compile", str(cnn_onnx), "-t", "onnxruntime", "-t", "openvino", "--repo", str(repo), "--dry-run", "--json",
        "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["plan"]["routes"] == {
        "onnxruntime": "onnx → optimize ⇒ onnxruntime",
        "openvino": "onnx → optimize → openvino_ir ⇒ openvino",
    }
    assert [s["id"] for s in body["plan"]["steps"]][:2] == ["reference", "optimize"]
    assert not repo.exists() and not (tmp_path / "cache").exists()  # nothing ran, nothing written


@pytest.mark.parametrize("flag", ["x", "x:1x3", "x:1x3,2x3", ":1x3", "x:1xAx3"])
def test_bad_input_flag_is_invalid_spec(flag: str, cnn_onnx: Path, tmp_path: Path) -> None:
    proc = run("compile", str(cnn_onnx), "-t", "onnxruntime", "--input", flag, "--dry-run")
    if flag == "x:1x3":
        assert proc.returncode == 0, proc.stderr  # well-formed; the planner does not check names
        return
    assert proc.returncode == 2 and "INVALID_SPEC" in proc.stderr and "Traceback" not in proc.stderr
    assert "NAME:1x3x224x224" in proc.stderr  # the hint shows the form


def test_quiet_keeps_engine_noise_in_the_log_and_the_summary_fits_80_columns(cnn_onnx: Path, tmp_path: Path) -> None:
    """-q: stderr carries one line (where the log is); NNCF, onnxruntime and OpenVINO output goes to that log."""
    cache = tmp_path / "cache"
    proc = run(
        "compile", str(cnn_onnx), "-t", "onnxruntime", "-t", "openvino", "-p", "int8", "--repo", str(tmp_path / "repo"),
        "--name", "cnn", "-q", "--cache-dir", str(cache),
        env_extra={"COLUMNS": "80"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (log,) = (cache / "logs").glob("*.log")
    assert proc.stderr.strip().splitlines() == [f"tool output and steps: {log}"]
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"type"')]
    assert {"step_finished", "finished"} <= {e["type"] for e in events}
    table, below = proc.stdout.split("└")  # the table, then one line per target: route → artifact
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "succeeded" in table and "p50 latency" in table
    where = str(tmp_path / "repo" / "triton" / "cnn-openvino" / "1")
    assert f"openvino: onnx → optimize → openvino_ir ⇒ openvino → {where}" in below.splitlines()  # not folded
