"""ONNX's own backend test data through Kiln: per target, what Kiln publishes correctly against what its engine runs alone.

The onnx wheel ships test cases with recorded inputs and outputs (``onnx/backend/test/data``:
``simple``, ``pytorch-converted``, ``pytorch-operator``; the ``node`` cases are generated from
``onnx.backend.test.case`` with ``--node``). For every case this runs:

- each engine alone on the source model (onnxruntime; OpenVINO at f32), compared with the
  recorded outputs;
- ``compile_model`` for onnxruntime and openvino at fp32 with the recorded inputs as the
  calibration file, then the published artifact, run on its engine and compared with the
  recorded outputs independently of Kiln's own parity check.

A case counts as correct when every output matches (``np.allclose``, rtol 1e-3, atol 1e-4,
NaN where NaN). The tally per target: published correct, published wrong (never acceptable),
refused (by error code), against what the engine runs correctly by itself.

    python benchmarks/bench_onnx_backend.py [--kinds simple,pytorch-converted,pytorch-operator] [--node]
        [--only SUBSTRING] [--out results.json]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("simple", "pytorch-converted", "pytorch-operator")
RTOL, ATOL = 1e-3, 1e-4


def _read_pb(path: str) -> Any:
    import onnx
    from onnx import numpy_helper

    for proto_type, to_numpy in (
        (onnx.TensorProto, numpy_helper.to_array),
        (onnx.SequenceProto, numpy_helper.to_list),
        (onnx.OptionalProto, numpy_helper.to_optional),
    ):
        proto = proto_type()
        try:
            proto.ParseFromString(Path(path).read_bytes())
            if proto.ByteSize() or proto_type is onnx.TensorProto:
                return to_numpy(proto)
        except Exception:
            continue
    raise ValueError(f"unreadable {path}")


def cases(kinds: list[str], node: bool, only: str | None) -> list[tuple[str, Path]]:
    import onnx

    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    found = []
    for kind in kinds:
        if not (root / kind).is_dir():
            continue
        for d in sorted((root / kind).iterdir()):
            if (d / "model.onnx").exists():
                found.append((f"{kind}/{d.name}", d))
    if node:
        found += generated_node_cases()
    return [(n, d) for n, d in found if not only or only in n]


def generated_node_cases() -> list[tuple[str, Path]]:
    """Write onnx.backend.test.case's node cases (model + first recorded data set) into a temporary folder."""
    from onnx.backend.test.case.node import collect_testcases

    out = Path(tempfile.mkdtemp(prefix="onnx-node-cases-"))
    found = []
    for case in collect_testcases(None):
        if case.model is None or not case.data_sets:
            continue
        d = out / case.name
        (d / "test_data_set_0").mkdir(parents=True, exist_ok=True)
        (d / "model.onnx").write_bytes(case.model.SerializeToString())
        inputs, outputs = case.data_sets[0]
        try:
            for j, value in enumerate(inputs):
                _write(d / "test_data_set_0" / f"input_{j}.pb", value, case.model.graph.input[j])
            for j, value in enumerate(outputs):
                _write(d / "test_data_set_0" / f"output_{j}.pb", value, case.model.graph.output[j])
        except Exception:  # a value onnx's own helpers cannot write (maps): left out
            continue
        found.append((f"node/{case.name}", d))
    return found


def _write(path: Path, value: Any, info: Any) -> None:
    from onnx import numpy_helper

    if info.type.HasField("sequence_type"):
        proto = numpy_helper.from_list(value, info.name)
    elif info.type.HasField("optional_type"):
        proto = numpy_helper.from_optional(value, info.name)
    elif isinstance(value, onnx_tensor_type()):
        proto = value
    else:
        proto = numpy_helper.from_array(np.asarray(value), info.name)
    path.write_bytes(proto.SerializeToString())


def onnx_tensor_type() -> type:
    import onnx

    return onnx.TensorProto


def _unicode(value: Any) -> Any:
    # ONNX string tensors load as object arrays; an .npz holds them as fixed-width unicode.
    if isinstance(value, np.ndarray) and value.dtype == object and all(isinstance(x, str | bytes) for x in value.flat):
        return np.array([x.decode() if isinstance(x, bytes) else x for x in value.flat]).reshape(value.shape)
    return value


def recorded(case_dir: Path, model: Any) -> tuple[dict[str, Any], list[Any]]:
    data = case_dir / "test_data_set_0"
    ins = [_unicode(_read_pb(p)) for p in sorted(glob.glob(str(data / "input_*.pb")), key=_index)]
    outs = [_read_pb(p) for p in sorted(glob.glob(str(data / "output_*.pb")), key=_index)]
    init = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in init]
    return dict(zip(names, ins, strict=False)), outs


def _index(p: str) -> int:
    return int(Path(p).stem.split("_")[-1])


