"""Inputs pinned to one value (issue 19): a PyTorch forward()'s int argument baked into the
artifact, and a tensor input that generated samples fill with the spec's value."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from jobs_support import KILN_CMD
from onnx import TensorProto, helper

from kiln_testing.models import rate_dependent_torchscript
from services.errors import InvalidSpec
from services.pipeline import compile_model
from services.spec import load_spec


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.jit.ScriptModule, Path]:
    path = rate_dependent_torchscript(tmp_path_factory.mktemp("scripted"))
    return torch.jit.load(str(path)), path


def _spec(**inputs: dict) -> dict:
    return {"targets": ["onnxruntime", "openvino"], "name": "rate", "benchmark": False, "inputs": inputs}


def test_an_int_argument_pinned_by_the_spec_is_baked_in(scripted, tmp_path: Path, store, repository, repo_dir) -> None:
    module, path = scripted
    spec = load_spec(_spec(x={"shape": [-1, 8]}, sr={"value": 16000}))
    result = compile_model(path, spec, store=store, repository=repository)
    for target in ("onnxruntime", "openvino"):
        assert result.targets[target].status == "succeeded", result.targets[target].error
    published = next(p for p in (repo_dir / "triton").glob("rate*/1") if (p / "model.onnx").exists())
    graph = onnx.load(str(published / "model.onnx")).graph
    assert [i.name for i in graph.input] == ["x"]  # sr left the signature
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    got = ort.InferenceSession(str(published / "model.onnx")).run(None, {"x": x})[0]
    with torch.no_grad():
        at_16k = module(torch.from_numpy(x), 16000).numpy()
        at_8k = module(torch.from_numpy(x), 8000).numpy()
    np.testing.assert_allclose(got, at_16k, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, at_8k, atol=1e-2)  # the branch for the pinned rate, not the other
    manifest = json.loads((published / "kiln-manifest.json").read_text())
    assert manifest["static_arguments"] == {"sr": 16000}


def test_an_int_argument_without_a_value_is_refused_with_the_way_to_pin_it(scripted, store, repository) -> None:
    _, path = scripted
    result = compile_model(path, load_spec(_spec(x={"shape": [-1, 8]})), store=store, repository=repository)
    error = result.targets["onnxruntime"].error
    assert error["code"] == "INVALID_SPEC" and "sr: int" in error["message"]
    assert "inputs.sr.value" in error["hint"]


def test_a_value_of_the_wrong_type_is_refused(scripted, store, repository) -> None:
    _, path = scripted
    spec = load_spec(_spec(x={"shape": [-1, 8]}, sr={"value": 1.5}))
    error = compile_model(path, spec, store=store, repository=repository).targets["onnxruntime"].error
    assert (
        error["code"] == "INVALID_SPEC" and "1.5" in error["message"] and error["details"]["field"] == "inputs.sr.value"
    )


def test_range_and_value_together_are_refused() -> None:
    with pytest.raises(InvalidSpec, match="range or value"):
        load_spec(_spec(sr={"value": 16000, "range": [0, 1]}))


def test_a_tensor_input_pinned_by_the_spec_is_generated_with_its_value(tmp_path: Path, store, repository) -> None:
    """A 0-d int64 rate used as a scale: random values would exercise nothing real."""
    nodes = [
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "srf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "scale.onnx"))
    spec = load_spec({"targets": ["onnxruntime"], "name": "s", "benchmark": False, "inputs": {"sr": {"value": 16000}}})
    t = compile_model(tmp_path / "scale.onnx", spec, store=store, repository=repository).targets["onnxruntime"]
    assert t.status == "succeeded", t.error
    assert t.parity["input_provenance"]["sr"] == "the spec's value 16000"


def test_kiln_compile_pins_the_argument_from_a_spec_file(scripted, tmp_path: Path) -> None:
    """The same through the `kiln` command as a user runs it: --spec carries the value."""
    _, path = scripted
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"inputs": {"x": {"shape": [-1, 8]}, "sr": {"value": 16000}}}))
    flags = ["-t", "onnxruntime", "--spec", str(spec), "--repo", str(tmp_path / "repo"), "--no-benchmark", "--json"]
    proc = subprocess.run(
        [*KILN_CMD, "compile", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    target = json.loads(proc.stdout)["targets"]["onnxruntime"]
    assert target["status"] == "succeeded" and target["parity"]["passed"]
    assert "sr" not in target["parity"]["input_provenance"] and "x" in target["parity"]["input_provenance"]  # baked in
