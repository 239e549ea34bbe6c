"""The TensorRT target, tested all around the engine this machine cannot have.

TensorRT's wheels come only from NVIDIA's index, so here: the optimization profiles, the
parser pre-flight, the symmetric Q/DQ int8 model (for real, in onnxruntime), Triton's
config.pbtxt, the queue routing, the timing cache merge, and — driven by a stand-in ``trt``
module — which TensorRT API calls each version path makes. The real build test is present
and skips with its reason; without TensorRT the target must fail ENGINE_UNAVAILABLE.
"""

from __future__ import annotations

import enum
import importlib
import json
import os
import stat
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper

from services.artifacts import Artifact
from services.descriptors.tensorrt import variant_major
from services.errors import HTTP_STATUS, ConversionFailed, EngineUnavailable, InvalidSpec, KilnError, UnsupportedOps
from services.exporters.tensorrt import serving_for
from services.formats import Format
from services.graph import plan_routes
from services.graph.registry import entry_path
from services.repository.publish import publish_version
from services.runners.base import TensorSpec
from services.spec import Precision, load_spec
from services.tensorrt import derive_profile, device, preflight, require_tensorrt_support
from services.tensorrt.builder import BuildOptions, build_plan
from services.tensorrt.onnx_support import parser_support
from services.tensorrt.qdq import make_qdq_model, zero_points
from services.tensorrt.timing_cache import TimingCacheFile, timing_cache_path
from services.validation import check_parity


def _tensorrt_importable() -> bool:
    try:
        importlib.import_module("tensorrt")
    except Exception:  # ImportError, or OSError when the wheel's libraries are missing
        return False
    return True


HAS_TENSORRT = _tensorrt_importable()
NO_TRT_REASON = "TensorRT is not installable here: wheels only on NVIDIA's index"

# ----------------------------------------------------------------------------- model builders


def _vi(name: str, dims: list[Any], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    opset: int = 17,
    domains: dict[str, int] | None = None,
    functions: list[onnx.FunctionProto] = (),  # type: ignore[assignment]
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions))


def _identity_model(inputs: dict[str, list[Any]]) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in inputs]
    return _model(nodes, [_vi(n, d) for n, d in inputs.items()], [_vi(f"{n}_out", d) for n, d in inputs.items()])


def _spec(**extra: Any):
    return load_spec({"targets": ["tensorrt"], **extra})


# ----------------------------------------------------------------------------- profiles


def test_static_input_profile_is_its_shape() -> None:
    profile = derive_profile(_identity_model({"x": [1, 3, 32, 32]}), _spec(max_batch_size=8))
    p = profile["x"]
    assert p.min == p.opt == p.max == (1, 3, 32, 32)
    assert not p.is_dynamic and profile.dynamic_batch is False
    assert serving_for(profile) == {
        "triton": {"platform": "tensorrt_plan", "instance_kind": "KIND_GPU", "batching": False}
    }


def test_dynamic_batch_defaults(cnn_onnx: Path) -> None:
    model = onnx.load(str(cnn_onnx))
    p = derive_profile(model, _spec(max_batch_size=8))["input"]
    assert (p.min, p.opt, p.max) == ((1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32))
    # Batching off: 1..largest benchmark batch, tuned for 1.
    p = derive_profile(model, _spec(benchmark={"batch_sizes": [1, 4]}))["input"]
    assert (p.min[0], p.opt[0], p.max[0]) == (1, 1, 4)
    p = derive_profile(model, _spec(benchmark=False))["input"]
    assert (p.min[0], p.opt[0], p.max[0]) == (1, 1, 1)
    profile = derive_profile(model, _spec(max_batch_size=8))
    assert profile.dynamic_batch and serving_for(profile)["triton"] == {
        "platform": "tensorrt_plan",
        "instance_kind": "KIND_GPU",
        "max_batch_size": 8,  # the plan's profile bounds Triton's batches
    }