def matches(got: list[Any], want: list[Any]) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if isinstance(w, list) or isinstance(g, list):
            if not isinstance(g, list) or not isinstance(w, list) or not matches(list(g), list(w)):
                return False
            continue
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False
        if w.dtype.kind in "fc":
            if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=RTOL, atol=ATOL, equal_nan=True):
                return False
        elif not np.array_equal(g, w):
            return False
    return True


def ort_alone(path: Path, feeds: dict[str, Any], want: list[Any]) -> str:
    import onnxruntime as ort

    try:
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = s.run(None, feeds)
    except Exception as exc:
        return f"error: {str(exc).splitlines()[0][:120]}"
    return "correct" if matches(got, want) else "wrong"


def ov_alone(path: Path, feeds: dict[str, Any], want: list[Any]) -> str:
    import openvino as ov

    try:
        core = ov.Core()
        compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        req = compiled.create_infer_request()
        inputs = {}
        for port in compiled.inputs:
            name = next((n for n in port.get_names() if n in feeds), None)
            if name is None:
                return "error: input names not found"
            inputs[port] = feeds[name]
        res = req.infer(inputs)
        got = [np.asarray(res[p]) for p in compiled.outputs]
    except Exception as exc:
        return f"error: {str(exc).strip().splitlines()[0][:120]}"
    return "correct" if matches(got, want) else "wrong"


def through_kiln(path: Path, feeds: dict[str, Any], want: list[Any], root: Path) -> dict[str, str]:
    """Compile for onnxruntime and openvino with the recorded inputs as data; check what was published."""
    from services.formats import Format
    from services.pipeline import compile_model
    from services.repository.local import LocalModelRepository
    from services.runners import open_runner
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    if any(not isinstance(v, np.ndarray) or v.dtype == object for v in feeds.values()):
        calib = None  # sequences, optionals: not in an .npz; Kiln refuses or generates
    else:  # the recorded inputs as one whole feed ('<sample>/<input>'): any shapes, scalars included
        calib = root / "recorded.npz"
        np.savez(calib, **{f"0/{k}": v for k, v in feeds.items()})
    spec: dict[str, Any] = {"targets": ["onnxruntime", "openvino"], "name": "case", "benchmark": False}
    if calib is not None:
        spec["calibration"] = str(calib)
    try:
        result = compile_model(
            path,
            load_spec(spec),
            store=LocalArtifactStore(root / "store"),
            repository=LocalModelRepository(root / "repo"),
        )
    except Exception as exc:  # a refusal before any target (a KilnError) or a crash
        code = getattr(exc, "code", type(exc).__name__)
        return {"onnxruntime": f"refused {code}", "openvino": f"refused {code}"}
    out = {}
    for target, fmt, entry in (
        ("onnxruntime", Format.ONNX, "model.onnx"),
        ("openvino", Format.OPENVINO_IR, "model.xml"),
    ):
        t = result.targets[target]
        if t.status != "succeeded":
            out[target] = f"refused {(t.error or {}).get('code')}: {((t.error or {}).get('message') or '')[:100]}"
            continue
        art = Path(t.published["uri"].removeprefix("file://")) / entry
        try:
            from services.exporters._common import adapt_feed

            runner = open_runner(fmt, art)
            got = runner.run(adapt_feed({k: np.asarray(v) for k, v in feeds.items()}, runner))
            out[target] = "correct" if matches(list(got.values()), want) else "WRONG"
        except Exception as exc:
            out[target] = f"published, unrunnable here: {str(exc)[:100]}"
    return out


def main() -> None:
    import onnx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--node", action="store_true", help="also onnx.backend.test.case's generated node cases")
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--engines-only", action="store_true", help="skip Kiln; only the engines alone")
    args = ap.parse_args()
    rows = []
    for name, d in cases(args.kinds.split(","), args.node, args.only):
        model = onnx.load(str(d / "model.onnx"))
        try:
            feeds, want = recorded(d, model)
        except Exception as exc:
            rows.append({"case": name, "error": f"unreadable data: {exc}"})
            continue
        row: dict[str, Any] = {
            "case": name,
            "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None),
            "ort_alone": ort_alone(d / "model.onnx", feeds, want),
            "ov_alone": ov_alone(d / "model.onnx", feeds, want),
        }
        if not args.engines_only:
            with tempfile.TemporaryDirectory(prefix="kiln-onnx-case-") as tmp:
                row["kiln"] = through_kiln(d / "model.onnx", feeds, want, Path(tmp))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    tally: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        if "error" in r:
            continue
        tally["onnxruntime alone"][r["ort_alone"].split(":")[0]] += 1
        tally["openvino alone"][r["ov_alone"].split(":")[0]] += 1
        for target, v in (r.get("kiln") or {}).items():
            tally[f"kiln -> {target}"][v.split(":")[0]] += 1
    print(f"{len(rows)} cases")
    for k, c in tally.items():
        print(f"{k}: " + ", ".join(f"{n} {v}" for v, n in c.most_common()))


if __name__ == "__main__":
    main()
