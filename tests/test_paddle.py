"""PaddlePaddle sources: inference models compiled by `kiln compile` into onnxruntime and openvino.

The models are built here in Paddle with random weights and saved with ``paddle.jit.save``:
a CNN as Paddle 3's default PIR program (``model.json``) and as the legacy ProgramDesc
(``model.pdmodel``, saved with ``FLAGS_enable_pir_api=0``), and a small transformer block as
PIR (Paddle 3.3 cannot save a matmul of two activations as a ProgramDesc). Routes measured:
``.pdmodel`` reaches OpenVINO through its Paddle frontend directly, ``.json`` (which that
frontend does not read) through paddle2onnx and ONNX. Parity is against Paddle's own
outputs, inside Kiln's job and again here, from the eager model, on the published files.
Malformed, truncated and unsafe uploads are refused with a code and a hint before Paddle
reads them.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs_support import KILN_CMD, redis_url

from services.errors import SourceUnreadable, UnsafeInput
from services.formats import Format
from services.formats.detect import detect_format, open_source
from services.formats.paddle import vet_paddle_model

# Found, not imported: Paddle builds models only in children (paddle.jit.save); the runner contract
# below is the one place Paddle Inference runs in the test process.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("paddle", "paddle2onnx")),
    reason="PaddlePaddle and paddle2onnx are the `paddle` extra (make setup installs them)",
)

_BUILD = r"""
import sys
import numpy as np
import paddle

F = paddle.nn.functional
paddle.seed(0)


class CNN(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.c1 = paddle.nn.Conv2D(3, 8, 3, padding=1)
        self.bn = paddle.nn.BatchNorm2D(8)
        self.c2 = paddle.nn.Conv2D(8, 16, 3, stride=2)
        self.fc = paddle.nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.c1(x)))
        x = F.relu(self.c2(x))
        return self.fc(paddle.mean(x, axis=[2, 3]))


class Block(paddle.nn.Layer):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.proj = paddle.nn.Linear(16, d)
        self.qkv = paddle.nn.Linear(d, 3 * d)
        self.out = paddle.nn.Linear(d, d)
        self.ln1 = paddle.nn.LayerNorm(d)
        self.ff1 = paddle.nn.Linear(d, 64)
        self.ff2 = paddle.nn.Linear(64, d)
        self.ln2 = paddle.nn.LayerNorm(d)
        self.head = paddle.nn.Linear(d, 5)

    def forward(self, tokens):
        h = self.proj(tokens)

        def split(z):
            return paddle.transpose(paddle.reshape(z, [0, 0, self.heads, self.dh]), [0, 2, 1, 3])

        q, k, v = (split(z) for z in paddle.split(self.qkv(h), 3, axis=-1))
        a = F.softmax(paddle.matmul(q, k, transpose_y=True) * self.dh**-0.5, axis=-1)
        o = paddle.reshape(paddle.transpose(paddle.matmul(a, v), [0, 2, 1, 3]), [0, 0, self.heads * self.dh])
        h = self.ln1(h + self.out(o))
        h = self.ln2(h + self.ff2(F.gelu(self.ff1(h))))
        return self.head(paddle.mean(h, axis=1)), h


