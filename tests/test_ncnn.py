"""The ncnn target: pnnx from ONNX and TorchScript, fp32/fp16, the ncnn runner, batch by looping, errors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from engine_contract import ExporterContract, RunnerContract
from jobs_support import KILN_CMD

from kiln_testing.models import assert_parity_passed, export_onnx, tiny_cnn_module, tiny_transformer_module
from services.errors import ConversionFailed, KilnError, NoRoute, Timeout
from services.pipeline import compile_model
from services.spec import load_spec

pytest.importorskip("ncnn", reason="the ncnn extra is not installed: pip install -c constraints.txt -e '.[ncnn]'")
pytest.importorskip("pnnx", reason="the ncnn extra is not installed: pip install -c constraints.txt -e '.[ncnn]'")

from services.exporters.ncnn import run_pnnx, unconverted_layers
from services.runners.ncnn import NcnnRunner

# (example input shape, module factory) of the two models every route is checked on.
MODELS = {"cnn": ((1, 3, 32, 32), tiny_cnn_module), "transformer": ((1, 16, 32), tiny_transformer_module)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each model as ONNX (dynamic batch) and as a traced TorchScript (traced at batch 2)."""
    import torch

    folder = tmp_path_factory.mktemp("ncnn-sources")
    out = {}
    for name, (shape, factory) in MODELS.items():
        module = factory()
        out[(name, "onnx")] = export_onnx(module, torch.randn(*shape), folder / f"{name}.onnx")
        pt = folder / f"{name}.pt"
        torch.jit.trace(module, torch.randn(2, *shape[1:])).save(str(pt))
        out[(name, "torchscript")] = pt
    return out


@pytest.fixture(scope="module")
def ncnn_store(tmp_path_factory: pytest.TempPathFactory):
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("ncnn-store"))


def _spec(precision: str, **extra):
    body = {
        "targets": ["ncnn"],
        "precision": precision,
        "name": "m",
        "benchmark": False,
        "validation": {"samples": 4},
        **extra,
    }
    return load_spec(body)


def _version_dir(result) -> Path:
    return Path(result.targets["ncnn"].published["uri"].removeprefix("file://"))


# --------------------------------------------------------------------------- every route, both precisions


@pytest.mark.parametrize("source", ["onnx", "torchscript"])
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_compile_to_ncnn_fp32_and_fp16(model, source, sources, ncnn_store, tmp_path) -> None:
    from services.repository import LocalModelRepository

    sizes = {}
    for precision in ("fp32", "fp16"):
        repository = LocalModelRepository(tmp_path / precision)
        result = compile_model(sources[(model, source)], _spec(precision), store=ncnn_store, repository=repository)
        target = result.targets["ncnn"]
        assert target.status == "succeeded", target.error
        assert_parity_passed(target.parity, precision)
        version = _version_dir(result)
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        # pnnx reads TorchScript itself (here traced at batch 2): no ONNX round trip, no fallback taken.
        assert manifest["route"] == ("torchscript ⇒ ncnn" if source == "torchscript" else "onnx → optimize ⇒ ncnn")
        assert len(manifest["route_attempts"]) <= 1, manifest["route_attempts"]
        assert version == tmp_path / precision / "ncnn" / "m" / "1"
        assert {p.name for p in version.iterdir()} == {
            "model.ncnn.param",
            "model.ncnn.bin",
            "model.ncnn.json",
            "kiln-manifest.json",
        }
        assert manifest["format"] == "ncnn" and manifest["precision"] == precision
        assert manifest["tool_versions"]["pnnx"] and manifest["tool_versions"]["ncnn"]
        details = manifest["engine_details"]["ncnn"]
        input_name = "input" if source == "onnx" else "x"
        assert details["blobs"] == {
            "inputs": {input_name: "in0"},
            "outputs": {manifest["io"]["outputs"][0]["name"]: "out0"},
        }
        assert details["options"]["use_fp16_storage"] is (precision == "fp16")
        assert details["command"].startswith("pnnx ") and f"fp16={int(precision == 'fp16')}" in details["command"]
        assert manifest["io"]["inputs"][0]["shape"] == [None, *MODELS[model][0][1:]]
        sizes[precision] = (version / "model.ncnn.bin").stat().st_size
    # fp16 stores the weights at half the bytes (the .bin also holds a small tag per layer).
    assert sizes["fp16"] < 0.6 * sizes["fp32"], sizes


