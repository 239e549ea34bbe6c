"""The modern-architecture matrix's checks and verdicts: each published artifact run by its engine's own runtime.

benchmarks/bench_modern_matrix.py compiles every family of :mod:`kiln_testing.modern_models` to
every engine; this module holds what it does with what Kiln published, none of it Kiln's own
code: :func:`open_artifact` loads a version folder with the engine's own Python API, the way
the artifact's files and manifest tell a user to (onnxruntime's InferenceSession, OpenVINO's
Core at f32, MNN's ``nn`` module with the manifest's runtime settings, ncnn's Net with the
blob map and options of ``model.ncnn.json``, TVM's Relax VM as the version's README shows,
LiteRT's signature runners, TensorFlow's SavedModel signatures). :func:`check_artifact` feeds
it held-out inputs at every length it serves and compares with the source run by transformers
(:func:`kiln_testing.modern_models.source_outputs`). :func:`verdict` names every cell: ok,
wrong (published but disagreeing with the source: always a bug), engine limit (a named reason
in ``ENGINE_LIMITS``) or bug (``KNOWN_BUGS``, or unexplained until named).
tests/test_modern_matrix.py checks the verdicts and the report without compiling anything.
"""

from __future__ import annotations

__all__ = [
    "ENGINE_LIMITS",
    "KNOWN_BUGS",
    "TARGETS",
    "TOLERANCE",
    "LoadedArtifact",
    "check_artifact",
    "markdown",
    "open_artifact",
    "verdict",
]

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln_testing.modern_models import FAMILIES, SCORED, Family, feeds, source_outputs

#: The engines the matrix compiles to, in the order of its columns.
TARGETS: tuple[str, ...] = ("onnxruntime", "openvino", "mnn", "ncnn", "tvm", "tflite", "tfserving")
#: Worst |artifact - source| over the largest |source| an fp32 artifact may reach (a wrong graph is off by O(1)).
TOLERANCE = 1e-3
#: Sequence lengths fed to an artifact whose sequence axis is open (neither is Kiln's example or parity length).
OPEN_LENGTHS = (12, 20)
#: Past length fed to an artifact whose past axis is open.
OPEN_PAST = 5


#: Failures understood as the engine's (or its converter's) limit: (family key or "*", target, code) -> why.
ENGINE_LIMITS: dict[tuple[str, str, str], str] = {}

_ONNX2TF_DEBERTA = (
    "onnx2tf 1.28 cannot convert DeBERTa-v2's disentangled attention: at open axes its graph reshapes with two -1 "
    "axes; pinned at [1, 16] it builds a Keras graph one of whose tensors is a plain array (the constant "
    "relative-position indices of the GatherElements). Not worked around: the ncnn rewrite (a nearest GridSample) "
    "would likely serve, untried (issue 30, item 3)"
)

#: Failures diagnosed as Kiln's bugs, not fixed yet: (family key or "*", target, code) -> what goes wrong.
KNOWN_BUGS: dict[tuple[str, str, str], str] = {
    ("deberta-v2", "tflite", "CONVERSION_FAILED"): _ONNX2TF_DEBERTA,
    ("deberta-v2", "tfserving", "CONVERSION_FAILED"): _ONNX2TF_DEBERTA,
}


@dataclass
class Signature:
    """One callable entry of an artifact: its inputs' shapes (None: open) and a run function."""

    inputs: dict[str, list[int | None]]
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class LoadedArtifact:
    """A published version loaded by its engine's own runtime: one or more signatures."""

    target: str
    signatures: dict[str, Signature] = field(default_factory=dict)
    #: How it was loaded (settings a user would pass), for the report.
    settings: str = ""


def _manifest(version: Path) -> dict[str, Any]:
    return dict(json.loads((version / "kiln-manifest.json").read_text()))


def _open_onnxruntime(version: Path) -> LoadedArtifact:
    import onnxruntime as ort

    session = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    shapes = {i.name: [d if isinstance(d, int) else None for d in i.shape] for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(None, feed), strict=True))

    return LoadedArtifact("onnxruntime", {"": Signature(shapes, run)}, "CPUExecutionProvider")


def _open_openvino(version: Path) -> LoadedArtifact:
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(version / "model.xml"))
    shapes = {
        p.get_any_name(): [d.get_length() if d.is_static else None for d in p.get_partial_shape()] for p in model.inputs
    }
    # What the published OVMS config.json sets (plugin_config); without it this CPU infers in bf16.
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = compiled(feed)
        return {o.get_any_name(): np.asarray(result[o]) for o in compiled.outputs}

    return LoadedArtifact("openvino", {"": Signature(shapes, run)}, "CPU, INFERENCE_PRECISION_HINT f32")