def test_spec_ranges_and_shared_axis_names() -> None:
    model = _identity_model({"ids": ["batch", "seq"], "mask": ["batch", "seq"], "scale": [1]})
    spec = _spec(inputs={"ids": {"min": [1, 8], "opt": [2, 64], "max": [4, 128]}}, benchmark={"batch_sizes": [1, 4]})
    profile = derive_profile(model, spec)
    assert profile["ids"].to_dict() == {"min": [1, 8], "opt": [2, 64], "max": [4, 128]}
    assert profile["mask"].to_dict() == profile["ids"].to_dict()  # inherited through "batch" and "seq"
    assert profile["scale"].to_dict() == {"min": [1], "opt": [1], "max": [1]}
    # `shape` fixes the axes it gives as numbers; -1 leaves the batch axis to its default.
    fixed = derive_profile(model, _spec(inputs={"ids": {"shape": [-1, 32]}}, max_batch_size=2))
    assert fixed["mask"].to_dict() == {"min": [1, 32], "opt": [1, 32], "max": [2, 32]}


def test_missing_dynamic_axis_names_input_and_axis() -> None:
    model = _identity_model({"tokens": ["batch", "seq"]})
    with pytest.raises(InvalidSpec) as exc:
        derive_profile(model, _spec(max_batch_size=8))
    err = exc.value
    assert err.code == "INVALID_SPEC"
    assert "tokens axis 1 ('seq')" in err.message
    assert err.details["missing"] == [{"input": "tokens", "axis": 1, "name": "seq"}]
    suggested = json.loads(err.hint[err.hint.index("{") : err.hint.rindex("}") + 1])
    assert suggested == {"inputs": {"tokens": {"min": [1, 1], "opt": [4, 16], "max": [8, 64]}}}
    # The suggestion is itself a valid spec that resolves the profile.
    assert derive_profile(model, _spec(max_batch_size=8, **suggested))["tokens"].max == (8, 64)


@pytest.mark.parametrize(
    ("inputs", "extra", "needle"),
    [
        ({"x": [1, 3, 32, 32]}, {"inputs": {"x": {"shape": [1, 3, 64, 64]}}}, "axis 2 is fixed at 32"),
        ({"x": ["n", 3]}, {"inputs": {"y": {"shape": [1, 3]}}}, "not inputs of the model"),
        ({"x": ["n", 3]}, {"inputs": {"x": {"shape": [1, 3, 3]}}}, "rank 3"),
        (
            {"a": ["n", 4], "b": ["n", 4]},
            {
                "inputs": {
                    "a": {"min": [1, 4], "opt": [2, 4], "max": [4, 4]},
                    "b": {"min": [1, 4], "opt": [1, 4], "max": [2, 4]},
                }
            },
            "axis 'n' is 1..4",
        ),
        (
            {"x": ["n", 3]},
            {"inputs": {"x": {"min": [1, 3], "opt": [1, 3], "max": [2, 3]}}, "max_batch_size": 4},
            "at most 2",
        ),
    ],
)
def test_profile_errors(inputs: dict[str, list[Any]], extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidSpec) as exc:
        derive_profile(_identity_model(inputs), _spec(**extra))
    assert needle in exc.value.message


# ----------------------------------------------------------------------------- pre-flight


def _unsupported_ops_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Unique", ["r"], ["u"]),
        helper.make_node("DFT", ["x"], ["d"]),
        helper.make_node("FusedConv", ["x", "w"], ["f1"], domain="com.microsoft", activation="Relu"),
        helper.make_node("FusedConv", ["f1", "w"], ["f2"], domain="com.microsoft", activation="Relu"),
        helper.make_node("TRT_Attention", ["x", "x", "x"], ["att"], domain="trt"),
    ]
    outs = [_vi(n, None) for n in ("u", "d", "f2", "att")]
    return _model(nodes, [_vi("x", [1, 2, 4, 4])], outs, initializers=[w], domains={"com.microsoft": 1, "trt": 1})


