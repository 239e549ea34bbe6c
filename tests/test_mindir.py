"""MindIR sources: MindSpore (nn.GraphCell) gives the reference outputs; MindSpore's own ONNX
exporter, or Kiln's converter over MindIR's protobuf when that fails, gives ONNX; `kiln compile`
publishes onnxruntime and openvino artifacts.

The models are small MindSpore networks exported here (random weights).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from engine_contract import BATCH, FEATURES, RunnerContract
from jobs_support import KILN_CMD

from services.errors import UnsafeInput
from services.formats import Format, detect_format

ms = pytest.importorskip("mindspore", reason="MindSpore (the mindspore extra) reads MindIR sources")
nn = ms.nn
ops = ms.ops


class TinyCNN(nn.Cell):  # type: ignore[misc]
    """Conv (pad and same), BatchNorm, residual Add, max and average pooling, Concat, Dense, Softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, pad_mode="pad", padding=1, has_bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, pad_mode="same", has_bias=True, group=2)
        self.maxpool = nn.MaxPool2d(2, 2)
        self.avgpool = nn.AvgPool2d(2, 2)
        self.flat = nn.Flatten()
        self.fc = nn.Dense(8 * 4 * 4 * 2, 10)
        self.softmax = nn.Softmax()
        self.sig = nn.Sigmoid()

    def construct(self, x):  # type: ignore[no-untyped-def]
        y = self.relu(self.bn(self.conv1(x)))
        z = self.conv2(y) + y
        c = ops.concat((self.maxpool(z), self.avgpool(self.sig(z))), 1)
        return self.softmax(self.fc(self.flat(c)))


class Activation(nn.Cell):  # type: ignore[misc]
    """Dense then one activation: HSwish has no entry in MindSpore 2.10's ONNX convert map, Cosh in neither."""

    def __init__(self, act) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fc = nn.Dense(4, 6)
        self.act = act

    def construct(self, x):  # type: ignore[no-untyped-def]
        return self.act(self.fc(x))


def _export(net, path: Path, shape=(2, 3, 8, 8)) -> Path:  # type: ignore[no-untyped-def]
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    net.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).random(shape, dtype=np.float32))
    ms.export(net, x, file_name=str(path.with_suffix("")), file_format="MINDIR")
    return path


@pytest.fixture(scope="module")
def cnn_mindir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    net = TinyCNN()
    # Non-trivial BatchNorm statistics, so folding them wrong shows.
    rng = np.random.default_rng(1)
    net.bn.moving_mean.set_data(ms.Tensor(rng.normal(size=8).astype(np.float32)))
    net.bn.moving_variance.set_data(ms.Tensor(rng.uniform(0.5, 2.0, size=8).astype(np.float32)))
    return _export(net, tmp_path_factory.mktemp("mindir") / "cnn.mindir")


def test_detection_and_the_graphcell_reference(cnn_mindir: Path) -> None:
    from services.runners.mindir import MindIRRunner

    fmt, seen = detect_format(cnn_mindir)
    assert fmt is Format.MINDIR and "MindSpore" in seen
    runner = MindIRRunner(cnn_mindir)
    assert [(t.name, t.shape) for t in runner.inputs] == [("x", (2, 3, 8, 8))]
    assert [(t.name, t.shape) for t in runner.outputs] == [("output_0", (2, 10))]
    out = runner.run({"x": np.ones((2, 3, 8, 8), np.float32)})["output_0"]
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)  # the softmax ran


def test_converter_matches_graphcell(cnn_mindir: Path) -> None:
    import onnx
    import onnxruntime as ort

    from services.converters.mindir_to_onnx import mindir_model_to_onnx
    from services.formats.mindir import vet_mindir
    from services.runners.mindir import MindIRRunner

    model = mindir_model_to_onnx(vet_mindir(cnn_mindir))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).normal(size=(2, 3, 8, 8)).astype(np.float32)
    ours = session.run(["output_0"], {"x": x})[0]
    theirs = MindIRRunner(cnn_mindir).run({"x": x})["output_0"]
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-4)