def _open_mnn(version: Path) -> LoadedArtifact:
    import MNN

    runtime = (_manifest(version).get("engine_details") or {}).get("runtime") or {}
    config = {"backend": runtime.get("backend", "CPU"), "precision": runtime.get("precision", "normal")}
    path = str(version / "model.mnn")
    info = MNN.nn.load_module_from_file(path, [], []).get_info()
    manager = MNN.nn.create_runtime_manager((config,))
    module = MNN.nn.load_module_from_file(
        path,
        list(info["inputNames"]),
        list(info["outputNames"]),
        runtime_manager=manager,
        rearrange=bool(runtime.get("rearrange", False)),  # as the version's README says
    )
    names, outputs = list(info["inputNames"]), list(info["outputNames"])
    # An .mnn stores open axes as 1 and resizes to what it is fed: every axis counts as open.
    shapes: dict[str, list[int | None]] = {n: [None] * len(v.shape) for n, v in zip(names, info["inputs"], strict=True)}
    expr = MNN.expr

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = []
        for name, var in zip(names, info["inputs"], strict=True):
            arr = np.ascontiguousarray(feed[name])
            kind = expr.float if arr.dtype.kind == "f" else expr.int
            arr = arr.astype(np.float32 if kind == expr.float else np.int32)
            args.append(expr.const(arr, list(arr.shape), var.data_format, kind))
        values = module.forward(args)
        out = {}
        for name, var in zip(outputs, values, strict=True):
            if var.data_format == expr.NC4HW4:
                var = expr.convert(var, expr.NCHW)
            out[name] = np.array(var.read(), copy=True)
        return out

    return LoadedArtifact("mnn", {"": Signature(shapes, run)}, f"MNN.nn, runtime {runtime} (the manifest's)")


def _open_ncnn(version: Path) -> LoadedArtifact:
    import ncnn

    meta = json.loads((version / "model.ncnn.json").read_text())
    net = ncnn.Net()
    for key, value in meta.get("options", {}).items():
        setattr(net.opt, key, value)
    if net.load_param(str(version / meta["param"])) != 0 or net.load_model(str(version / meta["bin"])) != 0:
        raise RuntimeError("ncnn cannot load the published param/bin")
    shapes = {e["name"]: [1, *e["shape"][1:]] for e in meta["inputs"]}

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        with net.create_extractor() as ex:
            for e in meta["inputs"]:
                # The sidecar's dtype: int32 blobs (token ids) carry their 32 bits, as ncnn's Embed reads them.
                sample = np.ascontiguousarray(np.asarray(feed[e["name"]])[0], dtype=e.get("dtype", "float32"))
                ex.input(e["blob"], ncnn.Mat(sample).clone())
            for e in meta["outputs"]:
                status, mat = ex.extract(e["blob"])
                if status != 0:
                    raise RuntimeError(f"ncnn could not compute {e['blob']}")
                out[e["name"]] = np.array(mat).reshape([1, *e["shape"][1:]])
        return out

    return LoadedArtifact("ncnn", {"": Signature(shapes, run)}, f"ncnn.Net, options {meta.get('options')}")


def _open_tvm(version: Path) -> LoadedArtifact:
    import tvm
    from tvm import relax

    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(version / "model.so")), dev)
    params = tvm.runtime.load_param_dict((version / "params.bin").read_bytes())
    weights = [tvm.runtime.tensor(params[f"p{i}"].numpy(), dev) for i in range(len(params))]
    io = json.loads((version / "io.json").read_text())
    shapes = {t["name"]: list(t["shape"]) for t in io["inputs"]}

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [tvm.runtime.tensor(np.ascontiguousarray(feed[t["name"]], t["dtype"]), dev) for t in io["inputs"]]
        result = vm["main"](*args, *weights)
        values = [result] if hasattr(result, "numpy") else list(result)
        return {t["name"]: v.numpy() for t, v in zip(io["outputs"], values, strict=True)}

    return LoadedArtifact("tvm", {"": Signature(shapes, run)}, "relax.VirtualMachine on tvm.cpu() (the README's)")


