"""The tvm target: ONNX → Relax → tvm.compile, published with its weights and a README, run back.

A small CNN and a transformer block compile at fp32 and fp16 within the default tolerances;
the runner loads the published library on its own and agrees with onnxruntime on a batch
size parity never used; the CUDA library is cross-compiled without a GPU, its kernels compiled
by nvcc for sm_90 and embedded as a cubin; a two-trial MetaSchedule run tunes and stays within tolerance.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm", reason="the tvm extra is not installed (pip install -c constraints.txt -e '.[tvm]')")

from engine_contract import ExporterContract, RunnerContract
from jobs_support import KILN_CMD

from services.errors import InvalidSpec, NoRoute
from services.formats import Format
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.runners import open_runner
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec
from services.tvm import TvmOptions, build_libraries, cpu_fingerprint
from services.tvm.cuda import embedded_cuda, find_nvcc
from services.versions import tool_versions

VERSION_FILES = {"model.so", "params.bin", "io.json", "README.md", "kiln-manifest.json"}


def _compile(model: Path, store, repository, precision: str, **extra):
    spec = load_spec(
        {"targets": ["tvm"], "precision": precision, "name": "m", "benchmark": {"iterations": 3, "warmup": 1}, **extra}
    )
    return compile_model(model, spec, store=store, repository=repository)


def _ort(model: Path, feed: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: feed})[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("model_fixture", ["cnn_onnx", "transformer_onnx"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tvm_compiles_within_tolerance(
    model_fixture: str, precision: str, request, store, repository, repo_dir: Path
) -> None:
    model = request.getfixturevalue(model_fixture)
    result = _compile(model, store, repository, precision)
    target = result.targets["tvm"]
    assert target.status == "succeeded", target.error
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    assert target.parity["passed"] is True and target.parity["samples_per_shape"][0] == 8
    for out in target.parity["outputs"]:
        assert out["cosine"] >= tol.min_cosine and out["nonfinite"] == 0
        assert out["max_abs"] <= (1e-4 if precision == "fp32" else 2e-2)
    version = repo_dir / "tvm" / "m" / "1"
    assert {p.name for p in version.iterdir()} == VERSION_FILES
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    assert manifest["target"] == "tvm" and manifest["precision"] == precision
    tools = manifest["tool_versions"]
    assert tools["apache-tvm"].startswith("0.27") and tools["apache-tvm-ffi"] == "0.1.14.post1"
    assert tools["host_cpu"] == cpu_fingerprint()  # the descriptor's extra_versions: a library is per CPU
    details = manifest["engine_details"]
    assert details["target"]["kind"] == "llvm" and details["target"]["mcpu"]
    weight_dtypes = set(details["params"]["dtypes"])
    assert ("float16" in weight_dtypes) is (precision == "fp16")  # fp16 weights are stored at fp16
    assert any("options.tvm.tuning_trials" in w for w in manifest["warnings"])  # untuned is said so
    assert [b["batch_size"] for b in manifest["benchmark"]] == [1, 8]  # dynamic batch: 1 and 8
    assert all(b["p50_ms"] > 0 for b in manifest["benchmark"])
    io = json.loads((version / "io.json").read_text())
    assert io["inputs"][0]["name"] == "input" and io["inputs"][0]["dtype"] == "float32"
    assert io["inputs"][0]["shape"][0] is None and io["outputs"][0]["dtype"] == "float32"


def test_runner_loads_the_published_library(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    """The published folder alone runs: the runner and the README's own snippet, against onnxruntime at batch 3."""
    assert _compile(cnn_onnx, store, repository, "fp32").targets["tvm"].status == "succeeded"
    version = repo_dir / "tvm" / "m" / "1"
    feed = np.random.default_rng(7).standard_normal((3, 3, 32, 32)).astype(np.float32)
    expected = _ort(cnn_onnx, feed)
    runner = open_runner(Format("tvm_library"), version / "model.so")
    try:
        assert [t.name for t in runner.inputs] == ["input"] and [t.name for t in runner.outputs] == ["output"]
        got = runner.run({"input": feed})["output"]
    finally:
        runner.close()
    assert got.shape == expected.shape == (3, 10)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)
    readme = (version / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    cwd = Path.cwd()
    os.chdir(version)
    try:
        exec(snippet, scope)
    finally:
        os.chdir(cwd)
    assert scope["out"].numpy().shape == (1, 10)  # type: ignore[attr-defined]


def test_cli_compiles_with_cuda_cross_compile(cnn_onnx: Path, tmp_path: Path) -> None:
    """`kiln compile --target tvm` with options.tvm.cuda_arch: a CPU library validated, a CUDA library built without a GPU."""
    if find_nvcc() is None and importlib.util.find_spec("cuda") is None:
        pytest.skip(
            "neither nvcc (the nvidia-cuda-nvcc wheel) nor NVRTC (cuda-bindings) is installed to compile kernels"
        )
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"options": {"tvm": {"cuda_arch": "sm_90"}}, "benchmark": {"iterations": 3, "warmup": 1}})
    )
    repo = tmp_path / "repo"
    args = ["compile", str(cnn_onnx), "--target", "tvm", "--precision", "fp16", "--repo", str(repo), "--name", "cnn"]
    args += ["--spec", str(spec), "--cache-dir", str(tmp_path / "cache"), "-q"]
    proc = subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    version = repo / "tvm" / "cnn" / "1"
    assert {p.name for p in version.iterdir()} == VERSION_FILES | {
        "model_cuda.so",
        "kiln-signature.sig",
    }  # the CLI signs what it publishes
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    cuda = manifest["engine_details"]["cuda"]
    # The kernels are a cubin for sm_90 packed into the library (read back from the file): it loads
    # with the CUDA driver alone, and holds no CUDA C for NVRTC to compile at load time.
    assert cuda["arch"] == "sm_90" and cuda["kernels"] >= 3 and cuda["compiler"].startswith(("nvcc", "nvrtc"))
    (image,) = embedded_cuda(version / "model_cuda.so")
    assert (image.fmt, image.arch) == ("cubin", "sm_90") and image.size > 1000 and image.kernels == cuda["kernels"]
    assert b'extern "C" __global__' not in (version / "model_cuda.so").read_bytes()
    # No GPU worker checked it: the version says so.
    assert manifest["device_check"]["checked_on"] == "cpu"
    assert any(w.startswith("checked on the CPU only: tvm runs on a GPU") for w in manifest["warnings"])
    readme = (version / "README.md").read_text()
    assert "model_cuda.so" in readme and "TVM_USE_RUNTIME_LIB" in readme and "no NVRTC" in readme


