"""Kiln's published Triton root in a real Triton Inference Server.

The server is the ``tritonserver`` binary of the nvidia-pytriton wheel (Triton 2.51, Python
backend only), in its own venv built by ``make triton-server`` (tests/triton_server.py). What
runs for real and what does not:

- Config validation: Triton's own. Every ``config.pbtxt`` Kiln publishes passes Triton's
  repository poll (parsing, normalisation and ``ValidateModelConfig``) and its load fails only
  at "unable to find backend library", because NVIDIA's onnxruntime and OpenVINO backend
  libraries are not installable here. Configs broken on purpose fail at the poll, with
  Triton's config error, in the same server: the check can fail.
- Inference: through the real Triton core (model lifecycle, scheduler, dynamic batcher, HTTP
  API) with test-only Python-based STAND-INS for the two backend libraries
  (tests/triton_standins/), which run the published artifacts unchanged on the real
  onnxruntime / OpenVINO runtimes. The numbers are compared with those runtimes run directly.

The tests skip only when the tool venv is missing; ``make test`` builds it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from triton_server import REPO_ROOT, TOOL_VENV, TritonServer, TritonTool, backend_directory, find_triton

from services.repository.triton_config import model_config_pb2

TOOL = find_triton()

needs_triton = pytest.mark.skipif(
    TOOL is None,
    reason=f"the Triton tool venv ({TOOL_VENV}) is missing: run `make triton-server` (`make test` builds it)",
)

#: What Kiln publishes in the fixture below, and the backend each model's config asks for.
BACKENDS = {
    "cnn-onnxruntime": "onnxruntime",
    "cnn-openvino": "openvino",
    "cnn-unbatched": "onnxruntime",
    "cnn-tuned": "onnxruntime",
}
#: What `kiln tune --objective throughput` publishes (services/tune/space.py: triton_serving): the
#: measured instance count, batch and engine settings, through the spec's serving.triton.
TUNED = {"instance_count": 2, "preferred_batch_sizes": [4], "threads": 1, "onnxruntime_optimization": "basic"}


def _tool() -> TritonTool:
    assert TOOL is not None
    return TOOL


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("==") for line in path.read_text().splitlines() if "==" in line and not line.startswith("#"))
    return {name.strip().lower(): version.strip() for name, version in lines}


def test_the_standin_runtimes_are_kilns_versions() -> None:
    """The tool venv runs onnxruntime and OpenVINO at the versions Kiln compiles and checks parity with."""
    kiln, triton = _pins(REPO_ROOT / "constraints.txt"), _pins(REPO_ROOT / "constraints-triton.txt")
    for package in ("onnxruntime", "openvino"):
        assert triton[package] == kiln[package], package
    assert triton["numpy"].startswith("1."), "the Python backend stub is built against numpy 1's ABI"


def _read_config(model_dir: Path) -> Any:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())


@pytest.fixture(scope="module")
def published(cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kiln's ``triton/`` root: the CNN compiled for onnxruntime and openvino, and an unbatched onnxruntime copy."""
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    work = tmp_path_factory.mktemp("triton-published")
    store, repository = LocalArtifactStore(work / "store"), LocalModelRepository(work / "repo")
    specs = [
        # Benchmarked, so the onnxruntime config carries dynamic_batching.preferred_batch_size.
        {"targets": ["onnxruntime", "openvino"], "name": "cnn", "benchmark": {"iterations": 5, "warmup": 1}},
        {"targets": ["onnxruntime"], "name": "cnn-unbatched", "max_batch_size": 0, "benchmark": False},
        {"targets": ["onnxruntime"], "name": "cnn-tuned", "benchmark": False, "serving": {"triton": TUNED}},
    ]
    for spec in specs:
        assert compile_model(cnn_onnx, load_spec(spec), store=store, repository=repository).ok
    root = work / "repo" / "triton"
    assert sorted(p.name for p in root.iterdir()) == sorted(BACKENDS)
    batched = _read_config(root / "cnn-onnxruntime")
    assert batched.max_batch_size == 8 and list(batched.dynamic_batching.preferred_batch_size)
    assert _read_config(root / "cnn-unbatched").max_batch_size == 0
    assert _read_config(root / "cnn-openvino").max_batch_size == 0
    return root


def _variant(src: Path, dest_root: Path, name: str, mutate: Callable[[Any], None]) -> None:
    """Copy a published model under ``name`` with its config changed by ``mutate``."""
    shutil.copytree(src, dest_root / name)
    cfg = _read_config(dest_root / name)
    cfg.name = name
    mutate(cfg)
    (dest_root / name / "config.pbtxt").write_text(text_format.MessageToString(cfg))


