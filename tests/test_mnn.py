"""The mnn target end to end: `kiln compile` to .mnn at fp32, fp16 and int8, run by MNN's Python API.

Also: the converter never reaches the network nor starts pip (the mnn wheel's Python wrappers
do both on import), int8 falls back to weight-only when full int8 cannot pass parity, and
`kiln routes` lists the target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from engine_contract import ExporterContract, RunnerContract
from jobs_support import KILN_CMD
from onnx import helper, numpy_helper

from services.errors import NoRoute
from services.formats import Format
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.runners import open_runner
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec

pytest.importorskip("MNN", reason="the mnn extra is not installed (pip install -c constraints.txt -e '.[mnn]')")

from services.exporters import mnn_tool
from services.exporters.mnn import onnx_tensor_specs
from services.runners.mnn import MnnRunner


def _kiln(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory):
    """One artifact store for the module: the precisions of one model share its reference and optimize steps."""
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("mnn-store"))


def _compile(model: Path, store, repository, precision: str, **extra: object):
    spec = load_spec(
        {
            "targets": ["mnn"],
            "precision": precision,
            "name": "m",
            "benchmark": {"iterations": 5, "warmup": 1},
            **extra,
        }
    )
    return compile_model(model, spec, store=store, repository=repository).targets["mnn"]


def _ort(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(("model_fixture", "shape"), [("cnn_onnx", (3, 3, 32, 32)), ("transformer_onnx", (3, 16, 32))])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_compile_to_mnn(
    model_fixture: str, shape: tuple[int, ...], precision: str, request, shared_store, repository, repo_dir: Path
) -> None:
    source = request.getfixturevalue(model_fixture)
    target = _compile(source, shared_store, repository, precision)
    assert target.status == "succeeded", target.error
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    assert target.parity["passed"] is True
    (out,) = target.parity["outputs"]
    assert out["cosine"] >= tol.min_cosine
    if tol.atol is not None:
        assert out["max_abs"] <= tol.atol + tol.rtol * 10  # outputs are O(1)

    version = repo_dir / "mnn" / "m" / "1"
    assert {p.name for p in version.iterdir()} == {"model.mnn", "kiln-manifest.json", "README.md"}
    manifest = json.loads((version / "kiln-manifest.json").read_text())
    assert manifest["target"] == "mnn" and manifest["precision"] == precision and manifest["format"] == "mnn"
    assert manifest["route"] == "onnx → optimize ⇒ mnn"
    assert [s["step"] for s in manifest["steps"]] == ["reference", "optimize", "export:mnn"]
    assert manifest["tool_versions"]["mnn"] == "3.6.1" and "onnx" in manifest["tool_versions"]
    # The open batch axis of the ONNX model survives (an .mnn stores 1 there): batch 1 and 8 are timed.
    assert manifest["io"]["inputs"][0]["shape"][0] is None
    assert [b["batch_size"] for b in manifest["benchmark"]] == [1, 8] and manifest["benchmark"][0]["p50_ms"] > 0
    details = manifest["engine_details"]
    weights = details["weights"]["conv_weights"]
    if precision == "fp32":
        assert weights["float32"] > 0 and weights["float16"] == weights["int8"] == 0
        assert "--useGeluApproximation" in details["convert_flags"]
    elif precision == "fp16":
        assert weights["float16"] > 0 and weights["float32"] == 0 and "--fp16" in details["convert_flags"]
        assert details["runtime"]["precision"] == "low"
    else:
        # Full int8: every convolution/matmul has int8 weights and int8 activation scales.
        assert weights["int8"] > 0 and weights["float32"] == 0
        assert details["weights"]["int8_activation_convs"] == weights["int8"]
        assert details["int8"]["mode"] == "full int8 (weights and activations)"
        assert details["int8"]["calibration_data"].startswith("generated")
        assert target.warnings and "generated samples" in target.warnings[0]
    if precision != "fp32":
        assert manifest["vs_fp32"]["rows"], "timed against the fp32 .mnn on the same engine"

    # The artifact as a user loads it: MNN's Python API on fresh data, against the source on onnxruntime.
    x = np.random.default_rng(99).standard_normal(shape).astype(np.float32)
    runner = MnnRunner(version / "model.mnn", tensor_specs=onnx_tensor_specs(source))
    try:
        got = runner.run({"input": x})["output"]
    finally:
        runner.close()
    want = _ort(source, x)
    assert got.shape == want.shape and got.dtype == np.float32
    assert _cosine(got, want) >= tol.min_cosine
    if precision == "fp32":
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)

    # The README's session settings are parity's (issue 30), and its snippet, run as a user would, gives
    # the outputs Kiln's runner gave.
    readme = (version / "README.md").read_text()
    runtime = details["runtime"]
    assert runtime["rearrange"] is True
    assert f"| precision | {runtime['precision']} |" in readme and "| rearrange | True" in readme
    code = readme.split("```python\n")[1].split("```")[0]
    code = code.replace("x = np.zeros([1, 3, 224, 224], np.float32)  # each input at its shape", "x = X")
    here = os.getcwd()
    os.chdir(version)
    try:
        scope: dict[str, object] = {"X": x}
        exec(code, scope)  # the published README's own code
    finally:
        os.chdir(here)
    (readme_out,) = scope["values"]  # type: ignore[misc]
    np.testing.assert_array_equal(np.asarray(readme_out).reshape(got.shape), got)


# --- the converter process: no network, no pip ----------------------------------------------------

#: Run a script under an audit hook of the test's own (not the tool's): every network or
#: process event is recorded and refused before it happens; the modules loaded are listed at exit.
_RECORDER = """
import json, runpy, sys
events = []
WATCH = ("socket.", "urllib.Request", "http.client", "subprocess.Popen", "os.system", "os.exec",
         "os.posix_spawn", "os.spawn", "os.fork", "pty.spawn")
