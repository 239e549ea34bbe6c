"""The optimiser never changes results: ONNX's own backend test data, before and after.

Every case of the backend test data that ships with the onnx package (the generated node
cases plus the simple, pytorch-converted and pytorch-operator models) is run in
onnxruntime with its recorded inputs and compared with its recorded outputs, using the
onnx backend runner's tolerances (rtol 1e-3, atol 1e-7 unless the case says otherwise).
Each case that passes is optimised with Kiln's default pipeline (no safety net: the passes
themselves are under test) and must still pass.
"""

from __future__ import annotations

import glob
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from services.passes import optimize_model

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator")


@dataclass
class Case:
    kind: str
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float
    atol: float


@dataclass
class Tally:
    total: int = 0
    loaded: int = 0
    passing_before: int = 0
    passing_after: int = 0
    changed: int = 0  # cases where the optimiser removed or rewrote nodes
    regressions: list[str] = field(default_factory=list)
    by_kind: Counter = field(default_factory=Counter)
    #: pass name -> cases in which it removed nodes, among cases passing before
    shrunk_by: Counter = field(default_factory=Counter)


def _load_pb(path: str, type_proto: onnx.TypeProto) -> Any:
    with open(path, "rb") as f:
        raw = f.read()
    if type_proto.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(raw)
        return numpy_helper.to_list(seq)
    if type_proto.HasField("tensor_type"):
        tensor = onnx.TensorProto()
        tensor.ParseFromString(raw)
        return numpy_helper.to_array(tensor)
    raise ValueError("map/optional/sparse data files are not supported by this harness")


def _disk_cases(kind: str) -> list[Any]:
    from onnx.backend.test.loader import load_model_tests

    return load_model_tests(kind=kind)


def _load_case(tc: Any, kind: str) -> Case:
    """Read a TestCase's model and its (inputs, outputs) data sets."""
    if tc.model is not None:
        return Case(kind, tc.name, tc.model, [(list(i), list(o)) for i, o in tc.data_sets], tc.rtol, tc.atol)
    model = onnx.load(os.path.join(tc.model_dir, "model.onnx"))
    sets = []
    for d in sorted(glob.glob(os.path.join(tc.model_dir, "test_data_set*"))):
        n_in = len(glob.glob(os.path.join(d, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(d, "output_*.pb")))
        ins = [_load_pb(os.path.join(d, f"input_{i}.pb"), model.graph.input[i].type) for i in range(n_in)]
        outs = [_load_pb(os.path.join(d, f"output_{i}.pb"), model.graph.output[i].type) for i in range(n_out)]
        sets.append((ins, outs))
    return Case(kind, tc.name, model, sets, tc.rtol, tc.atol)


def _session(model: onnx.ModelProto) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    # One thread: these graphs are tiny, and thread-pool start-up would dominate each case.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    # ORT's own graph rewrites off: the comparison is about Kiln's rewrites.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _similar(expected: Any, actual: Any, rtol: float, atol: float) -> bool:
    """The onnx backend runner's comparison (assert_similar_outputs), as a predicate."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return False
        return all(_similar(e, a, rtol, atol) for e, a in zip(expected, actual, strict=True))
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if expected.dtype == object:
        return bool(np.array_equal(actual, expected))
    if actual.dtype != expected.dtype:
        return False
    if expected.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)
        actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    try:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


def _passes(model: onnx.ModelProto, case: Case) -> bool:
    """True when onnxruntime loads ``model`` and reproduces every recorded output."""
    try:
        session = _session(model)
        names = [o.name for o in session.get_outputs()]
        graph_inputs = [i.name for i in case.model.graph.input]
        for inputs, outputs in case.data_sets:
            feed = {name: value for name, value in zip(graph_inputs, inputs, strict=False) if value is not None}
            got = session.run(names, feed)
            if len(got) != len(outputs):
                return False
            if not all(_similar(e, a, case.rtol, case.atol) for e, a in zip(outputs, got, strict=True)):
                return False
    except Exception:
        return False
    return True


def _op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def run_conformance() -> tuple[Tally, float]:
    """Run every case before and after optimisation; return the tally and the seconds it took."""
    started = time.perf_counter()
    tally = Tally()
    for kind in KINDS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the node-case generators warn about casts and overflow
            cases = _disk_cases(kind)
        for tc in cases:
            tally.total += 1
            try:
                case = _load_case(tc, kind)
            except Exception:
                continue
            tally.loaded += 1
            if not _passes(case.model, case):
                continue
            tally.passing_before += 1
            tally.by_kind[kind] += 1
            try:
                optimized, report = optimize_model(case.model)
            except Exception as exc:
                tally.regressions.append(f"{kind}/{case.name}: optimiser raised {exc}")
                continue
            if report.nodes_after != report.nodes_before or _op_types(optimized) != _op_types(case.model):
                tally.changed += 1
            tally.shrunk_by.update(r.name for r in report.passes if r.nodes_after < r.nodes_before)
            if _passes(optimized, case):
                tally.passing_after += 1
            else:
                tally.regressions.append(f"{kind}/{case.name}: fails after optimisation")
    return tally, time.perf_counter() - started


def test_optimizer_keeps_every_backend_case_passing() -> None:
    tally, seconds = run_conformance()
    print(
        f"\nONNX backend conformance ({', '.join(KINDS)}): total {tally.total}, loaded {tally.loaded}, "
        f"passing before {tally.passing_before}, passing after {tally.passing_after}, "
        f"changed by the optimiser {tally.changed}, regressions {len(tally.regressions)} "
        f"[{dict(tally.by_kind)}] in {seconds:.0f} s"
    )
    print(f"cases each pass shrank: {dict(tally.shrunk_by.most_common())}")
    for line in tally.regressions:
        print("  REGRESSION", line)
    # Guard against a harness that silently loads nothing.
    assert tally.passing_before > 1000
    assert tally.regressions == []
    assert tally.passing_after == tally.passing_before


if __name__ == "__main__":  # pragma: no cover - `python tests/test_conformance.py` prints the tally
    test_optimizer_keeps_every_backend_case_passing()