# The engine contract model (tests/engine_contract.py): (x + y, x * y).
class Contract(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        # A weight of exactly 1 (x * 1 is exact, inf and NaN included): without parameters
        # paddle.jit.save writes no .pdiparams, and a Paddle model is its program and parameters.
        self.one = self.create_parameter([1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, x, y):
        return (x + y) * self.one, x * y * self.one


def save(model, name, spec, feed):
    model.eval()
    paddle.jit.save(model, f"{name}/model", input_spec=[spec])
    outs = model(paddle.to_tensor(feed))
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    np.savez(f"{name}.npz", input=feed, **{f"out{i}": o.numpy() for i, o in enumerate(outs)})


rng = np.random.default_rng(0)
for which in sys.argv[1:]:
    if which.startswith("contract"):
        model = Contract()
        model.eval()
        specs = [paddle.static.InputSpec([None, 4], "float32", n) for n in ("x", "y")]
        paddle.jit.save(model, f"{which}/model", input_spec=specs)
    elif which in ("cnn_pir", "cnn_pdmodel"):
        spec = paddle.static.InputSpec([None, 3, 16, 16], "float32", "x")
        save(CNN(), which, spec, rng.standard_normal((3, 3, 16, 16)).astype("float32"))
    else:
        spec = paddle.static.InputSpec([None, None, 16], "float32", "tokens")
        save(Block(), which, spec, rng.standard_normal((2, 7, 16)).astype("float32"))
"""


def _build(root: Path, *names: str, pir: bool = True) -> None:
    # paddle.jit.save translates forward() from its source text: the script must be a file.
    script = root / "build_models.py"
    script.write_text(_BUILD)
    env = {**os.environ, "FLAGS_enable_pir_api": "1" if pir else "0", "GLOG_minloglevel": "2"}
    proc = subprocess.run(
        [sys.executable, str(script), *names], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("paddle-models")
    # The contract models first: a ProgramDesc names its variables from a process-wide counter.
    _build(root, "contract_pir", "cnn_pir", "block_pir")
    _build(root, "contract_pdmodel", "cnn_pdmodel", pir=False)
    return root


def _kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "GLOG_minloglevel": "2"}
    return subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _archive(src: Path, dest: Path, extra: dict[str, bytes] | None = None) -> Path:
    """Pack ``src``'s files (plus ``extra``) under a folder in a .zip or .tar.gz, by ``dest``'s name."""
    files = {f"inference/{p.name}": p.read_bytes() for p in sorted(src.iterdir())} | {
        f"inference/{k}": v for k, v in (extra or {}).items()
    }
    if dest.name.endswith(".zip"):
        with zipfile.ZipFile(dest, "w") as zf:
            for name, data in files.items():
                zf.writestr(name, data)
    else:
        with tarfile.open(dest, "w:gz") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return dest


def _compile(model: Path, tmp_path: Path) -> dict[str, Any]:
    proc = _kiln(
        "compile", str(model), "-t", "onnxruntime", "-t", "openvino", "--repo", str(tmp_path / "repo"),
        "--name", "m", "--no-benchmark", "--cache-dir", str(tmp_path / "cache"), "--json", "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _published(tmp_path: Path, target: str) -> Path:
    (version,) = sorted((tmp_path / "repo").rglob(f"m-{target}/1"))
    return version


def _check_against_eager(tmp_path: Path, reference: Path, outputs: list[str]) -> dict[str, float]:
    """Run the published ONNX and IR on the eager model's input; return max abs error per engine."""
    import onnxruntime as ort
    import openvino as ov

    ref = np.load(reference)
    expected = [ref[f"out{i}"] for i in range(len(outputs))]
    session = ort.InferenceSession(str(_published(tmp_path, "onnxruntime") / "model.onnx"))
    assert [o.name for o in session.get_outputs()] == outputs
    got = session.run(outputs, {session.get_inputs()[0].name: ref["input"]})
    errors = {"onnxruntime": max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=True))}
    compiled = ov.Core().compile_model(
        str(_published(tmp_path, "openvino") / "model.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    result = compiled(ref["input"])
    got = [result[compiled.output(name)] for name in outputs]
    errors["openvino"] = max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=True))
    return errors


def _assert_targets(result: dict[str, Any], routes: dict[str, str], outputs: list[str]) -> None:
    targets = result["targets"]
    for target, route in routes.items():
        t = targets[target]
        assert t["status"] == "succeeded", t
        assert t["route"] == route
        parity = t["parity"]
        assert parity["passed"] and [o["name"] for o in parity["outputs"]] == outputs
        for out in parity["outputs"]:
            assert out["max_abs"] <= 1e-4 and out["cosine"] >= 0.9999, out


# --------------------------------------------------------------------------- compile


