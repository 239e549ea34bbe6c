"""keras.applications.MobileNetV2 (weights=None) compiled to every CPU engine at fp16 and int8.

fp32 is covered by tests/test_tflite.py. The network here is the small variant (alpha 0.35,
96x96x3, 10 classes), built once per session with random weights and made to behave like a
trained one where that needs no training: its inputs are image-like (see ``natural_images``)
and every BatchNormalization holds the statistics of the activations it normalises, measured
on a batch of such images, as a trained network's moving statistics would be.

int8 uses an explicit, measured tolerance: see ``INT8_TOLERANCES``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kiln_testing.tf_models import input_name
from services.pipeline import compile_model
from services.repository.publish import read_manifest
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec

SHAPE = (96, 96, 3)
ALPHA = 0.35
CPU_TARGETS = ["onnxruntime", "openvino", "tflite", "tfserving"]
#: Calibration rows in the file; the reference step holds every 4th out for parity (8 here).
CALIBRATION_ROWS = 32

#: This untrained network amplifies small perturbations far beyond what a trained one does:
#: storing its input images as 8-bit pixels (what every photo is; 0.9% relative change)
#: already moves its output to cosine 0.992 (``pixel_rounding`` below), and full-integer int8
#: rounds each of its ~65 activation tensors about as coarsely. Measured over five calibration
#: draws, cosine: onnxruntime 0.957-0.975, openvino 0.962-0.969, tflite 0.961-0.963, with top-1
#: 50%-88% over ten near-tied classes (this draw: 0.961 / 0.962 / 0.961, top-1 >= 62%).
#: Per-channel vs per-tensor weights, ORT's Percentile calibration and NNCF's other range
#: estimators moved these by less than the draw-to-draw spread (see the exporters). The
#: default bounds cannot hold for any engine, so this test states its own.
#: Parity now takes the worst sample and adds centred measures (services/validation/metrics.py).
#: Measured on this model (2026-12-02): 8-bit pixels alone give worst-sample SNR 6.5 dB,
#: Pearson 0.955, scale 0.944, cosine 0.979, top-1 81%; the int8 artifacts give SNR 2.2-3.6 dB,
#: Pearson 0.85-0.87, scale 0.68-0.78, cosine 0.92-0.94 (weight-only tfserving: 10.8 dB, 0.977,
#: 0.941, 0.984, which meets the int8 defaults). The bounds below sit under those numbers; the
#: default int8 bounds are shown to hold on real pretrained models in tests/test_real_models.py.
INT8_TOLERANCES = {
    "min_cosine": 0.9,
    "min_top1": 0.5,
    "min_pearson": 0.8,
    "min_snr_db": 1.0,
    "max_scale_error": 0.4,
}


def natural_images(n: int, seed: int) -> np.ndarray:
    """Return ``n`` random images with a natural image's 1/f amplitude spectrum, scaled to [-1, 1].

    White noise has no spatial structure, so every convolution sees statistics no photo has;
    1/f noise has the smooth regions and edges at every scale that photos have. Each image is
    stretched to [-1, 1], the range keras.applications.mobilenet_v2.preprocess_input gives.
    """
    rng = np.random.default_rng(seed)
    h, w, c = SHAPE
    freq = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :])
    freq[0, 0] = 1.0 / h
    shape = (n, h, w // 2 + 1, c)
    spectrum = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / freq[None, :, :, None]
    images = np.fft.irfft2(spectrum, s=(h, w), axes=(1, 2))
    low = images.min(axis=(1, 2, 3), keepdims=True)
    high = images.max(axis=(1, 2, 3), keepdims=True)
    return (2 * (images - low) / (high - low) - 1).astype(np.float32)


@pytest.fixture(scope="session")
def mobilenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MobileNetV2 alpha 0.35 on 96x96x3, 10 classes, BatchNorm statistics measured on 64 images."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=SHAPE, alpha=ALPHA, classes=10)
    norms = [la for la in model.layers if isinstance(la, keras.layers.BatchNormalization)]
    # One training-mode pass with momentum 0 stores each layer's batch statistics as its moving
    # statistics; layer by layer, so every one sees inputs already normalised by those before it.
    # Freshly initialised (mean 0, variance 1) the activations shrink block by block (measured:
    # std 1e-11 at out_relu) and every image gets the same prediction.
    momentum = [layer.momentum for layer in norms]
    for layer in norms:
        layer.momentum = 0.0
    model(natural_images(64, seed=3), training=True)
    for layer, m in zip(norms, momentum, strict=True):
        layer.momentum = m
    path = tmp_path_factory.mktemp("mobilenet") / "mobilenet_v2_035.keras"
    model.save(path)
    return path


@pytest.fixture(scope="session")
def calibration(mobilenet: Path) -> Path:
    """32 images unlike the BatchNorm batch (another seed), keyed by the model's input name."""
    path = mobilenet.with_name("calibration.npz")
    np.savez(path, **{input_name(mobilenet): natural_images(CALIBRATION_ROWS, seed=7)})
    return path


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory):
    """One artifact store for the module: the fp16 and int8 jobs share the conversions."""
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("mobilenet-store"))


