"""examples/pipelines against a real `kiln serve`: the step script, the GitHub workflow, the Airflow DAG, the KFP component.

Airflow and kfp cannot share Kiln's virtualenv (their pins clash), so `make pipeline-venvs`
builds one for each (the Makefile's AIRFLOW_VENV; PIPELINES_VENV with kfp, actionlint and
check-jsonschema), and the tests run them as subprocesses. KILN_TEST_AIRFLOW_PYTHON and
KILN_TEST_PIPELINES_PYTHON point at other interpreters; without one, its tests skip saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from jobs_support import Proc, free_port, service_env, tool_python, wait_http

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "pipelines"
CLIENT = ROOT / "clients" / "python"
WORKFLOW = EXAMPLES / "github-actions" / "compile-model.yml"
SPEC = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}


def _need(variable: str, makefile_venv: str, what: str) -> Path:
    return tool_python(variable, makefile_venv, "pipeline-venvs", what)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("pipelines")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc=proc)
        yield url
    finally:
        proc.stop()


def _step(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(CLIENT)}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "kiln_step.py"), *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_the_step_script_downloads_on_success_and_fails_on_parity(server: str, cnn_onnx: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    ok = _step(str(cnn_onnx), str(spec), str(tmp_path / "out"), "--server", server)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["status"] == "succeeded" and summary["targets"]["onnxruntime"]["parity"] is True
    assert (Path(summary["artifacts"]["onnxruntime"]) / "model.onnx").is_file()
    # fp16 weights cannot be bit-exact: zero tolerances fail parity, and the step fails with it.
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({**SPEC, "precision": "fp16", "tolerances": {"atol": 0.0, "rtol": 0.0}}))
    failed = _step(str(cnn_onnx), str(strict), str(tmp_path / "out2"), "--server", server)
    assert failed.returncode == 1 and "error PARITY_FAILED" in failed.stderr and "hint:" in failed.stderr
    assert not (tmp_path / "out2").exists()  # nothing downloaded from a failed job
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"targets": ["nonsense"]}))
    refused = _step(str(cnn_onnx), str(bad), str(tmp_path / "out3"), "--server", server)
    assert refused.returncode == 2 and "error INVALID_SPEC" in refused.stderr
    assert "Traceback" not in ok.stderr + failed.stderr + refused.stderr


def test_the_workflow_runs_the_step_and_keeps_its_artifacts() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["compile"]["steps"]
    runs = " ".join(s.get("run", "") for s in steps)
    assert "pip install kiln-client" in runs and "kiln_step.py" in runs
    assert "pipefail" in next(s["shell"] for s in steps if "kiln_step.py" in s.get("run", ""))
    assert any(s.get("uses", "").startswith("actions/upload-artifact@") for s in steps)
    assert workflow["jobs"]["compile"]["env"]["KILN_TOKEN"] == "${{ secrets.KILN_TOKEN }}"
    assert workflow["permissions"] == {"contents": "read"}


def test_the_workflow_passes_actionlint_and_the_workflow_schema(tmp_path: Path) -> None:
    python = _need("KILN_TEST_PIPELINES_PYTHON", "PIPELINES_VENV", "actionlint / check-jsonschema")
    bin_dir = python.parent
    lint = subprocess.run([str(bin_dir / "actionlint"), str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    schema = [str(bin_dir / "check-jsonschema"), "--builtin-schema", "vendor.github-workflows"]
    checked = subprocess.run([*schema, str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Both checkers see mistakes: a job without runs-on, a step naming an unknown key.
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on: ubuntu-latest", "runs_on: ubuntu-latest"))
    assert subprocess.run([str(bin_dir / "actionlint"), str(broken)], capture_output=True).returncode != 0
    assert subprocess.run([*schema, str(broken)], capture_output=True).returncode != 0


def test_the_kfp_component_compiles_to_a_pipeline(tmp_path: Path) -> None:
    python = _need("KILN_TEST_PIPELINES_PYTHON", "PIPELINES_VENV", "kfp")
    out = tmp_path / "kiln_pipeline.yaml"
    done = subprocess.run(
        [str(python), str(EXAMPLES / "kubeflow" / "kiln_component.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spec = yaml.safe_load(out.read_text())
    component = spec["components"]["comp-kiln-compile"]
    assert set(component["inputDefinitions"]["parameters"]) == {"server", "spec_json", "token", "timeout_s"}
    assert set(component["inputDefinitions"]["artifacts"]) == {"model"}
    assert set(component["outputDefinitions"]["artifacts"]) == {"artifacts"}
    executor = spec["deploymentSpec"]["executors"]["exec-kiln-compile"]["container"]
    assert "kiln-client" in " ".join(executor["command"]) and executor["image"] == "python:3.11-slim"


_AIRFLOW_RUN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kiln_dag", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
dag = module.kiln_compile_dag
run = dag.test(run_conf=json.loads(sys.argv[2]))
print(json.dumps({"state": str(run.state), "tasks": {ti.task_id: str(ti.state) for ti in run.get_task_instances()}}))
"""


def test_the_airflow_dag_runs_its_task_against_kiln_serve(server: str, cnn_onnx: Path, tmp_path: Path) -> None:
    python = _need("KILN_TEST_AIRFLOW_PYTHON", "AIRFLOW_VENV", "Airflow")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "KILN_", "PYTHONPATH"))},
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(EXAMPLES / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "KILN_SERVER": server,
    }
    migrate = subprocess.run(
        [str(python.parent / "airflow"), "db", "migrate"], capture_output=True, text=True, timeout=300, env=env
    )
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    dag_file = str(EXAMPLES / "airflow" / "kiln_dag.py")

    def run(spec: dict, dest: Path) -> dict:
        conf = json.dumps({"model": str(cnn_onnx), "spec": spec, "dest": str(dest)})
        done = subprocess.run(
            [str(python), "-c", _AIRFLOW_RUN, dag_file, conf], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    ok = run(SPEC, tmp_path / "ok")
    assert ok == {"state": "success", "tasks": {"compile_on_kiln": "success"}}
    assert (tmp_path / "ok" / "cnn-onnxruntime" / "model.onnx").is_file()
    strict = {**SPEC, "precision": "fp16", "tolerances": {"atol": 0.0, "rtol": 0.0}, "name": "strict"}
    failed = run(strict, tmp_path / "failed")
    assert failed == {"state": "failed", "tasks": {"compile_on_kiln": "failed"}}