def test_kiln_compile_mindir_to_onnxruntime_and_openvino(cnn_mindir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    args = ["compile", str(cnn_mindir), "-t", "onnxruntime", "-t", "openvino", "--repo", str(repo), "--name", "ms"]
    proc = subprocess.run(
        [*KILN_CMD, *args, "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "mindir → onnx → optimize ⇒ onnxruntime" in proc.stdout
    for target, artifact in (("onnxruntime", "model.onnx"), ("openvino", "model.xml")):
        version = repo / "triton" / f"ms-{target}" / "1"
        assert (version / artifact).is_file()
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        assert manifest["source"]["format"] == "mindir"
        (out,) = manifest["parity"]["outputs"]
        assert manifest["parity"]["passed"] and out["name"] == "output_0"
        assert out["max_abs"] < 1e-5 and out["top1"] == 1.0
        convert = next(s for s in manifest["steps"] if s["kind"] == "convert")
        assert (convert["step"], convert["tool"]) == ("mindir-to-onnx", "mindspore.onnx.export")
        assert convert["tool_versions"]["mindspore"] == ms.__version__


def _compile_one(path: Path, store, repository):  # type: ignore[no-untyped-def]
    from services.pipeline.local import compile_model
    from services.spec import load_spec

    spec = load_spec({"targets": ["onnxruntime"], "name": "a", "benchmark": False, "validation": {"samples": 4}})
    return compile_model(path, spec, store=store, repository=repository).targets["onnxruntime"]


def test_an_op_mindspore_cannot_export_takes_kilns_converter_route(tmp_path: Path, store, repository) -> None:
    target = _compile_one(_export(Activation(nn.HSwish()), tmp_path / "hswish.mindir", shape=(2, 4)), store, repository)
    assert target.status == "succeeded", target.error
    assert target.parity["outputs"][0]["max_abs"] < 1e-5
    first, second = target.attempts
    assert (first["status"], first["code"], first["tool"]) == ("failed", "CONVERSION_FAILED", "mindspore.onnx.export")
    assert "HSwish" in first["message"] and first["step"] == "mindir-to-onnx"
    assert second["status"] == "succeeded" and second["rank"] == 2


def test_an_op_neither_route_maps_is_conversion_failed_naming_it(tmp_path: Path, store, repository) -> None:
    from services.converters.mindir_to_onnx import mindir_model_to_onnx
    from services.formats.mindir import vet_mindir

    path = _export(Activation(ops.Cosh()), tmp_path / "cosh.mindir", shape=(2, 4))
    with pytest.raises(ValueError, match="'Cosh'"):
        mindir_model_to_onnx(vet_mindir(path))
    target = _compile_one(path, store, repository)
    assert target.error is not None and target.error["code"] == "CONVERSION_FAILED"
    assert "Cosh" in json.dumps(target.error)


def test_code_carrying_mindir_is_unsafe_input(cnn_mindir: Path, tmp_path: Path) -> None:
    from mindspore.train import mind_ir_pb2

    from services.formats import open_source
    from services.formats.mindir import vet_mindir, vet_mindir_upload
    from services.runners.mindir import MindIRRunner

    def edited(name: str, change) -> Path:  # type: ignore[no-untyped-def]
        model = mind_ir_pb2.ModelProto()
        model.ParseFromString(cnn_mindir.read_bytes())
        change(model)
        path = tmp_path / name
        path.write_bytes(model.SerializeToString())
        return path

    def custom_op(m) -> None:  # type: ignore[no-untyped-def]
        m.primitives[0].op_type = "Custom"

    def bprop(m) -> None:  # type: ignore[no-untyped-def]
        m.graph.bprop_filepath = "/tmp/evil_bprop.py"

    def external(m) -> None:  # type: ignore[no-untyped-def]
        m.graph.parameter[0].external_data.location = "../../etc/weights.bin"

    def nested_code(m) -> None:  # type: ignore[no-untyped-def]
        m.graph.node[0].attribute.add(name="body").g.node.add(op_type="PyFunc")

    def attribute_tensor(m) -> None:  # type: ignore[no-untyped-def]
        m.graph.node[0].attribute.add(name="w").t.external_data.location = "/etc/passwd"

    def preprocessing(m) -> None:  # type: ignore[no-untyped-def]
        m.preprocessor.op.add(op_type="Decode", operations='{"dataset_dir": "/etc"}')

    for name, change, words in (
        ("custom.mindir", custom_op, "Custom operator"),
        ("bprop.mindir", bprop, "bprop file"),
        ("external.mindir", external, "external file"),
        ("nested.mindir", nested_code, "PyFunc operator"),
        ("attribute.mindir", attribute_tensor, "external file"),
        ("preprocess.mindir", preprocessing, "preprocessing pipeline"),
    ):
        path = edited(name, change)
        assert detect_format(path)[0] is Format.MINDIR
        # At submission without MindSpore (vet_mindir_upload, through open_source), and where it is read.
        for read in (lambda p: open_source(p, tmp_path / "work"), vet_mindir_upload, vet_mindir, MindIRRunner):
            with pytest.raises(UnsafeInput) as exc:
                read(path)
            assert words in exc.value.message, (name, exc.value.message)


def test_mindspores_exporter_needs_a_graphcell_that_never_ran(cnn_mindir: Path, tmp_path: Path) -> None:
    """Why the export step loads a cell of its own: MindSpore 2.10 cannot export a GraphCell it has run."""
    import mindspore.onnx

    x = ms.Tensor(np.zeros((2, 3, 8, 8), np.float32))
    ran = nn.GraphCell(ms.load(str(cnn_mindir)))
    ran(x)
    with pytest.raises(RuntimeError, match=r"pointer\[context\] is null"):
        mindspore.onnx.export(ran, x, file_name=str(tmp_path / "ran.onnx"))
    fresh = nn.GraphCell(ms.load(str(cnn_mindir)))
    mindspore.onnx.export(fresh, x, file_name=str(tmp_path / "fresh.onnx"), input_names=["x"])
    assert (tmp_path / "fresh.onnx").stat().st_size > 1000


# --------------------------------------------------------------------------- the runner contract


class ContractNet(nn.Cell):  # type: ignore[misc]
    """The contract model: z_sum = x + y, then a_prod = x * y."""

    def construct(self, x, y):  # type: ignore[no-untyped-def]
        return x + y, x * y


class TestMindIRRunner(RunnerContract):
    """The contract model exported to MindIR (shapes fixed at batch 3), run by nn.GraphCell."""

    fmt = "mindir"
    output_names = ("output_0", "output_1")  # MindIR's own output names are node ids; Kiln numbers them

    @pytest.fixture
    def model(self, tmp_path: Path) -> Path:
        ms.set_context(mode=ms.GRAPH_MODE)
        net = ContractNet()
        net.set_train(False)
        x = ms.Tensor(np.zeros((BATCH, FEATURES), np.float32))
        path = tmp_path / "contract.mindir"
        ms.export(net, x, x, file_name=str(path.with_suffix("")), file_format="MINDIR")
        return path


def test_a_tuple_output_is_one_output_per_member_on_both_routes(tmp_path: Path) -> None:
    """A network returning (x + y, x * y): the runner and both converters give two outputs, output_0 and output_1."""
    from types import SimpleNamespace

    import onnxruntime as ort

    from services.converters.mindir_to_onnx import mindir_model_to_onnx, mindir_to_onnx_mindspore
    from services.formats.mindir import vet_mindir
    from services.runners.mindir import MindIRRunner

    ms.set_context(mode=ms.GRAPH_MODE)
    net = ContractNet()
    net.set_train(False)
    x = ms.Tensor(np.zeros((BATCH, FEATURES), np.float32))
    path = tmp_path / "pair.mindir"
    ms.export(net, x, x, file_name=str(path.with_suffix("")), file_format="MINDIR")
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal((BATCH, FEATURES)).astype(np.float32) for n in ("x", "y")}
    runner = MindIRRunner(path)
    assert [(t.name, t.shape) for t in runner.outputs] == [("output_0", (3, 4)), ("output_1", (3, 4))]
    want = runner.run(feeds)
    np.testing.assert_allclose(want["output_0"], feeds["x"] + feeds["y"], rtol=1e-6)
    np.testing.assert_allclose(want["output_1"], feeds["x"] * feeds["y"], rtol=1e-6)
    ours = mindir_model_to_onnx(vet_mindir(path)).SerializeToString()
    # MindSpore's exporter, called as the mindir-to-onnx step calls it (its context: the source, a directory).
    out_dir = tmp_path / "exported"
    out_dir.mkdir()
    ctx = SimpleNamespace(model=SimpleNamespace(path=path), out_dir=out_dir, step=SimpleNamespace(id="mindir-to-onnx"))
    ctx.progress = lambda _msg: None
    artifact = mindir_to_onnx_mindspore(ctx)  # type: ignore[arg-type]
    theirs = (out_dir / artifact.entry).read_bytes()
    for model in (ours, theirs):
        sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        assert [o.name for o in sess.get_outputs()] == ["output_0", "output_1"]
        for name, got in zip(["output_0", "output_1"], sess.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want[name], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the service


def test_the_service_runs_a_mindir_job_on_the_mindspore_worker(cnn_mindir: Path, tmp_path: Path) -> None:
    """`kiln api` with a mindspore and an onnxruntime worker: MindSpore's steps ride kiln.mindspore, the rest kiln.onnxruntime."""
    from jobs_support import (
        Proc,
        free_port,
        migrated_pg,
        redis_url,
        service_env,
        submit,
        wait_http,
        wait_job,
        wait_workers,
    )

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "database_url": migrated_pg(own=True),  # no earlier test's running jobs to wait behind
        "broker_url": redis_url(),
        "repository": str(tmp_path / "repo"),
        "artifact_store": str(tmp_path / "store"),
    }
    procs = [
        Proc(
            ["worker", "--engine", engine, "--concurrency", "1"],
            service_env(cache_dir=tmp_path / f"cache-{engine}", **env),
            tmp_path / f"worker-{engine}.log",
        )
        for engine in ("mindspore", "onnxruntime")
    ]
    try:
        api = Proc(
            ["api", "--port", str(port), "--no-access-log"],
            service_env(cache_dir=tmp_path / "api", **env),
            tmp_path / "api.log",
        )
        procs.append(api)
        wait_http(f"{base}/healthz", proc=api)
        wait_workers(base, {"mindspore", "onnxruntime"}, procs=procs[:2])
        spec = {"targets": ["onnxruntime"], "benchmark": {"iterations": 3, "warmup": 1}, "validation": {"samples": 4}}
        r = submit(base, cnn_mindir, spec)
        assert r.status_code == 202, r.text
        job = wait_job(base, r.json()["id"], timeout=180)
        assert job["status"] == "succeeded", job
        assert job["source"]["format"] == "mindir"
        steps = {s["id"]: s for s in job["steps"] if s["finished_at"]}
        assert steps["reference"]["queue"] == steps["mindir-to-onnx"]["queue"] == "kiln.mindspore"
        assert steps["export:onnxruntime"]["queue"] == "kiln.onnxruntime"
        assert steps["reference"]["worker"] != steps["export:onnxruntime"]["worker"]
        parity = job["targets"]["onnxruntime"]["parity"]
        assert parity["passed"] is True and parity["outputs"][0]["cosine"] > 0.9999
    finally:
        for p in procs:
            p.stop()
