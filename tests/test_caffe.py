"""Caffe sources: detection, vetting, the Caffe -> ONNX converter against OpenCV's independent
Caffe importer, and `kiln compile` / POST /compile end to end.

The nets are written here: a deploy prototxt in text and a caffemodel serialised with Kiln's
own caffe.proto subset, random weights. OpenCV reads both with its own copy of caffe.proto,
so a wrong field number in Kiln's schema shows up as a mismatch, not as agreement.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from engine_contract import RunnerContract
from jobs_support import KILN_CMD

from services.errors import ConversionFailed, SourceUnreadable, UnsafeInput, UnsupportedFormat
from services.formats import Format, detect_format, open_source
from services.formats.caffe import CaffeLimits, caffe_messages, load_caffe_net

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless (the onnxruntime extra) runs Caffe sources")

CNN = """name: "tiny_caffe_cnn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 17 dim: 17 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param { use_global_stats: true } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 group: 2 } }
layer { name: "prelu2" type: "PReLU" bottom: "conv2" top: "conv2" }
layer { name: "sum" type: "Eltwise" bottom: "pool1" bottom: "conv2" top: "sum"
        eltwise_param { operation: SUM coeff: 0.5 coeff: 2.0 } }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "pool1" top: "cat" }
layer { name: "pool2" type: "Pooling" bottom: "cat" top: "pool2" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "lrn" type: "LRN" bottom: "pool2" top: "lrn" lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 } }
layer { name: "drop" type: "Dropout" bottom: "lrn" top: "lrn" dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc" type: "InnerProduct" bottom: "lrn" top: "fc" inner_product_param { num_output: 10 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""
CNN_WEIGHTS = {
    "conv1": [(8, 3, 3, 3), (8,)],
    "bn1": "batchnorm",
    "scale1": [(8,), (8,)],
    "conv2": [(8, 4, 3, 3), (8,)],
    "prelu2": [(8,)],
    "fc": [(10, 16 * 5 * 5), (10,)],
}

# The other layer kinds: transposed and dilated convolution, global and padded pooling with a
# ceil overhang, slices, reshapes, flatten, scale/bias from axis, products and maxima, activations.
ZOO = """name: "layer_zoo"
input: "x"
input_shape { dim: 1 dim: 4 dim: 10 dim: 10 }
layer { name: "deconv" type: "Deconvolution" bottom: "x" top: "deconv"
        convolution_param { num_output: 6 kernel_size: 4 stride: 2 pad: 1 } }
layer { name: "dil" type: "Convolution" bottom: "deconv" top: "dil"
        convolution_param { num_output: 6 kernel_size: 3 dilation: 2 pad: 2 bias_term: false } }
layer { name: "tanh" type: "TanH" bottom: "dil" top: "tanh" }
layer { name: "elu" type: "ELU" bottom: "deconv" top: "elu" elu_param { alpha: 0.7 } }
layer { name: "prod" type: "Eltwise" bottom: "tanh" bottom: "elu" bottom: "deconv" top: "prod"
        eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "prod" bottom: "tanh" top: "max" eltwise_param { operation: MAX } }
layer { name: "slice" type: "Slice" bottom: "max" top: "s1" top: "s2" slice_param { axis: 1 slice_point: 2 } }
layer { name: "abs" type: "AbsVal" bottom: "s1" top: "abs" }
layer { name: "pow" type: "Power" bottom: "abs" top: "pow" power_param { power: 2 scale: 0.5 shift: 1 } }
layer { name: "leaky" type: "ReLU" bottom: "s2" top: "leaky" relu_param { negative_slope: 0.1 } }
layer { name: "bias" type: "Scale" bottom: "leaky" top: "biased" scale_param { bias_term: true } }
layer { name: "avg" type: "Pooling" bottom: "biased" top: "avg" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "maxp" type: "Pooling" bottom: "pow" top: "maxp" pooling_param { pool: MAX kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 } }
layer { name: "gap" type: "Pooling" bottom: "avg" top: "gap" pooling_param { pool: AVE global_pooling: true } }
layer { name: "flat" type: "Flatten" bottom: "maxp" top: "flat" }
layer { name: "sig" type: "Sigmoid" bottom: "flat" top: "sig" }
layer { name: "reshape" type: "Reshape" bottom: "avg" top: "reshaped" reshape_param { shape { dim: 0 dim: -1 dim: 11 } } }
layer { name: "fc3" type: "InnerProduct" bottom: "reshaped" top: "fc3" inner_product_param { num_output: 3 axis: 2 } }
"""
ZOO_WEIGHTS = {
    "deconv": [(4, 6, 4, 4), (6,)],
    "dil": [(6, 6, 3, 3)],
    "bias": [(4,), (4,)],
    "fc3": [(3, 11), (3,)],
}


def write_caffe_model(root: Path, prototxt: str, weights: dict, seed: int = 0) -> Path:
    """Write deploy.prototxt and weights.caffemodel (random blobs of the given shapes) into ``root``."""
    from google.protobuf import text_format

    rng = np.random.default_rng(seed)
    net = caffe_messages()["NetParameter"]()
    text_format.Parse(prototxt, net)

    def blob(layer, arr: np.ndarray) -> None:
        b = layer.blobs.add()
        b.shape.dim.extend(arr.shape)
        b.data.extend(arr.astype(np.float32).ravel().tolist())

    for layer in net.layer:
        spec = weights.get(layer.name)
        if spec == "batchnorm":
            blob(layer, rng.normal(size=8))
            blob(layer, rng.uniform(0.5, 2.0, size=8))
            blob(layer, np.array([2.0]))  # the moving-average scale factor mean and var are divided by
        elif spec:
            for shape in spec:
                blob(layer, rng.normal(size=shape) * 0.5)
    root.mkdir(parents=True, exist_ok=True)
    (root / "deploy.prototxt").write_text(prototxt)
    (root / "weights.caffemodel").write_bytes(net.SerializeToString())
    return root


def zipped(root: Path, dest: Path) -> Path:
    with zipfile.ZipFile(dest, "w") as zf:
        for p in sorted(root.iterdir()):
            zf.write(p, arcname=f"model/{p.name}")
    return dest


@pytest.fixture(scope="module")
def caffe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("caffe")


@pytest.fixture(scope="module")
def cnn(caffe_dir: Path) -> Path:
    return write_caffe_model(caffe_dir / "cnn", CNN, CNN_WEIGHTS)


@pytest.fixture(scope="module")
def cnn_zip(cnn: Path, caffe_dir: Path) -> Path:
    return zipped(cnn, caffe_dir / "cnn.zip")


# --------------------------------------------------------------------------- the converter vs OpenCV


@pytest.mark.parametrize(("prototxt", "weights"), [(CNN, CNN_WEIGHTS), (ZOO, ZOO_WEIGHTS)], ids=["cnn", "layer-zoo"])
def test_converter_matches_opencv_reference(prototxt: str, weights: dict, tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    from services.converters.caffe_to_onnx import caffe_net_to_onnx
    from services.runners.caffe import CaffeRunner

    root = write_caffe_model(tmp_path / "m", prototxt, weights, seed=3)
    model = caffe_net_to_onnx(load_caffe_net(root))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = CaffeRunner(root)
    assert [o.name for o in session.get_outputs()] == [o.name for o in reference.outputs]
    (inp,) = reference.inputs
    x = np.random.default_rng(1).normal(size=(3, *inp.shape[1:])).astype(np.float32)  # batch 3: the axis is open
    ours = dict(zip([o.name for o in session.get_outputs()], session.run(None, {inp.name: x}), strict=True))
    theirs = reference.run({inp.name: x})
    for name, expected in theirs.items():
        assert ours[name].shape == expected.shape, name
        np.testing.assert_allclose(ours[name], expected, atol=2e-5, rtol=1e-4, err_msg=name)
    if prototxt is ZOO:
        assert set(theirs) == {"gap", "sig", "fc3"}  # every branch's last blob, none swallowed
        assert theirs["fc3"].shape == (3, 44, 3)


# --------------------------------------------------------------------------- kiln compile, end to end


def test_kiln_compile_caffe_archive_to_onnxruntime_and_openvino(cnn_zip: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    env = {**os.environ, "COLUMNS": "200"}
    args = ["compile", str(cnn_zip), "-t", "onnxruntime", "-t", "openvino", "--repo", str(repo), "--name", "caffe-cnn"]
    proc = subprocess.run(
        [*KILN_CMD, *args, "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "caffe → onnx → optimize ⇒ onnxruntime" in proc.stdout
    for target, artifact in (("onnxruntime", "model.onnx"), ("openvino", "model.xml")):
        version = repo / "triton" / f"caffe-cnn-{target}" / "1"
        assert (version / artifact).is_file()
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        assert manifest["source"]["format"] == "caffe"
        assert manifest["route"][0] == "caffe-to-onnx" or "caffe" in json.dumps(manifest["route"])
        parity = manifest["parity"]
        assert parity["passed"] and parity["samples"] >= 4
        (prob,) = parity["outputs"]
        assert prob["name"] == "prob" and prob["max_abs"] < 1e-5 and prob["top1"] == 1.0
        assert "opencv-python-headless" in json.dumps(manifest["tool_versions"]) or target == "openvino"


def test_compile_from_a_directory_and_a_tarball(cnn: Path, tmp_path: Path, store, repository, repo_dir) -> None:
    from services.pipeline.local import compile_model
    from services.spec import load_spec

    tarball = tmp_path / "cnn.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(cnn, arcname="cnn")
    spec = {"targets": ["onnxruntime"], "name": "c", "benchmark": False, "validation": {"samples": 4}}
    for source in (cnn, tarball):
        result = compile_model(source, load_spec(spec), store=store, repository=repository)
        target = result.targets["onnxruntime"]
        assert target.status == "succeeded", target.error
        assert target.parity["outputs"][0]["max_abs"] < 1e-5
    signature = result.steps["reference"].meta["signature"]
    assert signature["inputs"] == [{"name": "data", "dtype": "float32", "shape": [None, 3, 17, 17]}]
    assert signature["outputs"] == [{"name": "prob", "dtype": "float32", "shape": [None, 10]}]


SIMPLE = """name: "simple_caffe_cnn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 12 dim: 12 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "relu" }
layer { name: "pool" type: "Pooling" bottom: "relu" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_caffe_reaches_mnn_natively_and_falls_back_through_onnx(
    cnn: Path, precision: str, tmp_path: Path, store, repository
) -> None:
    # MNNConvert -f CAFFE reads the deploy prototxt and caffemodel themselves: no ONNX step.
    pytest.importorskip("MNN", reason="the mnn extra runs the mnn target")
    from services.pipeline.local import compile_model
    from services.spec import load_spec

    simple = write_caffe_model(tmp_path / "simple", SIMPLE, {"conv": [(4, 3, 3, 3), (4,)], "fc": [(5, 100), (5,)]})
    spec = {"targets": ["mnn"], "precision": precision, "benchmark": False, "validation": {"samples": 4}}
    tol = 1e-5 if precision == "fp32" else 3e-3
    result = compile_model(simple, load_spec({**spec, "name": "s"}), store=store, repository=repository)
    target = result.targets["mnn"]
    assert target.status == "succeeded", target.error
    assert target.route == "caffe ⇒ mnn" and "caffe-to-onnx" not in result.steps
    assert target.parity["outputs"][0]["max_abs"] < tol, target.parity
    # The test CNN (in-place BatchNorm/Scale, PReLU, weighted Eltwise, LRN...) converts but MNN
    # cannot run it natively (its forward fails): the job still succeeds through ONNX, saying so.
    result = compile_model(cnn, load_spec({**spec, "name": "c"}), store=store, repository=repository)
    target = result.targets["mnn"]
    assert target.status == "succeeded", target.error
    assert target.route == "caffe → onnx → optimize ⇒ mnn"
    assert [(a["route"], a["status"]) for a in target.attempts] == [
        ("caffe ⇒ mnn", "failed"),
        ("caffe → onnx → optimize ⇒ mnn", "succeeded"),
    ]
    assert "MNN's forward gave 0 of the model's 1 outputs" in target.attempts[0]["message"]
    assert target.parity["outputs"][0]["max_abs"] < tol, target.parity


def test_an_unconvertible_layer_is_conversion_failed_naming_it(tmp_path: Path, store, repository) -> None:
    from services.pipeline.local import compile_model
    from services.spec import load_spec

    proto = CNN.replace('type: "LRN"', 'type: "MVN"').replace(
        "lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 }", ""
    )
    root = write_caffe_model(tmp_path / "mvn", proto, CNN_WEIGHTS)
    spec = load_spec({"targets": ["onnxruntime"], "name": "c", "benchmark": False, "validation": {"samples": 4}})
    result = compile_model(root, spec, store=store, repository=repository)
    error = result.targets["onnxruntime"].error
    assert error is not None and error["code"] == "CONVERSION_FAILED"
    assert "MVN" in error["message"] and "InnerProduct" in error["hint"]


# --------------------------------------------------------------------------- detection


def test_detection_from_content(cnn: Path, cnn_zip: Path, tmp_path: Path) -> None:
    assert detect_format(cnn)[0] is Format.CAFFE
    assert detect_format(cnn_zip) == (Format.CAFFE, "archive holding a Caffe net (deploy.prototxt, weights.caffemodel)")
    tarball = tmp_path / "m.tgz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(cnn, arcname="m")
    assert detect_format(tarball)[0] is Format.CAFFE
    # A zoo directory also holding train_val and solver files: the deploy net is the one read.
    zoo = tmp_path / "zoo"
    write_caffe_model(zoo, CNN, CNN_WEIGHTS)
    (zoo / "train_val.prototxt").write_text('name: "t"\nlayer { name: "d" type: "Data" top: "data" }\n')
    assert load_caffe_net(zoo).prototxt.name == "deploy.prototxt"
    # Either half alone is refused with what to upload instead.
    for half in ("weights.caffemodel", "deploy.prototxt"):
        lone = tmp_path / half
        lone.write_bytes((cnn / half).read_bytes())
        with pytest.raises(UnsupportedFormat) as exc:
            detect_format(lone)
        assert "half of a Caffe model" in exc.value.message and ".zip or .tar.gz" in exc.value.hint


# --------------------------------------------------------------------------- vetting


def test_a_python_layer_is_unsafe_input_before_any_framework_reads_it(cnn: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proto = CNN + (
        'layer { name: "evil" type: "Python" bottom: "prob" top: "evil"\n'
        f'        python_param {{ module: "os" layer: "system" param_str: "touch {marker}" }} }}\n'
    )
    root = write_caffe_model(tmp_path / "py", proto, CNN_WEIGHTS)
    with pytest.raises(UnsafeInput) as exc:
        open_source(zipped(root, tmp_path / "py.zip"), tmp_path / "work")
    assert "Python layer" in exc.value.message and "'os'" in exc.value.message
    with pytest.raises(UnsafeInput):
        load_caffe_net(root)
    # In every phase: a TRAIN-only Python layer is code too (it used to pass, being outside TEST).
    train_only = CNN + (
        'layer { name: "evil" type: "Python" bottom: "prob" top: "evil" include { phase: TRAIN }\n'
        f'        python_param {{ module: "os" layer: "system" param_str: "touch {marker}" }} }}\n'
    )
    root = write_caffe_model(tmp_path / "train", train_only, CNN_WEIGHTS)
    with pytest.raises(UnsafeInput, match="Python layer"):
        open_source(zipped(root, tmp_path / "train.zip"), tmp_path / "work-train")
    assert not marker.exists()


def _net_bytes(prototxt: str) -> bytes:
    from google.protobuf import text_format

    net = caffe_messages()["NetParameter"]()
    text_format.Parse(prototxt, net)
    return net.SerializeToString()


def test_malformed_and_oversized_files_are_refused_with_stable_codes(cnn: Path, tmp_path: Path) -> None:
    def variant(name: str, prototxt: str | None = None, caffemodel: bytes | None = None) -> Path:
        root = tmp_path / name
        root.mkdir()
        (root / "deploy.prototxt").write_text(
            prototxt if prototxt is not None else (cnn / "deploy.prototxt").read_text()
        )
        (root / "w.caffemodel").write_bytes(
            caffemodel if caffemodel is not None else (cnn / "weights.caffemodel").read_bytes()
        )
        return root

    weights = (cnn / "weights.caffemodel").read_bytes()
    cases = [
        (
            variant("truncated", caffemodel=weights[: len(weights) // 2]),
            SourceUnreadable,
            "not a binary caffe.NetParameter",
        ),
        (variant("garbage", caffemodel=b"\xff" * 64), SourceUnreadable, "not a binary caffe.NetParameter"),
        (variant("badtext", prototxt="layer { name: ]"), SourceUnreadable, "protobuf text format"),
        (
            variant("train", prototxt='layer { name: "d" type: "Data" top: "data" }\n'),
            UnsupportedFormat,
            "training net",
        ),
        (
            variant("noinput", prototxt='layer { name: "r" type: "ReLU" bottom: "a" top: "a" }\n'),
            SourceUnreadable,
            "no input",
        ),
        (variant("v1", prototxt='layers { name: "c" }\n'), UnsupportedFormat, "V1"),
    ]
    # A blob whose data does not match its declared shape (a crafted count).
    bad_blob = _net_bytes(
        'layer { name: "conv1" type: "Convolution" blobs { shape { dim: 8 dim: 3 dim: 3 dim: 3 } data: 1 data: 2 } }'
    )
    cases.append((variant("badblob", caffemodel=bad_blob), SourceUnreadable, "declares shape [8, 3, 3, 3]"))
    for root, error, words in cases:
        with pytest.raises(error) as exc:
            load_caffe_net(root)
        assert words in exc.value.message, (root.name, exc.value.message)
        assert exc.value.hint
    with pytest.raises(UnsafeInput, match="up to 1000 bytes"):
        load_caffe_net(cnn, CaffeLimits(max_caffemodel_bytes=1000))
    with pytest.raises(UnsafeInput, match="more than 100 weights"):
        load_caffe_net(cnn, CaffeLimits(max_weight_elements=100))


def test_conversion_failure_from_the_converter_names_the_layer(cnn: Path, tmp_path: Path) -> None:
    from services.converters.caffe_to_onnx import caffe_net_to_onnx

    proto = CNN.replace("pool: AVE", "pool: STOCHASTIC")
    root = write_caffe_model(tmp_path / "stoch", proto, CNN_WEIGHTS)
    with pytest.raises(ValueError, match=r"pool2.*STOCHASTIC"):
        caffe_net_to_onnx(load_caffe_net(root))
    assert issubclass(ConversionFailed, Exception)


# --------------------------------------------------------------------------- POST /compile


def test_post_compile_accepts_a_caffe_archive_and_refuses_a_python_layer(
    cnn: Path, cnn_zip: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient
    from jobs_support import redis_url

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
    with TestClient(create_app(settings, create_celery_app(settings))) as client:
        r = client.post("/compile", files={"model": ("cnn.zip", cnn_zip.read_bytes()), "spec": (None, spec)})
        assert r.status_code == 202, r.text
        job = client.get(f"/jobs/{r.json()['id']}").json()
        assert job["source"]["format"] == "caffe"
        assert [s["id"] for s in job["steps"]][:2] == ["reference", "caffe-to-onnx"]
        proto = CNN + 'layer { name: "py" type: "Python" bottom: "prob" top: "py" python_param { module: "m" } }\n'
        evil = zipped(write_caffe_model(tmp_path / "evil", proto, CNN_WEIGHTS), tmp_path / "evil.zip")
        buf = io.BytesIO(evil.read_bytes())
        r = client.post("/compile", files={"model": ("evil.zip", buf.getvalue()), "spec": (None, spec)})
        assert r.status_code == 400 and r.json()["code"] == "UNSAFE_INPUT", r.text


# --------------------------------------------------------------------------- the runner contract

CONTRACT = """name: "contract"
input: "x"
input_shape { dim: 3 dim: 4 }
input: "y"
input_shape { dim: 3 dim: 4 }
layer { name: "z_sum" type: "Eltwise" bottom: "x" bottom: "y" top: "z_sum" eltwise_param { operation: SUM } }
layer { name: "a_prod" type: "Eltwise" bottom: "x" bottom: "y" top: "a_prod" eltwise_param { operation: PROD } }
"""


class TestCaffeRunner(RunnerContract):
    """The contract model (z_sum = x + y, a_prod = x * y) as a Caffe deploy net, run by OpenCV."""

    fmt = "caffe"

    @pytest.fixture
    def model(self, tmp_path: Path) -> Path:
        return write_caffe_model(tmp_path / "contract", CONTRACT, {})