def test_pdmodel_cnn_reaches_openvino_directly_and_onnxruntime_through_paddle2onnx(
    models: Path, tmp_path: Path
) -> None:
    src = tmp_path / "cnn"
    # model.pdiparams.info is a pickle paddle.jit.save writes beside the pair; it is never read.
    shutil.copytree(models / "cnn_pdmodel", src)
    assert (src / "model.pdiparams.info").is_file()
    assert detect_format(src)[0] is Format("paddle")
    result = _compile(src, tmp_path)
    outputs = [o["name"] for o in result["targets"]["openvino"]["parity"]["outputs"]]
    assert outputs == ["linear_0.tmp_1"]  # the predictor's name; the ONNX outputs are renamed to it
    _assert_targets(
        result,
        {"onnxruntime": "paddle → onnx → optimize ⇒ onnxruntime", "openvino": "paddle → openvino_ir ⇒ openvino"},
        outputs,
    )
    errors = _check_against_eager(tmp_path, models / "cnn_pdmodel.npz", outputs)
    assert max(errors.values()) <= 1e-4, errors


def test_pir_cnn_zip_compiles_through_onnx_for_both_engines(models: Path, tmp_path: Path) -> None:
    archive = _archive(models / "cnn_pir", tmp_path / "cnn.zip")
    assert detect_format(archive)[0] is Format("paddle_pir")
    result = _compile(archive, tmp_path)
    outputs = ["fetch_name_0"]
    _assert_targets(
        result,
        {
            "onnxruntime": "paddle_pir → onnx → optimize ⇒ onnxruntime",
            "openvino": "paddle_pir → onnx → optimize → openvino_ir ⇒ openvino",
        },
        outputs,
    )
    errors = _check_against_eager(tmp_path, models / "cnn_pir.npz", outputs)
    assert max(errors.values()) <= 1e-4, errors


def test_pir_transformer_block_tar_keeps_both_outputs_and_dynamic_axes(models: Path, tmp_path: Path) -> None:
    archive = _archive(models / "block_pir", tmp_path / "block.tar.gz")
    result = _compile(archive, tmp_path)
    outputs = ["fetch_name_0", "fetch_name_1"]
    _assert_targets(
        result,
        {
            "onnxruntime": "paddle_pir → onnx → optimize ⇒ onnxruntime",
            "openvino": "paddle_pir → onnx → optimize → openvino_ir ⇒ openvino",
        },
        outputs,
    )
    # Batch and sequence stay open: the eager input is [2, 7, 16]; Kiln validated on other shapes.
    errors = _check_against_eager(tmp_path, models / "block_pir.npz", outputs)
    assert max(errors.values()) <= 1e-4, errors
    manifest = json.loads((_published(tmp_path, "onnxruntime") / "kiln-manifest.json").read_text())
    assert manifest["source"]["format"] == "paddle_pir"
    assert [(s["step"], s["engine"]) for s in manifest["steps"][:2]] == [
        ("reference", "paddle"),
        ("paddle-pir-to-onnx", "paddle"),
    ]
    for dist in ("paddlepaddle", "paddle2onnx"):
        assert manifest["tool_versions"][dist] == metadata.version(dist)


# --------------------------------------------------------------------------- refusals


def _copy(models: Path, name: str, dest: Path) -> Path:
    shutil.copytree(models / name, dest)
    (dest / "model.pdiparams.info").unlink(missing_ok=True)
    return dest