def hook(event, args):
    if event.startswith(WATCH):
        events.append(f"{event} {args!r}"[:300])
        raise PermissionError(event)
sys.addaudithook(hook)
log, script, *rest = sys.argv[1:]
try:
    if script == "-c":
        exec(rest[0])
    else:
        sys.argv = [script, *rest]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("aliyun", "pip") or m.startswith("MNN.tools"))
    open(log, "w").write(json.dumps({"events": events, "modules": loaded}))
"""


def _recorded(tmp_path: Path, *args: str) -> dict:
    log = tmp_path / f"recorded-{len(list(tmp_path.glob('recorded-*')))}.json"
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _RECORDER, str(log), *args], capture_output=True, text=True, timeout=300
    )
    assert log.is_file(), proc.stderr[-2000:]
    return {**json.loads(log.read_text()), "rc": proc.returncode, "output": proc.stdout + proc.stderr}


def test_mnn_tools_phones_home_so_kiln_never_imports_it(tmp_path: Path) -> None:
    """The trap is real: importing MNN.tools runs `pip install` (the recorder refuses it before it runs)."""
    seen = _recorded(tmp_path, "-c", "import MNN.tools")
    assert any(e.startswith("os.system") and "pip install" in e for e in seen["events"]), seen
    assert "MNN.tools" in seen["modules"]


def test_conversion_and_quantisation_make_no_network_or_process_call(cnn_onnx: Path, tmp_path: Path) -> None:
    """The tool process Kiln runs, watched by the test's own audit hook: convert, quantise, summarise."""
    from services.exporters.mnn import write_calibration

    def request(name: str, **body: object) -> str:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**body, "result": str(tmp_path / f"{name}-result.json")}))
        return str(path)

    float_model, int8_model = tmp_path / "float.mnn", tmp_path / "int8.mnn"
    argv = ["-f", "ONNX", "--modelFile", str(cnn_onnx), "--MNNModel", str(float_model), "--bizCode", "kiln"]
    rng = np.random.default_rng(3)
    config = write_calibration(
        [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)], tmp_path / "calib"
    )
    (tmp_path / "quant.json").write_text(json.dumps({**config, "path": str(tmp_path / "calib")}))
    steps = [
        ("convert", {"op": "convert", "argv": argv}),
        (
            "quantize",
            {"op": "quantize", "src": str(float_model), "dst": str(int8_model), "config": str(tmp_path / "quant.json")},
        ),
        ("summary", {"op": "summary", "model": str(int8_model), "scratch": str(tmp_path)}),
    ]
    for name, body in steps:
        seen = _recorded(tmp_path, mnn_tool.__file__, request(name, **body))
        assert seen["rc"] == 0 and seen["events"] == [] and seen["modules"] == [], (name, seen)
        result = json.loads((tmp_path / f"{name}-result.json").read_text())
        assert result["ok"] is True and result["denied"] == [] and result["denied_modules_loaded"] == []
    assert float_model.stat().st_size > 0 and int8_model.stat().st_size > 0
    assert result["int8_activation_convs"] == 3  # two convolutions and the classifier's Gemm