def _bad_preferred(cfg: Any) -> None:
    cfg.dynamic_batching.preferred_batch_size.append(cfg.max_batch_size * 2)


def _bad_openvino_batching(cfg: Any) -> None:  # max_batch_size set, a preferred size above it
    cfg.max_batch_size = 4
    cfg.dynamic_batching.preferred_batch_size.append(8)


def _bad_dim(cfg: Any) -> None:
    cfg.input[0].dims[0] = 0


def _bad_reshape(cfg: Any) -> None:
    cfg.output[0].reshape.shape.extend([3])  # 3 elements for an output of 10


def _bad_name(cfg: Any) -> None:
    cfg.name = "not-the-directory"


#: name -> (published model it is copied from, the change, Triton's config error for it).
BROKEN: dict[str, tuple[str, Callable[[Any], None], str]] = {
    "broken-preferred": (
        "cnn-onnxruntime",
        _bad_preferred,
        "dynamic batching preferred size must be <= max batch size for broken-preferred",
    ),
    "broken-openvino-batching": (
        "cnn-openvino",
        _bad_openvino_batching,
        "dynamic batching preferred size must be <= max batch size for broken-openvino-batching",
    ),
    "broken-dim": (
        "cnn-onnxruntime",
        _bad_dim,
        "model input 'input' dimension must be integer >= 1, or -1 to indicate a variable-size dimension"
        " for broken-dim",
    ),
    "broken-reshape": (
        "cnn-onnxruntime",
        _bad_reshape,
        "model output 'output' has different size for dims and reshape for broken-reshape",
    ),
    "broken-name": (
        "cnn-onnxruntime",
        _bad_name,
        "unexpected directory name 'broken-name' for model 'not-the-directory', directory name must equal model name",
    ),
}


@needs_triton
def test_triton_accepts_kilns_configs_and_lacks_only_the_backend_libraries(published: Path, tmp_path: Path) -> None:
    """Kiln's configs pass Triton's validation; the same server rejects broken ones with a config error."""
    root = tmp_path / "root"
    shutil.copytree(published, root)
    for name, (source, mutate, _) in BROKEN.items():
        _variant(published / source, root, name, mutate)
    # The Python backend only, as the wheel ships it: no onnxruntime or openvino backend.
    backends = backend_directory(_tool(), tmp_path / "backends")
    with TritonServer(_tool(), root, backends, tmp_path) as server:
        for name, backend in BACKENDS.items():
            response = server.load(name)
            missing = f"unable to find backend library for backend '{backend}'"
            assert response.status_code == 400 and missing in response.json()["error"], response.text
            assert server.poll_failure(name) is None, server.poll_failure(name)
            entry = server.index()[name]
            assert entry["state"] == "UNAVAILABLE" and entry["reason"].startswith(f"Invalid argument: {missing}")
        for name, (_, _, error) in BROKEN.items():
            response = server.load(name)
            assert response.status_code != 200 and "failed to poll from model repository" in response.text
            assert server.poll_failure(name) == error, server.log()[-3000:]
            assert "state" not in server.index()[name]  # never got as far as a backend