def test_supported_models_pass(cnn_onnx: Path, transformer_onnx: Path) -> None:
    for path in (cnn_onnx, transformer_onnx):
        for major in (10, 11):
            report = require_tensorrt_support(path, tensorrt_major=major)
            assert report.ok and report.ops == {} and report.restrictions == [] and report.dtypes == []
            assert report.nodes == len(onnx.load(str(path)).graph.node)
            assert report.opset == 17


def test_unsupported_ops_are_listed_per_version() -> None:
    model = _unsupported_ops_model()
    with pytest.raises(UnsupportedOps) as exc:
        require_tensorrt_support(model, tensorrt_major=10)
    err = exc.value
    assert err.code == "UNSUPPORTED_OPS" and HTTP_STATUS[err.code] == 422
    assert err.details["ops"] == {"DFT": 1, "Unique": 1, "com.microsoft::FusedConv": 2, "trt::TRT_Attention": 1}
    assert err.details["tensorrt"] == "10.15"
    assert "Unique ×1" in err.message and "com.microsoft::FusedConv ×2" in err.message
    assert err.to_dict()["details"]["ops"] == err.details["ops"]  # what the API and CLI print
    # 11.x imports DFT (cuFFT plugin, 11.2) and its own trt-domain ops.
    assert preflight(model, tensorrt_major=11).ops == {"Unique": 1, "com.microsoft::FusedConv": 2}


def test_subgraphs_and_local_functions_are_walked() -> None:
    then_g = helper.make_graph([helper.make_node("Unique", ["x"], ["t"])], "then", [], [_vi("t", None)])
    body = helper.make_graph(
        [
            helper.make_node("BitShift", ["v", "v"], ["v2"], direction="LEFT"),
            helper.make_node("Identity", ["c"], ["c2"]),
        ],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("c", [], TensorProto.BOOL), _vi("v", [2], TensorProto.INT32)],
        [_vi("c2", [], TensorProto.BOOL), _vi("v2", [2], TensorProto.INT32)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Loop", ["", "cond"], ["e"], body=body)], "else", [], [_vi("e", [2], TensorProto.INT32)]
    )
    func = helper.make_function(
        "custom", "MyDet", ["a"], ["b"], [helper.make_node("Det", ["a"], ["b"])], [helper.make_opsetid("", 17)]
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("MyDet", ["m"], ["det"], domain="custom"),
    ]
    model = _model(
        nodes,
        [_vi("cond", [], TensorProto.BOOL), _vi("x", [4]), _vi("m", [2, 3, 3])],
        [_vi("y", None), _vi("det", [2])],
        domains={"custom": 1},
        functions=[func],
    )
    report = preflight(model, tensorrt_major=10)
    assert report.ops == {"BitShift": 1, "Det": 1, "Unique": 1}  # MyDet itself is inlined, not reported
    assert report.nodes == 7  # If, Unique, Loop, BitShift, Identity, MyDet, Det