def test_the_tool_refuses_the_wrappers_itself(tmp_path: Path) -> None:
    """Without the test's recorder, the tool's own guard stops an import of MNN.tools and a pip call."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(mnn_tool.__file__).parent)!r})\n"
        "import mnn_tool\n"
        "mnn_tool.install_guard()\n"
        "for attempt in ('import MNN.tools', 'import os; os.system(\"pip --version\")',"
        " 'import socket; socket.create_connection((\"127.0.0.1\", 9))'):\n"
        "    try:\n"
        "        exec(attempt)\n"
        "        print('ALLOWED', attempt)\n"
        "    except (ImportError, PermissionError) as exc:\n"
        "        print('REFUSED', type(exc).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("REFUSED", "ALLOWED"))]
    assert verdicts == ["REFUSED ImportError", "REFUSED PermissionError", "REFUSED PermissionError"]


# --- int8 fallback and refusals -------------------------------------------------------------------


def _mlp_onnx(path: Path) -> Path:
    """Two Gemms with a ReLU between: [N, 16] -> [N, 4]."""
    rng = np.random.default_rng(0)
    w1, b1 = rng.standard_normal((32, 16)).astype(np.float32) * 0.3, rng.standard_normal(32).astype(np.float32)
    w2, b2 = rng.standard_normal((4, 32)).astype(np.float32) * 0.3, rng.standard_normal(4).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["input", "w1", "b1"], ["h"], transB=1),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "w2", "b2"], ["output"], transB=1),
        ],
        "mlp",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def test_int8_falls_back_to_weight_only_when_full_int8_fails_parity(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    """Calibration rows 1e5 times smaller than the held-out parity rows: full int8 clips them; weight-only does not."""
    model = _mlp_onnx(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((32, 16)).astype(np.float32)
    held_out = np.arange(32) % 4 == 0  # every fourth row is held out for parity, never calibrated on
    rows[held_out] *= 100.0
    rows[~held_out] *= 1e-3
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=rows)
    target = _compile(model, store, repository, "int8", calibration=str(calib))
    assert target.status == "succeeded", target.error
    assert target.parity["inputs_from"] == "calibration"
    assert len(target.warnings) == 1 and "weight-only" in target.warnings[0]
    assert "full int8 failed parity" in target.warnings[0]
    manifest = json.loads((repo_dir / "mnn" / "m" / "1" / "kiln-manifest.json").read_text())
    details = manifest["engine_details"]
    assert details["int8"]["mode"] == "weight-only int8 (float activations)"
    assert details["weights"]["conv_weights"]["int8"] == 2 and details["weights"]["int8_activation_convs"] == 0


def test_int8_without_weights_is_conversion_failed(tmp_path: Path, store, repository, repo_dir: Path) -> None:
    """A graph with nothing to quantise is not published as int8 (it would be fp32 under a false label)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["r"]), helper.make_node("Sigmoid", ["r"], ["output"])],
        "eltwise",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", 8])],
    )
    path = tmp_path / "eltwise.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    target = _compile(path, store, repository, "int8")
    assert target.status == "failed"
    assert target.error["code"] == "CONVERSION_FAILED" and "no weight" in target.error["message"]
    assert "fp32 or fp16" in target.error["hint"]
    assert not (repo_dir / "mnn" / "m").exists()