def _spec(precision: str, calibration: Path, **extra):
    return load_spec(
        {
            "targets": CPU_TARGETS,
            "precision": precision,
            "name": "mnv2",
            "benchmark": False,
            "calibration": str(calibration),
            **extra,
        }
    )


def _published(result, target: str) -> Path:
    return Path(result.targets[target].published["uri"].removeprefix("file://"))


#: The file holding each target's weights (tfserving's frozen graph is reported by its exporter).
WEIGHT_FILES = {"onnxruntime": "model.onnx", "openvino": "model.bin", "tflite": "model.tflite"}


def _bytes_per_parameter(result, mobilenet: Path) -> dict[str, float]:
    """Return each target's weight file size over the Keras model's parameter count."""
    import keras

    params = keras.saving.load_model(mobilenet).count_params()
    return {t: (_published(result, t) / f).stat().st_size / params for t, f in WEIGHT_FILES.items()}


def test_fp16_every_cpu_engine(mobilenet: Path, calibration: Path, shared_store, repository) -> None:
    result = compile_model(mobilenet, _spec("fp16", calibration), store=shared_store, repository=repository)
    tol = DEFAULT_TOLERANCES[Precision.FP16]
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        out = target.parity["outputs"][0]
        assert target.parity["samples_per_shape"][0] == CALIBRATION_ROWS // 4
        assert target.parity["inputs_from"] == "calibration"
        assert out["name"] == "predictions" and out["within_allclose"], (name, out)
        assert out["cosine"] >= tol.min_cosine and out["top1"] >= tol.min_top1, (name, out)
        assert 0 < out["max_abs"] < tol.atol, (name, out)  # fp16 weights really changed the numbers
    assert result.plan.routes == {
        "onnxruntime": "keras → onnx → optimize ⇒ onnxruntime",
        "openvino": "keras → savedmodel → openvino_ir ⇒ openvino",
        "tflite": "keras → savedmodel ⇒ tflite",
        "tfserving": "keras → savedmodel ⇒ tfserving",
    }

    # Weights are stored at 2 bytes per parameter (plus the graph, a few percent here).
    for name, size in _bytes_per_parameter(result, mobilenet).items():
        assert 1.8 < size < 2.3, (name, size)
    onnx_model = onnx.load(str(_published(result, "onnxruntime") / "model.onnx"))
    assert onnx.TensorProto.FLOAT16 in {i.data_type for i in onnx_model.graph.initializer}
    assert onnx_model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    details = {t: read_manifest(repository, f"mnv2-{t}", 1)["engine_details"] for t in CPU_TARGETS}
    assert details["openvino"]["fp16"]["compress_to_fp16"] is True
    assert details["tflite"]["tflite"]["mode"] == "float16 weights"
    tfserving = details["tfserving"]["tfserving"]["fp16"]
    assert tfserving["compute"] == "float32"
    assert tfserving["weight_bytes_stored"] == tfserving["weight_bytes_fp32"] // 2