@pytest.mark.parametrize(
    ("damage", "code", "needle"),
    [
        ("truncate-params", "SOURCE_UNREADABLE", "model.pdiparams is not a readable Paddle parameters file"),
        ("truncate-json", "SOURCE_UNREADABLE", "not a readable Paddle PIR JSON program"),
        ("truncate-pdmodel", "SOURCE_UNREADABLE", "not a readable Paddle ProgramDesc"),
        ("foreign-params", "SOURCE_UNREADABLE", "holds 16 tensors but model.json declares 10"),
        ("unsafe-op", "UNSAFE_INPUT", "save_combine"),
        # An allowlist, not a denylist: an operator nobody reviewed, and an unknown PIR dialect, are refused.
        ("unlisted-pir-op", "UNSAFE_INPUT", "pd_op.read_file"),
        ("unknown-dialect", "UNSAFE_INPUT", "7.relu"),
        ("unlisted-pdmodel-op", "UNSAFE_INPUT", "'save'"),
        ("no-params", "SOURCE_UNREADABLE", ""),
    ],
)
def test_malformed_paddle_models_are_refused_before_paddle_reads_them(
    models: Path, tmp_path: Path, damage: str, code: str, needle: str
) -> None:
    legacy = damage in ("truncate-pdmodel", "unlisted-pdmodel-op")
    src = _copy(models, "cnn_pdmodel" if legacy else "cnn_pir", tmp_path / "m")
    program = src / ("model.pdmodel" if legacy else "model.json")
    params = src / "model.pdiparams"
    if damage == "truncate-params":
        params.write_bytes(params.read_bytes()[: params.stat().st_size - 100])
    elif damage.startswith("truncate-"):
        program.write_bytes(program.read_bytes()[: program.stat().st_size // 2])
    elif damage == "foreign-params":
        shutil.copyfile(models / "block_pir" / "model.pdiparams", params)
    elif damage == "unsafe-op":
        program.write_text(program.read_text().replace('"1.relu"', '"1.save_combine"', 1))
    elif damage == "unlisted-pir-op":
        program.write_text(program.read_text().replace('"1.relu"', '"1.read_file"', 1))
    elif damage == "unknown-dialect":
        program.write_text(program.read_text().replace('"1.relu"', '"7.relu"', 1))
    elif damage == "unlisted-pdmodel-op":  # same length: the protobuf stays well formed
        program.write_bytes(program.read_bytes().replace(b"relu", b"save"))
    elif damage == "no-params":
        params.unlink()
    error = SourceUnreadable if code == "SOURCE_UNREADABLE" else UnsafeInput
    with pytest.raises(error) as info:
        if damage == "no-params":
            open_source(program, tmp_path / "work")
        else:
            vet_paddle_model(program)
    assert needle in info.value.message and info.value.hint
    if damage in ("truncate-params", "unsafe-op"):  # and the command line says so, exit 2, no traceback
        proc = _kiln("compile", str(src), "-t", "onnxruntime", "--repo", str(tmp_path / "repo"), cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert code in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


_RUN_STAGED = r"""
import json, sys
import numpy as np
from pathlib import Path
from services.runners.paddle import PaddleRunner

runner = PaddleRunner(Path(sys.argv[1]))
ref = np.load(sys.argv[2])
out = runner.run({"x": ref["input"]})["fetch_name_0"]
print(json.dumps({
    "staged": sorted(p.name for p in runner.model.program.parent.iterdir()),
    "max_abs": float(np.abs(out - ref["out0"]).max()),
    "inputs": [t.to_dict() for t in runner.inputs],
    "outputs": [t.to_dict() for t in runner.outputs],
}))
runner.close()
"""


def test_a_pickled_params_info_beside_the_model_is_never_unpickled(models: Path, tmp_path: Path) -> None:
    """``model.pdiparams.info`` is a pickle: the runner stages only the program and parameters."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    src = _copy(models, "cnn_pir", tmp_path / "m")
    (src / "model.pdiparams.info").write_bytes(pickle.dumps(Payload()))
    # In a child: Paddle's OpenMP runtime stays out of the test process, which holds torch's.
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_STAGED, str(src / "model.json"), str(models / "cnn_pir.npz")],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
        env={**os.environ, "GLOG_minloglevel": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["staged"] == ["model.json", "model.pdiparams"]
    assert report["max_abs"] <= 1e-5
    assert report["inputs"] == [{"name": "x", "dtype": "float32", "shape": [None, 3, 16, 16]}]
    assert report["outputs"] == [{"name": "fetch_name_0", "dtype": "float32", "shape": [None, 10]}]
    assert not marker.exists()


def test_a_paddle_zip_under_models_is_not_taken_for_torch_export(models: Path, tmp_path: Path) -> None:
    archive = tmp_path / "m.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("model.json", "model.pdiparams"):
            zf.write(models / "cnn_pir" / name, f"models/{name}")
    assert detect_format(archive)[0] is Format("paddle_pir")
    assert open_source(archive, tmp_path / "work").path.name == "model.json"


def test_a_lone_program_file_says_to_upload_the_pair(models: Path) -> None:
    for name in ("cnn_pir/model.json", "cnn_pdmodel/model.pdmodel"):
        with pytest.raises(SourceUnreadable) as info:
            detect_format(models / name)
        assert "pdiparams" in info.value.hint


def test_post_compile_accepts_a_paddle_archive_and_refuses_a_truncated_one(models: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from services.settings import Settings
    from workers.app import create_celery_app

    settings = Settings(
        cache_dir=tmp_path / "cache",
        data_dir=tmp_path / "data",
        repository=str(tmp_path / "repo"),
        artifact_store=str(tmp_path / "store"),
        broker_url=redis_url(14),
    )
    spec = json.dumps({"targets": ["onnxruntime", "openvino"], "wait_for_workers": True})
    good = _archive(models / "cnn_pir", tmp_path / "cnn.zip").read_bytes()
    bad_src = _copy(models, "cnn_pir", tmp_path / "bad")
    (bad_src / "model.pdiparams").write_bytes((bad_src / "model.pdiparams").read_bytes()[:-7])
    bad = _archive(bad_src, tmp_path / "bad.tar.gz").read_bytes()
    with TestClient(create_app(settings, create_celery_app(settings))) as client:
        r = client.post("/compile", files={"model": ("cnn.zip", good), "spec": (None, spec, "application/json")})
        assert r.status_code == 202, r.text
        job = client.get(f"/jobs/{r.json()['id']}").json()
        assert job["source"]["format"] == "paddle_pir"
        assert job["steps"][0]["id"] == "reference" and job["steps"][0]["queue"] == "kiln.paddle"
        r = client.post("/compile", files={"model": ("bad.tar.gz", bad), "spec": (None, spec, "application/json")})
        assert r.status_code == 400 and r.json()["code"] == "SOURCE_UNREADABLE" and r.json()["hint"], r.text


# --------------------------------------------------------------------------- runner contract


def test_runner_contract_in_a_process_of_its_own() -> None:
    # The Paddle runner's contract classes (tests/contract_paddle.py) need Paddle in the test
    # process, and one pytest process cannot hold Paddle beside the other engines: Paddle after
    # TensorFlow is a segfault, MindSpore after Paddle fails to load (oneDNN symbols). So they
    # run in a fresh pytest process here, and this test fails when any of them does.
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(tests.parent), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "contract_paddle.py")],
        env=env,
        cwd=tests.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b8 passed\b", proc.stdout), proc.stdout[-2000:]


def test_every_allowed_operator_is_one_this_paddle_registers() -> None:
    """services/formats/paddle_ops.py is reviewed by hand: each name must still be a Paddle operator."""
    script = (
        "import json, paddle\n"
        "from paddle.base import core\n"
        "print(json.dumps({'legacy': sorted(core.get_all_op_names()), 'pir': sorted(dir(paddle._C_ops))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    known = json.loads(proc.stdout.strip().splitlines()[-1])
    from services.formats.paddle_ops import ALLOWED_PADDLE_OPS, ALLOWED_PIR_OPS

    assert sorted(ALLOWED_PADDLE_OPS - set(known["legacy"])) == []
    control_flow = {"if", "while", "assert", "select_input", "select_output", "feed", "fetch", "data"}
    assert sorted(ALLOWED_PIR_OPS["pd_op"] - set(known["pir"]) - control_flow) == []
    for refused in ("save", "load_combine", "read_file", "py_func", "pylayer", "print", "run_program", "send_v2",
                    "c_allreduce_sum", "all_reduce", "barrier", "tensorrt_engine", "fusion_group", "share_var"):  # fmt: skip
        assert refused not in ALLOWED_PADDLE_OPS and refused not in ALLOWED_PIR_OPS["pd_op"], refused


def test_paddle_after_tensorflow_is_refused_with_a_code_not_a_crash() -> None:
    # Measured: importing paddlepaddle 3.3 after tensorflow 2.21 in one process is a segfault.
    script = (
        "import tensorflow\n"
        "from services.errors import KilnError\n"
        "from services.runners.paddle import import_paddle\n"
        "try:\n    import_paddle()\nexcept KilnError as exc:\n    print(exc.code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ENGINE_UNAVAILABLE"