def test_restrictions_dtypes_and_opset() -> None:
    zp = numpy_helper.from_array(np.array(3, np.int8), "zp")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "scale")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["rs"], name="resize", mode="cubic"),
        helper.make_node("MaxPool", ["x"], ["p", "idx"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="quant"),
        helper.make_node("TopK", ["flat", "k"], ["vals", "ind"], name="topk", sorted=0),
        helper.make_node("Identity", ["text"], ["text_out"], name="strings"),
        helper.make_node("Cast", ["x"], ["x16"], name="to_int16", to=TensorProto.INT16),
        helper.make_node("Cast", ["x"], ["x8"], name="to_uint8", to=TensorProto.UINT8),
        helper.make_node("Cast", ["x8"], ["back"], name="from_uint8", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x"], ["xd"], name="to_double", to=TensorProto.DOUBLE),
    ]
    model = _model(
        nodes,
        [_vi("x", [1, 1, 4, 4]), _vi("flat", [1, 8]), _vi("text", [1], TensorProto.STRING)],
        [
            *[_vi(n, None) for n in ("rs", "p", "vals", "back")],
            _vi("idx", None, TensorProto.INT64),
            _vi("q", None, TensorProto.INT8),
            _vi("text_out", None, TensorProto.STRING),
            _vi("x16", None, TensorProto.INT16),
            _vi("xd", None, TensorProto.DOUBLE),
        ],
        initializers=[zp, scale, scales, k],
    )
    report = preflight(model, tensorrt_major=10)
    assert report.ops == {}
    got = {(r["op"], r["node"]): r["problem"] for r in report.restrictions}
    assert set(got) == {("Resize", "resize"), ("MaxPool", "pool"), ("QuantizeLinear", "quant"), ("TopK", "topk")}
    assert "'cubic'" in got[("Resize", "resize")]
    assert "Indices" in got[("MaxPool", "pool")]
    assert "must be zero" in got[("QuantizeLinear", "quant")]
    assert got[("TopK", "topk")] == "`sorted` must be 1"
    bad_types = {d["tensor"]: d["dtype"] for d in report.dtypes}
    assert {"text": "STRING", "x16": "INT16", "x8": "UINT8"}.items() <= bad_types.items()
    assert "x" not in bad_types and "back" not in bad_types
    assert any("DOUBLE" in w for w in report.warnings)  # cast down by the parser: a warning, not a failure
    old = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [1])], [_vi("y", [1])], opset=8)
    assert preflight(old, tensorrt_major=11).restrictions == [
        {"op": "opset", "node": "", "problem": "opset 8 is outside TensorRT 11.5's range 9-25"}
    ]


def test_parser_tables_pin_known_rows() -> None:
    t10, t11 = parser_support(10), parser_support(11)
    assert {"Conv", "LayerNormalization", "Attention", "NonZero", "RotaryEmbedding"} <= t10.supported
    assert {"Unique", "DFT", "QLinearConv"} <= t10.listed_unsupported and not t10.supported & t10.listed_unsupported
    assert "Swish" in t11.supported - t10.supported and "DFT" in t11.supported
    assert (t10.opset_max, t11.opset_max) == (24, 25)
    with pytest.raises(KeyError, match=r"10\.x, 11\.x"):
        parser_support(9)


# ----------------------------------------------------------------------------- Q/DQ int8