def test_ncnn_python_api_loads_the_artifact_by_its_recorded_blobs(sources, ncnn_store, repository) -> None:
    """A client with only ncnn and the manifest runs the artifact; a batch loops and matches the source."""
    import ncnn
    import onnxruntime as ort

    src = sources[("transformer", "onnx")]
    result = compile_model(src, _spec("fp32"), store=ncnn_store, repository=repository)
    assert result.targets["ncnn"].status == "succeeded", result.targets["ncnn"].error
    version = _version_dir(result)
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    blobs = manifest["engine_details"]["ncnn"]["blobs"]
    x = np.random.default_rng(3).standard_normal((4, 16, 32)).astype(np.float32)
    expected = ort.InferenceSession(str(src)).run(None, {"input": x})[0]

    net = ncnn.Net()
    for key, value in manifest["engine_details"]["ncnn"]["options"].items():
        setattr(net.opt, key, value)
    assert net.load_param(str(version / "model.ncnn.param")) == 0
    assert net.load_model(str(version / "model.ncnn.bin")) == 0
    assert net.input_names() == [blobs["inputs"]["input"]] and net.output_names() == [blobs["outputs"]["output"]]
    with net.create_extractor() as ex:
        ex.input(blobs["inputs"]["input"], ncnn.Mat(np.ascontiguousarray(x[0])))
        status, out = ex.extract(blobs["outputs"]["output"])
    assert status == 0 and np.array(out).shape == (16, 32)  # CHW: no batch axis
    assert np.abs(np.array(out) - expected[0]).max() < 1e-4

    runner = NcnnRunner(version / "model.ncnn.param")
    try:
        assert [t.shape for t in runner.inputs] == [(None, 16, 32)]
        got = runner.run({"input": x})["output"]
    finally:
        runner.close()
    assert got.shape == (4, 16, 32)
    assert np.abs(got - expected).max() < 1e-4


def test_benchmark_times_the_batch_loop(sources, ncnn_store, repository) -> None:
    spec = _spec("fp16", benchmark={"batch_sizes": [1, 4], "iterations": 5, "warmup": 1})
    result = compile_model(sources[("cnn", "onnx")], spec, store=ncnn_store, repository=repository)
    target = result.targets["ncnn"]
    assert target.status == "succeeded", target.error
    rows = {row["batch_size"]: row for row in target.benchmark}
    assert set(rows) == {1, 4} and rows[4]["shapes"] == {"input": [4, 3, 32, 32]}
    assert all(row["p50_ms"] > 0 for row in rows.values())


def test_kiln_compile_command_and_routes(sources, tmp_path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    routes = CliRunner().invoke(main, ["routes"], terminal_width=200)
    assert routes.exit_code == 0, routes.output
    assert (
        "│ ncnn        │ ncnn        │ onnx (1.5), torchscript (1.5)  │ onnx: fp32/fp16; torchscript: fp32/fp16"
        in routes.output
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [
        *KILN_CMD,
        "compile",
        str(sources[("transformer", "torchscript")]),
        "--target",
        "ncnn",
        "--precision",
        "fp16",
        "--repo",
        str(tmp_path / "repo"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--name",
        "block",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    version = tmp_path / "repo" / "ncnn" / "block" / "1"
    assert (version / "model.ncnn.param").is_file() and (version / "model.ncnn.bin").is_file()
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    assert manifest["parity"]["passed"] and manifest["route"] == "torchscript ⇒ ncnn"


def test_inputs_reach_ncnn_in_its_own_aligned_memory(ncnn_store, repository, tmp_path) -> None:
    """A scalar Mul as the first layer on a 64x64x3 input segfaulted over numpy's buffer (aligned AVX loads)."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64, 64, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64, 64, 3])
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "scale",
        [x],
        [y],
        [half],
    )
    src = tmp_path / "scale.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    result = compile_model(src, _spec("fp32", validation={"samples": 16}), store=ncnn_store, repository=repository)
    target = result.targets["ncnn"]
    assert target.status == "succeeded", target.error
    assert target.parity["outputs"][0]["max_abs"] < 1e-6
    # onnx 1.23 writes IR version 14, which pnnx's onnxruntime refuses: Kiln hands it a copy stamped 13.
    ncnn_details = result.steps["export:ncnn"].meta["engine_details"]["ncnn"]
    assert any(note.startswith("ONNX IR version 14 stamped 13") for note in ncnn_details["onnx_rewrites"])


def test_a_pad_without_its_mode_attribute_is_lowered(ncnn_store, repository, tmp_path) -> None:
    """tf2onnx writes Keras' ZeroPadding2D as a Pad on NHWC with mode left to its default, which pnnx keeps as 'Pad'."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Pad", ["x", "pads"], ["p"]),
            helper.make_node("Transpose", ["p"], ["t"], perm=[0, 3, 1, 2]),
            helper.make_node("Conv", ["t", "w"], ["y"]),
        ],
        "zero-padding",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 8, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 9, 9])],
        [
            numpy_helper.from_array(np.array([0, 1, 1, 0, 0, 2, 2, 0], np.int64), "pads"),
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = tmp_path / "pad.onnx"
    onnx.save(model, src)
    result = compile_model(src, _spec("fp32", optimize=False), store=ncnn_store, repository=repository)
    target = result.targets["ncnn"]
    assert target.status == "succeeded", target.error
    assert target.parity["outputs"][0]["max_abs"] < 1e-4
    details = result.steps["export:ncnn"].meta["engine_details"]["ncnn"]
    assert (
        "mode=constant (ONNX's default) written on 1 Pad node(s), which pnnx lowers only so" in details["onnx_rewrites"]
    )
    assert "Padding" in (_version_dir(result) / "model.ncnn.param").read_text()


# --------------------------------------------------------------------------- refusals and failures


def test_int8_has_no_ncnn_route(sources) -> None:
    from services.formats import Format
    from services.graph.planner import plan_routes

    with pytest.raises(NoRoute) as exc:
        plan_routes(Format.ONNX, _spec("int8"))
    assert "ncnn from this source is possible at: fp16, fp32" in exc.value.hint


def test_fixed_batch_above_one_is_conversion_failed(ncnn_store, repository, tmp_path) -> None:
    import torch

    src = export_onnx(tiny_cnn_module(), torch.randn(2, 3, 32, 32), tmp_path / "b2.onnx", dynamic_batch=False)
    result = compile_model(src, _spec("fp32"), store=ncnn_store, repository=repository)
    error = result.targets["ncnn"].error
    assert error["code"] == "CONVERSION_FAILED"
    assert "fixes its batch axis at 2" in error["message"] and "batch 1 or an open batch axis" in error["hint"]


def test_pnnx_failure_and_timeout_are_kiln_errors(tmp_path) -> None:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConversionFailed) as exc:
        run_pnnx(bad, tmp_path / "work", ["[1,3,8,8]f32"], fp16=False)
    assert exc.value.code == "CONVERSION_FAILED" and exc.value.details["exit_status"] != 0
    assert "read_proto_from_binary failed" in exc.value.details["output_tail"]
    assert (tmp_path / "work" / "pnnx.log").is_file() and not list(tmp_path.glob("broken*.param"))

    with pytest.raises(Timeout) as slow:
        run_pnnx(bad, tmp_path / "slow", ["[1,3,8,8]f32"], fp16=False, timeout=0.001)
    assert isinstance(slow.value, KilnError) and slow.value.code == "TIMEOUT"