def _open_tflite(version: Path) -> LoadedArtifact:
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(str(version / "model.tflite"))
    loaded = LoadedArtifact("tflite", settings="ai_edge_litert Interpreter, signature runners")
    for key in interpreter.get_signature_list():
        runner = interpreter.get_signature_runner(key)
        details = runner.get_input_details()
        shapes = {n: [int(d) if d >= 0 else None for d in v["shape_signature"]] for n, v in details.items()}

        def run(
            feed: dict[str, np.ndarray], runner: Any = runner, details: dict[str, Any] = details
        ) -> dict[str, np.ndarray]:
            args = {n: np.asarray(feed[n]).astype(d["dtype"]) for n, d in details.items()}
            return {k: np.asarray(v) for k, v in runner(**args).items()}

        loaded.signatures[key] = Signature(shapes, run)
    return loaded


def _open_tfserving(version: Path) -> LoadedArtifact:
    import tensorflow as tf

    model = tf.saved_model.load(str(version))
    loaded = LoadedArtifact("tfserving", settings="tf.saved_model.load, signatures")
    for key, fn in model.signatures.items():
        specs = fn.structured_input_signature[1]
        shapes = {n: list(s.shape.as_list()) for n, s in specs.items()}

        def run(feed: dict[str, np.ndarray], fn: Any = fn, specs: dict[str, Any] = specs) -> dict[str, np.ndarray]:
            args = {n: tf.constant(np.asarray(feed[n]).astype(s.dtype.as_numpy_dtype)) for n, s in specs.items()}
            return {k: v.numpy() for k, v in fn(**args).items()}

        loaded.signatures[key] = Signature(shapes, run)
    return loaded


_OPENERS: dict[str, Callable[[Path], LoadedArtifact]] = {
    "onnxruntime": _open_onnxruntime,
    "openvino": _open_openvino,
    "mnn": _open_mnn,
    "ncnn": _open_ncnn,
    "tvm": _open_tvm,
    "tflite": _open_tflite,
    "tfserving": _open_tfserving,
}


def version_folder(repo: Path, target: str) -> Path:
    """Return the one published version folder of ``target`` in a repository (its kiln-manifest.json's folder)."""
    found = [m.parent for m in repo.rglob("kiln-manifest.json") if _manifest(m.parent).get("target") == target]
    if len(found) != 1:
        raise LookupError(f"{len(found)} published versions of {target} in {repo}")
    return found[0]


def open_artifact(target: str, version: Path) -> LoadedArtifact:
    """Load a published version folder with ``target``'s own runtime."""
    return _OPENERS[target](version)