def _pixel_rounding_cosine(mobilenet: Path, reference) -> float:
    """Return the cosine between Keras' outputs on the parity images and on their 8-bit-pixel copies."""
    import keras

    model = keras.saving.load_model(mobilenet)
    images = np.concatenate([next(iter(feed.values())) for feed in reference.inputs])
    pixels = np.round((images + 1) * 127.5) / 127.5 - 1  # 0..255, then preprocess_input's scaling
    a, b = np.asarray(model(images)).ravel(), np.asarray(model(pixels.astype(np.float32))).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_int8_every_cpu_engine(mobilenet: Path, calibration: Path, shared_store, repository) -> None:
    from services.steps.reference import load_reference

    spec = _spec("int8", calibration, tolerances=INT8_TOLERANCES)
    result = compile_model(mobilenet, spec, store=shared_store, repository=repository)
    parity = {}
    for name, target in result.targets.items():
        assert target.status == "succeeded", (name, target.error)
        assert target.parity["samples_per_shape"][0] == CALIBRATION_ROWS // 4
        parity[name] = target.parity["outputs"][0]
        assert parity[name]["cosine"] >= INT8_TOLERANCES["min_cosine"], (name, parity[name])
        assert parity[name]["top1"] >= INT8_TOLERANCES["min_top1"], (name, parity[name])

    # Why the explicit bound: rounding just the input pixels to 8 bits moves this network's output
    # by ~1% cosine (photos are 8-bit to begin with); int8 rounds every activation that coarsely.
    pixel_rounding = _pixel_rounding_cosine(mobilenet, load_reference(result.steps["reference"].artifact))
    assert 0.97 < pixel_rounding < 0.997, pixel_rounding
    # tfserving's int8 is weight-only (float activations): it meets the default int8 bounds.
    default = DEFAULT_TOLERANCES[Precision.INT8]
    assert parity["tfserving"]["cosine"] >= default.min_cosine and parity["tfserving"]["top1"] >= default.min_top1
    assert parity["tfserving"]["pearson"] >= default.min_pearson and parity["tfserving"]["snr_db"] >= default.min_snr_db
    assert abs(parity["tfserving"]["scale"] - 1) <= default.max_scale_error

    # Every artifact really is int8, calibrated on the file's 24 non-parity rows.
    for name, size in _bytes_per_parameter(result, mobilenet).items():
        assert size < 1.6, (name, size)  # 1 byte per weight, plus int32 biases, scales, the graph
    ort_ops = [n.op_type for n in onnx.load(str(_published(result, "onnxruntime") / "model.onnx")).graph.node]
    assert ort_ops.count("QuantizeLinear") > 50 and "Conv" in ort_ops  # QDQ around each conv
    details = {t: read_manifest(repository, f"mnv2-{t}", 1)["engine_details"] for t in CPU_TARGETS}
    assert details["onnxruntime"]["int8"]["samples"] == 24
    assert details["onnxruntime"]["int8"]["calibration_data"] == "calibration file"

    nncf = details["openvino"]["int8"]
    assert nncf["subset_size"] == 24 and nncf["calibration_data"] == "calibration file"
    assert nncf["fake_quantize_ops"] > 50 and nncf["attention_detected"] is False
    # An image model keeps NNCF's own activation range estimator (per-sample mean of min/max).
    assert nncf["activation_ranges"].startswith("NNCF default")

    tflite = details["tflite"]["tflite"]
    assert tflite["mode"] == "full-integer int8" and tflite["calibration_samples"] == 24
    assert tflite["quantized_io"] == {"inputs": [], "outputs": []}  # float32 I/O unless integer_io
    assert tflite["io_contract"] == "float32 inputs and outputs"

    tfserving = details["tfserving"]["tfserving"]["int8"]
    assert tfserving["compute"] == "float32"
    assert tfserving["weight_bytes_stored"] < 0.4 * tfserving["weight_bytes_fp32"]