def test_operators_pnnx_left_unconverted_are_named(tmp_path) -> None:
    param = tmp_path / "m.param"
    param.write_text(
        "7767517\n4 4\nInput in0 0 1 in0\n"
        "pnnx.Expression expr_0 1 1 in0 1 0=add(@0,1)\n"
        "Pad pad_0 1 1 1 2 0=1\n"
        "torch.fft.fft fft_0 1 1 2 out0\n"
    )
    assert unconverted_layers(param) == ["Pad", "pnnx.Expression", "torch.fft.fft"]  # ncnn's layer is Padding


# --------------------------------------------------------------------------- the service: a queue for ncnn


def test_the_service_runs_ncnn_steps_on_the_ncnn_queue(sources, tmp_path) -> None:
    """`kiln serve` (embedded broker) serves kiln.ncnn beside the other engines; a job's export runs there."""
    import io
    import tarfile

    import httpx
    from jobs_support import Proc, free_port, service_env, submit, wait_http, wait_job, wait_workers

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(tmp_path / "repo")],
        service_env(cache_dir=tmp_path / "cache"),
        tmp_path / "serve.log",
    )
    try:
        wait_http(f"{base}/healthz", proc=proc)
        wait_workers(base, {"onnxruntime", "ncnn"}, procs=[proc])
        spec = {"targets": ["ncnn"], "precision": "fp16", "benchmark": False, "validation": {"samples": 4}}
        job = wait_job(base, submit(base, sources[("cnn", "onnx")], spec).json()["id"])
        assert job["status"] == "succeeded", job
        steps = {s["id"]: s for s in job["steps"]}
        assert steps["export:ncnn"]["queue"] == "kiln.ncnn" and steps["publish:ncnn"]["queue"] == "kiln.ncnn"
        assert steps["reference"]["queue"] == "kiln.onnxruntime"
        target = job["targets"]["ncnn"]
        assert target["parity"]["passed"] and target["published"]["version"] == 1
        tar = httpx.get(f"{base}{target['download_url']}", timeout=30).content
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            names = {m.name.rsplit("/", 1)[-1] for m in tf.getmembers() if m.isfile()}
        assert {"model.ncnn.param", "model.ncnn.bin", "model.ncnn.json"} <= names
    finally:
        proc.stop()


# --------------------------------------------------------------------------- the engine contract (tests/engine_contract.py)


class TestNcnnRunner(RunnerContract):
    fmt = "ncnn"

    @pytest.fixture
    def model(self, onnx_model: Path, tmp_path: Path) -> Path:
        from services.runners.ncnn import FP32_OPTIONS

        param, weights, _ = run_pnnx(onnx_model, tmp_path / "pnnx", ["[1,4]f32", "[1,4]f32"], fp16=False)
        meta = {
            "param": param.name,
            "bin": weights.name,
            "options": FP32_OPTIONS,
            "inputs": [
                {"name": n, "blob": f"in{i}", "dtype": "float32", "shape": [None, 4]} for i, n in enumerate("xy")
            ],
            "outputs": [
                {"name": n, "blob": f"out{i}", "dtype": "float32", "shape": [None, 4]}
                for i, n in enumerate(("z_sum", "a_prod"))
            ],
        }
        param.with_suffix(".json").write_text(json.dumps(meta))
        return param


class TestNcnnExporter(ExporterContract):
    target = "ncnn"