@pytest.fixture(scope="module")
def standin_server(published: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Triton on Kiln's published root, unchanged, with the stand-in backends; every model loaded."""
    missing = _tool().missing_stub_libraries()
    assert not missing, (
        f"the Python backend stub cannot start, missing {missing} (Debian: apt-get install libpython3.11)"
    )
    work = tmp_path_factory.mktemp("triton-standins")
    backends = backend_directory(_tool(), work / "backends", standins=("onnxruntime", "openvino"))
    with TritonServer(_tool(), published, backends, work) as server:
        for name in BACKENDS:
            response = server.load(name)
            assert response.status_code == 200, f"{name}: {response.text}\n{server.log()[-3000:]}"
        yield server


def _ort(published: Path, name: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(published / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["output"], {"input": x})[0])


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@needs_triton
def test_triton_serves_kilns_onnxruntime_model_through_a_standin_backend(
    published: Path, standin_server: TritonServer
) -> None:
    server = standin_server
    assert {n: server.index()[n]["state"] for n in BACKENDS} == dict.fromkeys(BACKENDS, "READY")
    assert "kiln stand-in onnxruntime backend" in server.log()  # the stand-in answered, nothing else
    # Triton's own view of Kiln's config: batching as published, the platform mapped to the backend.
    kiln = _read_config(published / "cnn-onnxruntime")
    held = server.config("cnn-onnxruntime")
    assert (held["platform"], held["backend"], held["runtime"]) == ("onnxruntime_onnx", "onnxruntime", "model.py")
    assert held["max_batch_size"] == kiln.max_batch_size == 8
    assert held["dynamic_batching"]["preferred_batch_size"] == list(kiln.dynamic_batching.preferred_batch_size)

    rng = np.random.default_rng(0)
    for batch in (1, 3, 8):
        x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        _close(server.infer("cnn-onnxruntime", {"input": x})["output"], _ort(published, "cnn-onnxruntime", x))
    # Above max_batch_size: Triton's core refuses it, from Kiln's config.
    over = server.infer_raw("cnn-onnxruntime", {"input": np.zeros((9, 3, 32, 32), np.float32)})
    assert over.status_code == 400 and "batch-size must be <= 8" in over.json()["error"], over.text
    # Concurrent requests go through the dynamic batcher (merged or not); each gets its own rows.
    xs = [rng.standard_normal((2, 3, 32, 32), dtype=np.float32) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: server.infer("cnn-onnxruntime", {"input": x})["output"], xs))
    for x, got in zip(xs, outs, strict=True):
        _close(got, _ort(published, "cnn-onnxruntime", x))
    # max_batch_size 0: dims hold the model's open batch axis; any batch goes through as one request.
    assert server.config("cnn-unbatched")["max_batch_size"] == 0
    x = rng.standard_normal((2, 3, 32, 32), dtype=np.float32)
    _close(server.infer("cnn-unbatched", {"input": x})["output"], _ort(published, "cnn-unbatched", x))


@needs_triton
def test_triton_serves_kilns_openvino_model_through_a_standin_backend(
    published: Path, standin_server: TritonServer
) -> None:
    import openvino as ov

    server = standin_server
    assert "kiln stand-in openvino backend" in server.log()
    held = server.config("cnn-openvino")
    assert (held["backend"], held["runtime"], held["max_batch_size"]) == ("openvino", "model.py", 0)
    compiled = ov.Core().compile_model(
        str(published / "cnn-openvino" / "1" / "model.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    rng = np.random.default_rng(1)
    for batch in (1, 2):
        x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        got = server.infer("cnn-openvino", {"input": x})["output"]
        _close(got, np.asarray(compiled({"input": x})[compiled.output("output")]))
        # The same numbers as the onnxruntime artifact, within Kiln's fp32 parity tolerance.
        np.testing.assert_allclose(got, _ort(published, "cnn-onnxruntime", x), rtol=1e-4, atol=1e-4)


@needs_triton
def test_standin_backend_refuses_a_config_that_disagrees_with_the_model(published: Path, tmp_path: Path) -> None:
    """The stand-ins check the config against the artifact as the real backends do: a wrong shape fails the load."""
    root = tmp_path / "root"
    root.mkdir()
    _variant(published / "cnn-onnxruntime", root, "wrong-shape", lambda c: c.input[0].dims.__setitem__(2, 31))
    _variant(published / "cnn-openvino", root, "wrong-name", lambda c: setattr(c.output[0], "name", "logits"))
    backends = backend_directory(_tool(), tmp_path / "backends", standins=("onnxruntime", "openvino"))
    with TritonServer(_tool(), root, backends, tmp_path) as server:
        shape = server.load("wrong-shape")
        assert shape.status_code == 400, shape.text
        assert "input 'input' has shape [-1, 3, 32, 31] in the config" in shape.json()["error"]
        assert server.poll_failure("wrong-shape") is None  # Triton's own validation passed it
        name = server.load("wrong-name")
        assert name.status_code == 400 and "configured output 'logits' is not in the IR" in name.json()["error"]


@needs_triton
def test_triton_loads_and_serves_a_tuned_config(published: Path, standin_server: TritonServer) -> None:
    """The tuned instance count, preferred batch and onnxruntime parameters pass Triton's validation, as held."""
    server = standin_server
    kiln = _read_config(published / "cnn-tuned")
    assert [g.count for g in kiln.instance_group] == [2] and kiln.optimization.graph.level == -1
    held = server.config("cnn-tuned")
    assert [(g["count"], g["kind"]) for g in held["instance_group"]] == [(2, "KIND_CPU")]
    assert held["dynamic_batching"]["preferred_batch_size"] == [4] and held["max_batch_size"] == 8
    assert held["optimization"]["graph"]["level"] == -1
    assert held["parameters"]["intra_op_thread_count"]["string_value"] == "1"
    x = np.random.default_rng(2).standard_normal((4, 3, 32, 32), dtype=np.float32)
    _close(server.infer("cnn-tuned", {"input": x})["output"], _ort(published, "cnn-tuned", x))