def test_kiln_compile_command(transformer_onnx: Path, tmp_path: Path) -> None:
    """`kiln compile --target mnn` as a user runs it: exit 0, the summary table, the published .mnn."""
    repo = tmp_path / "repo"
    proc = _kiln(
        "compile",
        str(transformer_onnx),
        "--target",
        "mnn",
        "--precision",
        "int8",
        "--repo",
        str(repo),
        "--name",
        "block",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "✔ export:mnn" in proc.stderr
    assert "onnx → optimize ⇒ mnn" in proc.stdout and "succeeded" in proc.stdout
    assert "generated samples" in proc.stdout  # the int8 calibration warning
    assert (repo / "mnn" / "block" / "1" / "model.mnn").is_file()


def test_routes_and_refusals() -> None:
    proc = _kiln("routes", "--json")
    assert proc.returncode == 0, proc.stderr
    (mnn,) = [e for e in json.loads(proc.stdout)["exporters"] if e["target"] == "mnn"]
    assert mnn["engine"] == "mnn" and mnn["accepts"] == {"onnx": 1.5, "caffe": 1.5}
    assert "mnn" in _kiln("routes").stdout
    plan = plan_routes(Format.KERAS, load_spec({"targets": ["mnn"]}))
    assert plan.routes["mnn"] == "keras → onnx → optimize ⇒ mnn"
    assert next(s for s in plan.steps if s.id == "export:mnn").queue == "kiln.mnn"
    with pytest.raises(NoRoute, match="not a source"):
        plan_routes(Format("mnn"), load_spec({"targets": ["mnn"]}))
    # int4 is onnxruntime's and OpenVINO's weight-only compression: refused at planning, naming both.
    with pytest.raises(NoRoute, match="to mnn at int4") as exc:
        plan_routes(Format.ONNX, load_spec({"targets": ["mnn"], "precision": "int4"}))
    assert "Kiln can build: onnxruntime, openvino." in exc.value.hint
    assert "mnn from this source is possible at: fp16, fp32, int8" in exc.value.hint


# --- Caffe -> MNN natively (for when the converter graph has a Caffe source format) --------------


def _tiny_caffe_model(root: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """Conv 3x3 + ReLU + max pool + InnerProduct + Softmax as a Caffe .prototxt and .caffemodel, built without Caffe.

    The .caffemodel is a NetParameter serialised with a descriptor of the few caffe.proto
    messages it needs, under their caffe.proto field numbers (layer 100, blobs 7, shape 7,
    data 5 packed, dim 1 packed), so the bytes are what Caffe itself writes for these fields.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="caffe_subset.proto", package="caffe", syntax="proto2")
    F = descriptor_pb2.FieldDescriptorProto
    fields = {
        "BlobShape": [("dim", 1, F.TYPE_INT64, F.LABEL_REPEATED, "", True)],
        "BlobProto": [
            ("shape", 7, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".caffe.BlobShape", False),
            ("data", 5, F.TYPE_FLOAT, F.LABEL_REPEATED, "", True),
        ],
        "LayerParameter": [
            ("name", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, "", False),
            ("type", 2, F.TYPE_STRING, F.LABEL_OPTIONAL, "", False),
            ("blobs", 7, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".caffe.BlobProto", False),
        ],
        "NetParameter": [
            ("name", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, "", False),
            ("layer", 100, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".caffe.LayerParameter", False),
        ],
    }
    for name, spec in fields.items():
        message = fdp.message_type.add(name=name)
        for field_name, number, kind, label, type_name, packed in spec:
            field = message.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
            if packed:
                field.options.packed = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    net_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.NetParameter"))
    rng = np.random.default_rng(0)
    weights = {
        "w1": (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32),
        "b1": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((10, 8 * 8 * 8)) * 0.05).astype(np.float32),
        "b2": (rng.standard_normal(10) * 0.1).astype(np.float32),
    }
    net = net_cls(name="tiny")
    for layer_name, kind, blobs in (("conv1", "Convolution", ("w1", "b1")), ("fc", "InnerProduct", ("w2", "b2"))):
        layer = net.layer.add(name=layer_name, type=kind)
        for key in blobs:
            blob = layer.blobs.add()
            blob.shape.dim.extend(weights[key].shape)
            blob.data.extend(weights[key].ravel().tolist())
    caffemodel = root / "tiny.caffemodel"
    caffemodel.write_bytes(net.SerializeToString())
    prototxt = root / "tiny.prototxt"
    prototxt.write_text(
        'name: "tiny"\n'
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 16 dim: 16 } } }\n'
        'layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"'
        " convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 1 } }\n"
        'layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }\n'
        'layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"'
        " pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n"
        'layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc" inner_product_param { num_output: 10 } }\n'
        'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }\n'
    )
    return prototxt, caffemodel, weights


def _caffe_reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """The tiny Caffe net computed by torch's functional ops: an independent path from MNN's."""
    import torch

    t = torch.from_numpy
    h = torch.nn.functional.conv2d(t(x), t(w["w1"]), t(w["b1"]), padding=1).relu()
    h = torch.nn.functional.max_pool2d(h, 2, 2).flatten(1)
    return torch.softmax(h @ t(w["w2"]).T + t(w["b2"]), -1).numpy()


@pytest.mark.parametrize(("flags", "atol"), [([], 1e-5), (["--fp16"], 2e-3), (["--weightQuantBits", "8"], 1e-2)])
def test_caffe_converts_natively(flags: list[str], atol: float, tmp_path: Path) -> None:
    from services.artifacts import Artifact
    from services.exporters.mnn import MnnSource, convert

    prototxt, caffemodel, weights = _tiny_caffe_model(tmp_path)
    source = MnnSource.from_artifact(Artifact(root=tmp_path, kind="caffe"))
    assert (source.framework, source.prototxt, source.model_file) == ("CAFFE", prototxt, caffemodel)
    dst = tmp_path / "model.mnn"
    used = convert(source, dst, tmp_path / "scratch", flags=flags)
    assert used[:2] == ["--useGeluApproximation", "0"] and used[2:] == flags
    runner = MnnRunner(dst)
    try:
        assert [t.name for t in runner.inputs] == ["data"] and [t.name for t in runner.outputs] == ["prob"]
        assert runner.inputs[0].shape == (1, 3, 16, 16)
        x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
        got = runner.run({"data": x})["prob"]
    finally:
        runner.close()
    np.testing.assert_allclose(got, _caffe_reference(x, weights), atol=atol)


def test_an_op_mnn_lacks_is_conversion_failed_naming_it(tmp_path: Path, store, repository) -> None:
    """MNNConvert prints "Converted Failed!" yet returns success; Kiln reports the op it lacks."""
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    graph = helper.make_graph(
        [
            helper.make_node("IsNaN", ["input"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "input"], ["output"]),
        ],
        "nan_to_zero",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", 8])],
        [zero],
    )
    path = tmp_path / "nan_to_zero.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    target = _compile(path, store, repository, "fp32")
    assert target.status == "failed"
    assert target.error["code"] == "CONVERSION_FAILED"
    assert "IsNaN" in target.error["message"] and "onnxruntime or openvino" in target.error["hint"]


def test_a_job_through_the_service_runs_its_export_on_the_mnn_queue(cnn_onnx: Path, tmp_path: Path) -> None:
    """`kiln serve` (embedded broker, one worker per installed engine): the export step runs on kiln.mnn."""
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
        wait_workers(base, {"onnxruntime", "mnn"}, procs=[proc])
        spec = {"targets": ["mnn"], "precision": "fp16", "benchmark": {"iterations": 3, "warmup": 1}}
        job = wait_job(base, submit(base, cnn_onnx, spec).json()["id"])
        assert job["status"] == "succeeded", job
        steps = {s["id"]: s for s in job["steps"]}
        assert steps["export:mnn"]["queue"] == "kiln.mnn" and steps["reference"]["queue"] == "kiln.onnxruntime"
        target = job["targets"]["mnn"]
        assert target["parity"]["passed"] is True and target["published"]["version"] == 1
        tar = httpx.get(f"{base}{target['download_url']}", timeout=30).content
        assert b"model.mnn" in tar
    finally:
        proc.stop()
    assert (tmp_path / "repo" / "mnn" / "cnn" / "1" / "model.mnn").is_file()


# --- the engine contract (tests/engine_contract.py) ------------------------------------------------


class TestMnnRunner(RunnerContract):
    fmt = "mnn"

    @pytest.fixture
    def model(self, onnx_model: Path, tmp_path: Path) -> Path:
        from services.exporters.mnn import convert_onnx

        path = tmp_path / "model.mnn"
        convert_onnx(onnx_model, path, tmp_path / "scratch", flags=[])
        return path

    @pytest.fixture
    def runner(self, model: Path, onnx_model: Path) -> Any:
        # A .mnn stores 1 for an open axis and no output shapes, so Kiln opens it with the source's
        # tensor specs (the exporter's runner_options); without them inputs read (1, 4), outputs ().
        r = open_runner(Format("mnn"), model, tensor_specs=onnx_tensor_specs(onnx_model))
        yield r
        r.close()


class TestMnnExporter(ExporterContract):
    target = "mnn"


def test_a_converter_crash_names_the_signal(cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # MNNConvert 3.6.1 dies with SIGSEGV on some graphs (an LSTM without its optional outputs,
    # found by the architecture matrix); the error must say so, not quote its last log line.
    import services.exporters.mnn as mnn_export
    from services.errors import ConversionFailed
    from services.exporters.mnn import MnnSource, MnnToolError, convert

    def crashed(request: dict[str, Any], scratch: Path, **_: Any) -> Any:
        raise MnnToolError("convert failed (killed by signal 11)", output="Start to Optimize the MNN Net...")

    monkeypatch.setattr(mnn_export, "run_tool", crashed)  # provoke the fault; the real crash needs MNN's bug
    with pytest.raises(ConversionFailed) as err:
        convert(MnnSource("ONNX", cnn_onnx), tmp_path / "m.mnn", tmp_path / "scratch", flags=[])
    assert "killed by signal 11" in err.value.message
    assert err.value.code == "CONVERSION_FAILED"
