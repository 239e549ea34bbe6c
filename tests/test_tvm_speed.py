"""What makes a tvm library fast on the CPU it serves from: its thread pool, fast math, channels last.

TVM's runtime sizes its thread pool at half the logical CPUs on x86; Kiln sizes it at one
thread per physical core (an operator's ``TVM_NUM_THREADS`` wins), before TVM creates it.
exp, erf, tanh and softmax become TVM's vectorisable approximations unless the spec turns
``fast_math`` off; a library that is tuned computes its plain convolutions channels last. Each
is checked on the real compiler and runtime; the tuned end to end path is in test_tvm.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("tvm")

from services.tvm import TvmOptions, build_libraries
from services.tvm._compile import _channels_last, _relax_module
from services.tvm.host import physical_cores

ROOT = Path(__file__).resolve().parent.parent

_POOL = "from services.tvm import import_tvm; tvm = import_tvm(); print(tvm.get_global_func('runtime.NumThreads')())"


def _pool_size(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", _POOL], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1])


def test_thread_pool_has_a_thread_per_physical_core() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    assert _pool_size(env) == physical_cores()
    assert _pool_size({**env, "TVM_NUM_THREADS": "1"}) == 1  # the operator's setting is kept


def _kernel_names(mod) -> set[str]:  # type: ignore[no-untyped-def]
    import tvm
    from tvm import relax

    with tvm.transform.PassContext(opt_level=3):
        legal = relax.transform.LegalizeOps()(mod)
    return {gv.name_hint for gv, f in legal.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.fixture(scope="module")
def block_onnx(transformer_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The transformer block as the pipeline hands it to TVM: optimised (its attention scale folded)."""
    from services.onnx_io import load_onnx, save_onnx
    from services.passes import optimize_model

    model, _ = optimize_model(load_onnx(transformer_onnx))
    path = tmp_path_factory.mktemp("block") / "block.onnx"
    save_onnx(model, path)
    return path


def test_fast_math_replaces_the_transcendental_kernels(block_onnx: Path) -> None:
    model = onnx.load(str(block_onnx))
    fast, _ = _relax_module(model, {"input": [1, 16, 32]}, False, True)
    exact, _ = _relax_module(model, {"input": [1, 16, 32]}, False, False)
    assert {"fast_softmax", "fast_erf"} <= _kernel_names(fast)
    assert {"softmax", "erf"} <= _kernel_names(exact) and not any(n.startswith("fast_") for n in _kernel_names(exact))


def test_fast_math_is_in_the_details_and_within_fp32_tolerance(block_onnx: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    from services.formats import Format
    from services.runners import open_runner

    feed = np.random.default_rng(5).standard_normal((2, 16, 32)).astype(np.float32) * 3
    session = ort.InferenceSession(str(block_onnx), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"input": feed})[0]
    for fast_math in (True, False):
        out = tmp_path / str(fast_math)
        out.mkdir()
        details = build_libraries(
            block_onnx, out, fp16=False, options=TvmOptions(fast_math=fast_math), spec_inputs={},
            scratch=tmp_path / f"scratch-{fast_math}",
        )  # fmt: skip
        assert details["fast_math"] is fast_math and details["threads"] == int(os.environ["TVM_NUM_THREADS"])
        runner = open_runner(Format("tvm_library"), out / "model.so")
        try:
            got = runner.run({"input": feed})["output"]
        finally:
            runner.close()
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def _conv_onnx(path: Path, groups: int) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 4 // groups, 3, 3)).astype(np.float32) * 0.3, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.3, "w2")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["input", "w1"], ["c1"], pads=[1, 1, 1, 1], group=groups),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Conv", ["p1", "w2"], ["output"], pads=[1, 1, 1, 1]),
        ],
        "convs",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 16, 8, 8])],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _conv_layouts(mod) -> list[str]:  # type: ignore[no-untyped-def]
    import tvm
    from tvm import relax

    layouts: list[str] = []

    def visit(expr) -> None:  # type: ignore[no-untyped-def]
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.nn.conv2d":
            layouts.append(f"{expr.attrs.data_layout}/{expr.attrs.kernel_layout}")

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return layouts


def test_tuned_convolutions_compute_channels_last(tmp_path: Path) -> None:
    import onnxruntime as ort
    import tvm
    from tvm import relax

    path = _conv_onnx(tmp_path / "convs.onnx", groups=1)
    base, weights = _relax_module(onnx.load(str(path)), {"input": [1, 4, 16, 16]}, False)
    assert _conv_layouts(base) == ["NCHW/OIHW", "NCHW/OIHW"]
    converted = _channels_last(base, lambda _m: None)
    assert _conv_layouts(converted) == ["NHWC/HWIO", "NHWC/HWIO"]
    # Same inputs, same raw weights, same answer: the weights' transpose runs in main_transform_params.
    vm = relax.VirtualMachine(tvm.compile(converted, target="llvm"), tvm.cpu())
    feed = np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(feed), *vm["main_transform_params"](weights)).numpy()
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": feed})[0]
    assert got.shape == (1, 16, 8, 8)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_grouped_convolutions_keep_nchw(tmp_path: Path) -> None:
    path = _conv_onnx(tmp_path / "grouped.onnx", groups=2)
    base, _ = _relax_module(onnx.load(str(path)), {"input": [1, 4, 16, 16]}, False)
    assert _conv_layouts(_channels_last(base, lambda _m: None)) == ["NCHW/OIHW", "NCHW/OIHW"]


def test_runner_feeds_and_returns_any_layout_by_copy(tmp_path: Path) -> None:
    """The runner hands TVM aligned copies and returns copies: an output that is the input itself
    (Identity) comes back as a new array, and feeds in any layout or byte order are read right."""
    from onnx import TensorProto, helper

    from services.formats import Format
    from services.runners import open_runner

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Not", ["mask"], ["flipped"])],
        "identity",
        [
            helper.make_tensor_value_info("x", TensorProto.INT32, [2, 3]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.INT32, [2, 3]),
            helper.make_tensor_value_info("flipped", TensorProto.BOOL, [2]),
        ],
    )
    path = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "lib"
    out.mkdir()
    build_libraries(path, out, fp16=False, options=TvmOptions(), spec_inputs={}, scratch=tmp_path / "scratch")
    runner = open_runner(Format("tvm_library"), out / "model.so")
    try:
        x = np.arange(12, dtype=">i4").reshape(2, 6)[:, ::2]  # big-endian and strided
        mask = np.array([True, False])
        first = runner.run({"x": x, "mask": mask})
        np.testing.assert_array_equal(first["y"], x)
        np.testing.assert_array_equal(first["flipped"], [False, True])
        first["y"][...] = -1  # the caller owns what it got back
        again = runner.run({"x": x, "mask": mask})
        np.testing.assert_array_equal(again["y"], x)
        assert x[0, 1] == 2 and again["y"].dtype == np.int32
    finally:
        runner.close()