def _key(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def _pair(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return the artifact's outputs under the source's names (exactly, or as a converter spells them)."""
    if len(expected) == 1 and len(got) == 1:
        return {next(iter(expected)): next(iter(got.values()))}
    by_key = {_key(k): v for k, v in got.items()}
    missing = [n for n in expected if _key(n) not in by_key]
    if missing:
        raise LookupError(f"outputs {missing} not among the artifact's {sorted(got)}")
    return {n: by_key[_key(n)] for n in expected}


def _inputs_for(sig: Signature, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return ``feed`` under the signature's input names (exactly, or as a converter spells them)."""
    by_key = {_key(k): v for k, v in feed.items()}
    return {name: by_key[_key(name)] for name in sig.inputs}


def _lengths(fam: Family, shapes: dict[str, list[int | None]]) -> list[tuple[int, int]]:
    """Return the (sequence, past) pairs to feed a signature: its fixed lengths, or the held-out ones where open."""
    if fam.modality == "image":
        return [(0, 0)]
    shapes = {_key(k): v for k, v in shapes.items()}
    ids = shapes.get("input_ids")
    sequences: tuple[int, ...] = OPEN_LENGTHS
    if ids is not None and len(ids) == 2 and ids[1] is not None:
        sequences = (int(ids[1]),)
    past = OPEN_PAST
    key = shapes.get("past_key_values_0_key")
    if key is not None and len(key) == 4 and key[2] is not None:
        past = int(key[2])
    return [(s, past) for s in sequences]


def check_artifact(fam: Family, source: Path, loaded: LoadedArtifact) -> dict[str, Any]:
    """Feed every signature of ``loaded`` held-out inputs at the lengths it serves; compare with transformers.

    Returns ``{"lengths": [...], "max_rel": worst relative error, "ok": bool, "problem": str | None}``.
    """
    worst, served, problem = 0.0, [], None
    for name, sig in loaded.signatures.items():
        for sequence, past in _lengths(fam, sig.inputs):
            feed = feeds(fam, source, sequence=sequence, past=past, seed=sequence + 101)
            want = source_outputs(fam, source, feed)
            try:
                got = _pair(want, sig.run(_inputs_for(sig, feed)))
            except Exception as exc:  # the artifact refused what it says it serves: a finding, not a crash
                problem = f"{name or 'main'} at length {sequence}: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            for out, ref in want.items():
                value = np.asarray(got[out], np.float64)
                if value.size != ref.size:
                    problem = f"{out} at length {sequence}: shape {list(value.shape)}, source {list(ref.shape)}"
                    continue
                value = value.reshape(ref.shape)
                scale = float(np.max(np.abs(ref))) or 1.0
                err = float(np.max(np.abs(value - ref))) / scale
                worst = max(worst, err if np.isfinite(err) else float("inf"))
            if fam.modality == "text":
                served.append(sequence)
    ok = problem is None and worst <= TOLERANCE
    if problem is None and not ok:
        problem = f"max relative error {worst:.2e} > {TOLERANCE:g}"
    return {"lengths": sorted(set(served)), "max_rel": worst, "ok": ok, "problem": problem}


def _lookup(table: dict[tuple[str, str, str], str], fam: str, target: str, code: str | None) -> str | None:
    for (who, tgt, want), why in table.items():
        if who in (fam, "*") and tgt == target and want == code:
            return why
    return None


def verdict(fam: str, target: str, cell: dict[str, Any]) -> tuple[str, str]:
    """Return (ok | wrong | engine limit | bug, why) for one cell.

    A cell is published (``status == "succeeded"``) and checked (``check``), or failed with an
    error ``code``. Published but disagreeing with the source, or not loadable by its own
    runtime, is ``wrong``: a bug whatever the tables say.
    """
    if cell.get("status") == "succeeded":
        check = cell.get("check") or {}
        if check.get("ok"):
            return "ok", ""
        return "wrong", str(check.get("problem") or cell.get("check_error") or "not checked")
    code = cell.get("code")
    limit = _lookup(ENGINE_LIMITS, fam, target, code)
    if limit:
        return "engine limit", limit
    bug = _lookup(KNOWN_BUGS, fam, target, code)
    if bug:
        return "bug", bug
    return "bug", f"unexplained (a bug until named): {cell.get('message', '')}"


def _cell_text(kind: str, cell: dict[str, Any]) -> str:
    if kind == "ok":
        lengths = (cell.get("check") or {}).get("lengths") or []
        if not lengths:
            return "ok"
        opened = all(n in lengths for n in OPEN_LENGTHS)
        return "ok (any length)" if opened else "ok (length " + ", ".join(str(n) for n in lengths) + ")"
    if kind == "wrong":
        return "**wrong**"
    mark = "limit" if kind == "engine limit" else "**bug**"
    return f"`{cell.get('code')}` {mark}"


def markdown(rows: list[dict[str, Any]], targets: list[str] | tuple[str, ...] = TARGETS) -> str:
    """Return the matrix as markdown: a table of named cells, the pass rates over the ten families, then every
    cell that is not ok with its reason."""
    labels = {f.key: f.label for f in FAMILIES}
    tasks = {f.key: f.task for f in FAMILIES}
    lines = ["| family | task | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
    passed = dict.fromkeys(targets, 0)
    scored = dict.fromkeys(targets, 0)
    notes: list[str] = []
    for row in rows:
        key = row["family"]
        cells = []
        for target in targets:
            cell = row["cells"].get(target) or {"status": "missing", "code": None, "message": row.get("error", "")}
            kind, why = verdict(key, target, cell)
            cells.append(_cell_text(kind, cell))
            if key in SCORED:
                scored[target] += 1
                passed[target] += kind == "ok"
            if kind != "ok":
                said = f" (`{cell.get('code')}`: {cell.get('message', '')[:200]})" if cell.get("code") else ""
                notes.append(f"- {labels.get(key, key)} → {target}: {kind}: {why}{said}")
        lines.append(f"| {labels.get(key, key)} | {tasks.get(key, '')} | " + " | ".join(cells) + " |")
    lines.append("| **of the ten families** | | " + " | ".join(f"{passed[t]}/{scored[t]}" for t in targets) + " |")
    if notes:
        lines += ["", "Cells not ok:", *notes]
    return "\n".join(lines)