@pytest.mark.parametrize("fixture", ["cnn_onnx", "transformer_onnx"])
def test_qdq_model_is_symmetric_and_close(fixture: str, request, tmp_path: Path) -> None:
    import onnxruntime as ort

    src: Path = request.getfixturevalue(fixture)
    shape = [1, 3, 32, 32] if fixture == "cnn_onnx" else [1, 16, 32]
    rng = np.random.default_rng(3)
    feeds = [{"input": rng.standard_normal(shape).astype(np.float32)} for _ in range(8)]
    dst = tmp_path / "qdq.onnx"
    settings = make_qdq_model(src, dst, feeds, tmp_path / "work")
    assert settings["samples"] == 8 and "per channel" in settings["weights"]

    model = onnx.load(str(dst))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > ops.count("QuantizeLinear")
    zps = zero_points(dst)
    assert zps and all(z.dtype == np.int8 and not z.any() for z in zps.values())  # TensorRT wants zero point 0
    inits = {i.name: i.data_type for i in model.graph.initializer}
    dq_inputs = [n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert dq_inputs and all(inits[name] == TensorProto.INT8 for name in dq_inputs)  # no INT32 bias
    for major in (10, 11):
        assert preflight(dst, tensorrt_major=major).ok

    fp32 = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    int8 = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    expected = [dict(zip(["output"], fp32.run(None, f), strict=True)) for f in feeds]
    actual = [dict(zip(["output"], int8.run(None, f), strict=True)) for f in feeds]
    report = check_parity(actual, expected, _spec(precision="int8").tolerances_for(Precision.INT8), inputs_from="test")
    assert report.passed, report.failures
    assert report.outputs[0].cosine > 0.99


def test_onnxruntime_default_int8_fails_tensorrt_preflight(cnn_onnx: Path, tmp_path: Path) -> None:
    """The onnxruntime target's asymmetric uint8 model with int32 biases is what TensorRT refuses."""
    from services.exporters.onnxruntime import quantize_int8

    feeds = [{"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)]
    quantize_int8(cnn_onnx, tmp_path / "ort.onnx", feeds, tmp_path)
    report = preflight(tmp_path / "ort.onnx", tensorrt_major=11)
    problems = " | ".join(r["problem"] for r in report.restrictions)
    assert "quantizing to UINT8 is not supported" in problems
    assert "dequantizing INT32 is not supported" in problems and "keep biases in float" in problems
    assert not report.ok


# ----------------------------------------------------------------------------- Triton config


@pytest.mark.parametrize(
    ("max_batch", "dims", "expected_batch"), [(8, ["batch", 3, 32, 32], 8), (8, [1, 3, 32, 32], 0)]
)
def test_triton_config_for_tensorrt_plan(
    max_batch: int, dims: list[Any], expected_batch: int, tmp_path: Path, repository, repo_dir: Path
) -> None:
    """publish_version writes config.pbtxt from what export_tensorrt returns.

    The payload file is placeholder bytes, not an engine: only the config is under test here.
    """
    from tritonclient.grpc import model_config_pb2

    profile = derive_profile(_identity_model({"input": dims}), _spec(max_batch_size=max_batch))
    shape = tuple(None if isinstance(d, str) else d for d in dims)
    root = tmp_path / "export"
    root.mkdir()
    (root / "model.plan").write_bytes(b"placeholder, not a TensorRT engine")
    artifact = Artifact(
        root=root,
        kind=Format.TENSORRT_PLAN.value,
        entry="model.plan",
        meta={
            "target": "tensorrt",
            "format": Format.TENSORRT_PLAN.value,
            "io": {
                "inputs": [TensorSpec("input", "float32", shape).to_dict()],
                "outputs": [TensorSpec("logits", "float32", (shape[0], 10)).to_dict()],
            },
            "serving": serving_for(profile),
        },
    )
    # Unset in the spec, the engine's profile bounds Triton's batch (never above what the plan takes).
    publish_version(repository, artifact, name="m", version=None, manifest={}, max_batch_size=None)
    cfg = text_format.Parse((repo_dir / "triton" / "m" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.platform == "tensorrt_plan"
    assert cfg.max_batch_size == expected_batch
    assert [g.kind for g in cfg.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert list(cfg.input[0].dims) == ([3, 32, 32] if expected_batch else [1, 3, 32, 32])
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32 and cfg.output[0].name == "logits"
    assert (repo_dir / "triton" / "m" / "1" / "model.plan").exists()


# ----------------------------------------------------------------------------- queue routing


@pytest.mark.parametrize(("variant", "major"), [("cu12", 10), ("cu13", 11)])
def test_queue_routing_per_variant(variant: str, major: int) -> None:
    plan = plan_routes(Format.ONNX, _spec(tensorrt_variant=variant))
    queues = {s.id: s.queue for s in plan.steps}
    assert queues == {
        "reference": "kiln.onnxruntime",
        "optimize": "kiln.onnxruntime",
        "export:tensorrt": f"kiln.tensorrt-{variant}",
        "publish:tensorrt": f"kiln.tensorrt-{variant}",
    }
    assert plan.step("export:tensorrt").entry == "export:tensorrt"
    assert entry_path(plan.step("export:tensorrt").entry) == "services.exporters.tensorrt:export_tensorrt"
    assert plan.step("export:tensorrt").format_out == "tensorrt_plan"
    assert variant_major(variant) == major
    keras = plan_routes(Format.KERAS, _spec(tensorrt_variant=variant))
    assert {s.id: s.queue for s in keras.steps}["keras-to-onnx"] == "kiln.tensorflow"
    assert keras.step("export:tensorrt").queue == f"kiln.tensorrt-{variant}"


# ----------------------------------------------------------------------------- builder paths (stand-in trt)


class _FakeCache:
    """Timing cache stand-in: a set of entries serialized as sorted lines."""

    def __init__(self, data: bytes = b"") -> None:
        self.entries = set(filter(None, bytes(data).decode().split("\n")))

    def serialize(self) -> bytes:
        return "\n".join(sorted(self.entries)).encode()

    def combine(self, other: _FakeCache, ignore_mismatch: bool) -> bool:
        self.entries |= other.entries
        return True


def fake_tensorrt(version: str, calls: list[tuple[Any, ...]], *, parse_ok: bool = True) -> types.ModuleType:
    """A stand-in ``tensorrt`` module that records the API calls a build makes.

    It exists only to provoke each version path of build_plan and see which calls it makes
    (flags, profiles, workspace, timing cache). It proves nothing about TensorRT itself.
    """
    major = int(version.split(".")[0])
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class Severity(enum.IntEnum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    class ILogger:
        pass

    ILogger.Severity = Severity  # type: ignore[attr-defined]
    trt.ILogger = ILogger
    # TensorRT 11 dropped the precision flags and EXPLICIT_BATCH; a path touching them fails here.
    trt.NetworkDefinitionCreationFlag = enum.IntEnum(
        "NetworkDefinitionCreationFlag",
        {"STRONGLY_TYPED": 1} if major >= 11 else {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1},
    )
    trt.BuilderFlag = enum.IntEnum(
        "BuilderFlag", {"REFIT": 5} if major >= 11 else {"FP16": 0, "BF16": 1, "INT8": 2, "REFIT": 5}
    )
    trt.MemoryPoolType = enum.IntEnum("MemoryPoolType", {"WORKSPACE": 0})

    class Tensor:
        def __init__(self, name: str, shape: tuple[int, ...]) -> None:
            self.name, self.shape, self.is_shape_tensor = name, shape, False

    class Network:
        def __init__(self) -> None:
            self.inputs = [Tensor("input", (-1, 3, 32, 32))]
            self.num_inputs = 1

        def get_input(self, i: int) -> Tensor:
            return self.inputs[i]

    class Profile:
        def set_shape(self, name: str, lo: tuple[int, ...], opt: tuple[int, ...], hi: tuple[int, ...]) -> None:
            calls.append(("set_shape", name, tuple(lo), tuple(opt), tuple(hi)))

    class Config:
        def __init__(self) -> None:
            self.cache: _FakeCache | None = None

        def set_memory_pool_limit(self, pool: Any, size: int) -> None:
            calls.append(("set_memory_pool_limit", pool.name, size))

        def set_flag(self, flag: Any) -> None:
            calls.append(("set_flag", flag.name))

        def add_optimization_profile(self, profile: Profile) -> int:
            calls.append(("add_optimization_profile",))
            return 0

        def create_timing_cache(self, data: bytes) -> _FakeCache:
            calls.append(("create_timing_cache", bytes(data)))
            return _FakeCache(data)

        def set_timing_cache(self, cache: _FakeCache, ignore_mismatch: bool) -> None:
            self.cache = cache

        def get_timing_cache(self) -> _FakeCache | None:
            return self.cache

    class ParserError:
        def desc(self) -> str:
            return "No importer registered for op: Unique"

        def node_name(self) -> str:
            return "unique_0"

        def node_operator(self) -> str:
            return "Unique"

    class OnnxParser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network: Network, logger: ILogger) -> None:
            pass

        def parse_from_file(self, path: str) -> bool:
            calls.append(("parse_from_file", Path(path).name))
            return parse_ok

        def get_error(self, i: int) -> ParserError:
            return ParserError()

    class Builder:
        def __init__(self, logger: ILogger) -> None:
            calls.append(("Builder",))

        def create_network(self, flags: int) -> Network:
            calls.append(("create_network", flags))
            return Network()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            calls.append(("build_serialized_network",))
            assert config.cache is not None
            config.cache.entries.add(f"tactic-{len(config.cache.entries)}")
            return b"stand-in bytes, not an engine"

    trt.Builder, trt.OnnxParser = Builder, OnnxParser
    return trt


def _build(trt: types.ModuleType, tmp_path: Path, precision: Precision, cnn_onnx: Path):
    profile = derive_profile(onnx.load(str(cnn_onnx)), _spec(max_batch_size=8))
    options = BuildOptions(precision=precision, profiles=(profile,), workspace_mb=512, cache_dir=tmp_path / "cache")
    return build_plan(cnn_onnx, tmp_path / "model.plan", options, trt=trt, compute_capability="8.6")


@pytest.mark.parametrize(
    ("version", "precision", "network_bits", "flags"),
    [
        ("10.13.3.9", Precision.FP32, 0, []),
        ("10.13.3.9", Precision.FP16, 0, ["FP16"]),
        ("10.13.3.9", Precision.INT8, 0, ["INT8"]),
        ("11.4.0.106", Precision.FP16, 1 << 1, []),
        ("11.4.0.106", Precision.INT8, 1 << 1, []),
    ],
)
def test_builder_api_calls_per_version(
    version: str, precision: Precision, network_bits: int, flags: list[str], tmp_path: Path, cnn_onnx: Path
) -> None:
    """Which TensorRT calls each version path makes — a stand-in module, not a build."""
    calls: list[tuple[Any, ...]] = []
    report = _build(fake_tensorrt(version, calls), tmp_path, precision, cnn_onnx)
    assert ("create_network", network_bits) in calls
    assert [c[1] for c in calls if c[0] == "set_flag"] == flags
    assert ("set_memory_pool_limit", "WORKSPACE", 512 * 1024 * 1024) in calls
    assert ("set_shape", "input", (1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32)) in calls
    assert calls.count(("add_optimization_profile",)) == 1
    assert ("parse_from_file", "cnn.onnx") in calls
    assert report.tensorrt_version == version and report.compute_capability == "8.6"
    assert report.builder_flags == flags
    assert report.api.startswith(f"TensorRT {version.split('.')[0]}.x")
    assert report.profiles == [{"input": {"min": [1, 3, 32, 32], "opt": [4, 3, 32, 32], "max": [8, 3, 32, 32]}}]
    cache = tmp_path / "cache" / "tensorrt" / f"timing-sm86-trt{version}.cache"
    assert report.timing_cache == {
        "enabled": True,
        "path": str(cache),
        "reused_bytes": 0,
        "stored_bytes": cache.stat().st_size,
    }
    # A second build on the same architecture starts from the stored cache.
    calls.clear()
    again = _build(fake_tensorrt(version, calls), tmp_path, precision, cnn_onnx)
    assert ("create_timing_cache", b"tactic-0") in calls and again.timing_cache["reused_bytes"] == len(b"tactic-0")


def test_builder_refusals(tmp_path: Path, cnn_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    with pytest.raises(ConversionFailed) as exc:
        _build(fake_tensorrt("10.13.3.9", calls, parse_ok=False), tmp_path, Precision.FP32, cnn_onnx)
    assert exc.value.details["errors"] == ["No importer registered for op: Unique (node unique_0, op Unique)"]
    assert ("build_serialized_network",) not in calls
    with pytest.raises(EngineUnavailable, match=r"TensorRT 8\.6\.1 is installed"):
        _build(fake_tensorrt("8.6.1", calls), tmp_path, Precision.FP32, cnn_onnx)
    monkeypatch.setattr(device, "_PROBES", (lambda: None,))
    profile = derive_profile(onnx.load(str(cnn_onnx)), _spec())
    with pytest.raises(EngineUnavailable, match="no CUDA GPU"):
        build_plan(
            cnn_onnx, tmp_path / "p", BuildOptions(Precision.FP32, (profile,), 64), trt=fake_tensorrt("11.0.0", calls)
        )


def test_timing_cache_merges_concurrent_builds(tmp_path: Path) -> None:
    path = timing_cache_path(tmp_path, "9.0", "11.4.0.106")
    assert path == tmp_path / "tensorrt" / "timing-sm90-trt11.4.0.106.cache"
    first, second = TimingCacheFile(path), TimingCacheFile(path)
    loaded_a, loaded_b = first.load(), second.load()  # both builds start before either finishes

    class Config:
        def create_timing_cache(self, data: bytes) -> _FakeCache:
            return _FakeCache(data)

    first.store(Config(), _FakeCache(b"a1\na2"), loaded=loaded_a)
    second.store(Config(), _FakeCache(b"b1"), loaded=loaded_b)
    assert path.read_bytes() == b"a1\na2\nb1"  # the second build merged, it did not overwrite
    assert not list(path.parent.glob("*.tmp"))


def test_compute_capability_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in nvidia-smi on PATH provokes the driver-only probe; the parsing is the real code."""
    assert device.parse_compute_cap("8.6\n8.6\n") == "8.6"
    assert device.parse_compute_cap("12.0\n") == "12.0" and device.parse_compute_cap("[N/A]\n") is None
    assert device.sm_tag("12.0") == "sm120"
    args = tmp_path / "args"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" > {args}\necho 8.9\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert device._from_nvidia_smi() == "8.9"
    assert args.read_text().split() == ["--query-gpu=compute_cap", "--format=csv,noheader", "-i", "2"]


# ----------------------------------------------------------------------------- the target, end to end


def _compile(model: Path, store, repository, precision: str = "fp32", **extra: Any):
    from services.pipeline import compile_model

    spec = load_spec(
        {
            "targets": ["tensorrt"],
            "precision": precision,
            "name": "m",
            "optimize": False,
            "benchmark": {"iterations": 5, "warmup": 1},
            **extra,
        }
    )
    return compile_model(model, spec, store=store, repository=repository)


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here; the real build test covers the target")
def test_target_without_tensorrt_is_engine_unavailable(cnn_onnx: Path, store, repository, repo_dir: Path) -> None:
    result = _compile(cnn_onnx, store, repository, max_batch_size=4)
    target = result.targets["tensorrt"]
    assert target.status == "failed"
    assert target.error["code"] == "ENGINE_UNAVAILABLE"
    assert "pypi.nvidia.com" in target.error["hint"]
    assert target.published is None and not (repo_dir / "triton" / "m").exists()


def test_target_preflight_fails_before_needing_tensorrt(tmp_path: Path, store, repository) -> None:
    det = _model([helper.make_node("Det", ["x"], ["y"])], [_vi("x", [2, 3, 3])], [_vi("y", [2])])
    path = tmp_path / "det.onnx"
    onnx.save(det, str(path))
    target = _compile(path, store, repository).targets["tensorrt"]
    assert target.status == "failed"
    assert target.error["code"] == "UNSUPPORTED_OPS"
    assert target.error["details"]["ops"] == {"Det": 1}
    assert KilnError.from_dict(target.error).code == "UNSUPPORTED_OPS"


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TENSORRT, reason=NO_TRT_REASON)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_real_tensorrt_build(
    precision: str, cnn_onnx: Path, store, repository, repo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real plan on a real GPU: parity, manifest facts, timing cache and Triton config."""
    from tritonclient.grpc import model_config_pb2

    from services.settings import get_settings

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))  # the timing cache stays in the test's dir
    get_settings.cache_clear()
    try:
        result = _compile(cnn_onnx, store, repository, precision, max_batch_size=4)
    finally:
        get_settings.cache_clear()
    target = result.targets["tensorrt"]
    assert target.status == "succeeded", target.error
    assert target.parity["passed"] is True
    manifest = json.loads((repo_dir / "triton" / "m" / "1" / "kiln-manifest.json").read_text())
    details = manifest["engine_details"]
    assert details["tensorrt_version"].split(".")[0] in ("10", "11")
    assert float(details["compute_capability"]) >= 5.0
    assert details["profiles"][0]["input"]["max"] == [4, 3, 32, 32]
    assert Path(details["timing_cache"]["path"]).parent == tmp_path / "cache" / "tensorrt"
    assert Path(details["timing_cache"]["path"]).stat().st_size == details["timing_cache"]["stored_bytes"] > 0
    assert (repo_dir / "triton" / "m" / "1" / "model.plan").stat().st_size > 0
    cfg = text_format.Parse((repo_dir / "triton" / "m" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 4