def _conv_relu_onnx(path: Path) -> Path:
    """Conv + Relu at a fixed shape: one fused kernel, so a two-trial budget tunes all of it quickly."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    bias = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "b")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["input", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["output"]),
        ],
        "conv_relu",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 8, 16, 16])],
        [weight, bias],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_tuning_with_a_tiny_budget(tmp_path: Path, store, repository, repo_dir: Path) -> None:
    model = _conv_relu_onnx(tmp_path / "conv.onnx")
    result = _compile(model, store, repository, "fp32", options={"tvm": {"tuning_trials": 2}})
    target = result.targets["tvm"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"] is True
    tuning = json.loads((repo_dir / "tvm" / "m" / "1" / "kiln-manifest.json").read_text())["engine_details"]["tuning"]
    assert tuning["trials"] == 2 and tuning["records"] >= 1 and tuning["measured"] >= 1
    assert tuning["static_shapes"] == {"input": [1, 3, 16, 16]}
    check = tuning["speed_check"]  # the faster of the tuned and the default library is kept
    assert check["kept"] in ("tuned", "default") and check["tuned_ms"] > 0 and check["default_ms"] > 0
    assert (check["kept"] == "tuned") is (check["tuned_ms"] <= check["default_ms"])


def test_tuning_an_open_axis_names_the_input(cnn_onnx: Path, store, repository) -> None:
    result = _compile(cnn_onnx, store, repository, "fp32", options={"tvm": {"tuning_trials": 2}})
    target = result.targets["tvm"]
    assert target.status == "failed"
    assert target.error["code"] == "INVALID_SPEC" and "inputs.input.shape" in target.error["hint"]


def test_refusals() -> None:
    with pytest.raises(NoRoute):
        plan_routes(Format.ONNX, load_spec({"targets": ["tvm"], "precision": "int8"}))
    with pytest.raises(NoRoute):
        plan_routes(Format("tvm_library"), load_spec({"targets": ["onnxruntime"]}))
    with pytest.raises(InvalidSpec):
        load_spec({"targets": ["tvm"], "options": {"tvm": {"cuda_arch": "ampere"}}})
    with pytest.raises(InvalidSpec):
        load_spec({"targets": ["tvm"], "options": {"tvm": {"tuning_trials": -1}}})


def test_routes_show_tvm() -> None:
    proc = subprocess.run([*KILN_CMD, "routes", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    (tvm,) = [e for e in body["exporters"] if e["target"] == "tvm"]
    assert tvm["engine"] == "tvm"


def test_host_cpu_is_in_tvm_tool_versions_only() -> None:
    """The CPU a library is compiled for keys the tvm steps' cache (extra_versions), and no other engine's."""
    assert tool_versions("tvm")["host_cpu"] == cpu_fingerprint()
    assert "host_cpu" not in tool_versions("onnxruntime")


class TestTvmRunner(RunnerContract):
    fmt = "tvm_library"

    @pytest.fixture
    def model(self, onnx_model: Path, tmp_path: Path) -> Path:
        out = tmp_path / "lib"
        out.mkdir()
        build_libraries(onnx_model, out, fp16=False, options=TvmOptions(), spec_inputs={}, scratch=tmp_path / "scratch")
        return out / "model.so"


class TestTvmExporter(ExporterContract):
    target = "tvm"
