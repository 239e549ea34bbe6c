"""The ncnn target: ``model.ncnn.param`` + ``model.ncnn.bin`` written by pnnx, at fp32 or fp16.

pnnx reads ONNX and TorchScript itself, so a TorchScript source goes straight to ncnn (no
ONNX round trip) and everything else arrives as Kiln's optimised ONNX. The pnnx wheel ships
a self-contained binary (libtorch linked in) beside its Python package; Kiln runs it as a
subprocess in scratch space, with a timeout, its output kept for the job's log and for
CONVERSION_FAILED's details. The package is never imported (its ``__init__`` imports torch).

pnnx traces at fixed input shapes: Kiln gives it the reference samples' shapes at batch 1
(ncnn blobs have no batch axis; the runner loops over a batch, see services/runners/ncnn.py).
The other axes are fixed in the artifact at those shapes. Blob names are pnnx's ``in0..``
and ``out0..``, in the model's input and output order; ``model.ncnn.json`` maps them to the
source's names and records each output's per-sample shape and the ncnn options (fp16
storage off for fp32) the artifact was validated with. The manifest carries the same map.

fp16 stores the weights as fp16 (pnnx ``fp16=1``) and runs with ncnn's fp16 storage and
arithmetic on; inputs and outputs stay float32 at every precision, as for every target.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, EngineUnavailable, SourceUnreadable, Timeout, tool_said
from services.exporters._common import finish_export
from services.formats import Format
from services.runners.ncnn import FP16_OPTIONS, FP32_OPTIONS, NcnnRunner, sidecar_path
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import ReferenceData, load_reference

__all__ = [
    "BIN_FILE",
    "META_FILE",
    "PARAM_FILE",
    "PNNX_TIMEOUT_SECONDS",
    "export_ncnn",
    "pnnx_binary",
    "pnnx_input_shapes",
    "pnnx_readable_onnx",
    "run_pnnx",
    "unconverted_layers",
]

PARAM_FILE = "model.ncnn.param"
BIN_FILE = "model.ncnn.bin"
META_FILE = sidecar_path(Path(PARAM_FILE)).name
TOOL = "pnnx"
#: A conversion of a model Kiln can validate takes seconds; a hung pnnx is killed after this.
PNNX_TIMEOUT_SECONDS = 1200.0
#: The newest ONNX IR version pnnx's embedded onnxruntime reads ("max supported IR version: 13").
PNNX_MAX_IR_VERSION = 13
#: ncnn Mats hold at most 4 axes per sample, so inputs have at most 5 with the batch axis.
MAX_RANK = 5
#: pnnx's dtype suffixes for ``inputshape`` (it traces at these dtypes).
_PNNX_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "uint8": "u8",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
}
_INSTALL_HINT = "Install the ncnn extra: pip install -c constraints.txt -e '.[ncnn]' (pnnx and ncnn from PyPI)."


def pnnx_binary() -> Path:
    """Return the pnnx executable the ``pnnx`` wheel ships; ENGINE_UNAVAILABLE without it."""
    spec = importlib.util.find_spec("pnnx")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(folder) / ("pnnx.exe" if sys.platform == "win32" else "pnnx")
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    raise EngineUnavailable("the pnnx converter is not installed here", hint=_INSTALL_HINT)


def _death_signal() -> Callable[[], None] | None:
    """Return a pre-exec hook that has Linux kill pnnx when the step's process dies, or None elsewhere.

    prctl is looked up here, in the parent: between fork and exec the hook only calls it (no
    dlopen, no import), which is what is safe in a process that has other threads.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:  # pragma: no cover - runs in the forked child
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a cancelled or killed step takes pnnx with it

    return hook


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _staged(model: Path, folder: Path) -> Path:
    """Return ``model`` seen from ``folder`` through links to its folder's files (external data included).

    pnnx writes an intermediate ``<name>.pnnxsim.onnx`` beside the model it reads, which no
    option names: beside a stored artifact that would write into the store (read-only in the
    step sandbox: "write pnnxsim onnx failed"). Links cost nothing and keep the model's own
    folder untouched.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for f in model.parent.iterdir():
        link = folder / f.name
        if f.is_file() and not link.exists():
            link.symlink_to(f)
    return folder / model.name


def run_pnnx(
    model: Path,
    work: Path,
    input_shapes: list[str],
    *,
    fp16: bool,
    input_shapes2: list[str] | None = None,
    timeout: float = PNNX_TIMEOUT_SECONDS,
) -> tuple[Path, Path, dict[str, Any]]:
    """Convert ``model`` (ONNX or TorchScript) with pnnx in ``work``; return (.param, .bin, what ran).

    ``input_shapes2`` is pnnx's second shape set: axes where the two differ stay dynamic.
    Every file pnnx writes goes into ``work``; its output is in ``work/pnnx.log``. A non-zero
    exit or missing output is CONVERSION_FAILED with the output's tail; running past
    ``timeout`` seconds is TIMEOUT (pnnx is killed).
    """
    exe = pnnx_binary()
    work.mkdir(parents=True, exist_ok=True)
    model, work = Path(model).resolve(), work.resolve()  # pnnx runs in ``work``: relative paths would miss
    model = _staged(model, work / "source")
    # pnnx derives default names from the input's; every output is named so nothing lands beside the source.
    outputs = {
        "pnnxparam": "model.pnnx.param",
        "pnnxbin": "model.pnnx.bin",
        "pnnxpy": "model_pnnx.py",
        "pnnxonnx": "model.pnnx.onnx",
        "ncnnparam": PARAM_FILE,
        "ncnnbin": BIN_FILE,
        "ncnnpy": "model_ncnn.py",
    }
    args = [f"inputshape={','.join(input_shapes)}", f"fp16={int(fp16)}", "device=cpu"]
    if input_shapes2:
        args.insert(1, f"inputshape2={','.join(input_shapes2)}")
    cmd = [str(exe), str(model), *args, *(f"{k}={work / v}" for k, v in outputs.items())]
    log = work / "pnnx.log"
    started = time.perf_counter()
    preexec = _death_signal()
    try:
        with log.open("w") as out:
            proc = subprocess.run(
                cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False, preexec_fn=preexec
            )
    except subprocess.TimeoutExpired:
        raise Timeout(
            f"pnnx did not finish converting {model.name} in {timeout:.0f} s",
            hint="pnnx was killed; a model this slow to convert is unusual, its log tail is in the details.",
            tool=TOOL,
            output_tail=_tail(log.read_text(errors="replace")),
        ) from None
    text = log.read_text(errors="replace")
    # Into the step's own output too, which is the job's log (the tail alone reaches the manifest).
    sys.stderr.write(f"pnnx: {' '.join([exe.name, model.name, *args])}\n{text.rstrip()}\n")
    sys.stderr.flush()
    param, weights = work / PARAM_FILE, work / BIN_FILE
    if proc.returncode != 0 or not param.is_file() or not weights.is_file():
        said = tool_said(text) if text.strip() else f"exit status {proc.returncode}"
        raise ConversionFailed(
            f"pnnx could not convert {model.name} to ncnn: {said}",
            hint="pnnx names the operator or shape it could not handle in the output tail; "
            "check the input shapes it was given (`inputs` in the spec).",
            tool=TOOL,
            exit_status=proc.returncode,
            command=" ".join([exe.name, model.name, *args]),
            output_tail=_tail(text),
        )
    return (
        param,
        weights,
        {
            "command": " ".join([exe.name, model.name, *args]),
            "convert_seconds": round(time.perf_counter() - started, 3),
            "log_tail": _tail(text, 6),
        },
    )


def unconverted_layers(param: Path) -> list[str]:
    """Return the layer types in an ncnn .param that ncnn cannot run: operators pnnx left as they were.

    pnnx writes what it could not lower under its own or torch's names (``pnnx.Expression``,
    ``torch.xxx``, ``F.xxx``) or under the ONNX op's (``Pad`` where ncnn's layer is ``Padding``);
    ncnn's own registry (``layer_to_index``) knows which names are its layers.
    """
    import ncnn

    lines = param.read_text().splitlines()[2:]  # magic number, then the layer and blob counts
    kinds = {line.split()[0] for line in lines if line.strip()}
    return sorted(k for k in kinds if not k.isidentifier() or ncnn.layer_to_index(k) < 0)


def pnnx_input_shapes(ref: ReferenceData) -> list[str]:
    """Return pnnx's ``inputshape`` items (``[1,3,32,32]f32``) for the source's inputs, in order, at batch 1.

    Shapes come from the reference samples (the shapes parity is checked on); a batch axis
    the model fixes above 1, or more axes than an ncnn blob holds, cannot be converted.
    """
    items = []
    first = ref.inputs[0]
    for t in ref.input_specs:
        shape = list(np.asarray(first[t.name]).shape)
        if not shape or len(shape) > MAX_RANK:
            raise ConversionFailed(
                f"input {t.name} has {len(shape)} axes; ncnn takes 1 to {MAX_RANK} (a batch axis and at most 4 more)",
                hint="Reshape the input to at most 4 axes besides the batch axis, or choose another target.",
                tool=TOOL,
            )
        if t.shape and t.shape[0] not in (None, 1):
            raise ConversionFailed(
                f"input {t.name} fixes its batch axis at {t.shape[0]}; ncnn runs one sample at a time (CHW blobs)",
                hint="Export the model with batch 1 or an open batch axis; Kiln's ncnn runner loops over a batch.",
                tool=TOOL,
            )
        shape[0] = 1
        dtype = _PNNX_DTYPES.get(t.dtype, "f32")
        items.append("[" + ",".join(str(d) for d in shape) + "]" + dtype)
    return items


def _traced_shapes(path: Path, ours: list[str]) -> list[str] | None:
    """Return pnnx shape items for the example inputs a traced TorchScript recorded, when they differ from ``ours``.

    pnnx refuses an ``inputshape`` other than the recorded one, so a module traced at batch 2
    is given its trace shapes first and Kiln's batch-1 shapes as the second set, which makes
    the axes that differ dynamic in the ncnn graph.
    """
    from services.runners.torch_archives import traced_inputs

    traced = traced_inputs(path)
    if not traced or len(traced) != len(ours):
        return None
    items = ["[" + ",".join(str(d) for d in t.shape) + "]" + _PNNX_DTYPES.get(t.dtype, "f32") for t in traced]
    return items if items != ours else None


def _pads_without_mode(graph: Any, rewrite: bool) -> int:
    """Count (and with ``rewrite``, fix) the Pad nodes that leave ``mode`` to its default.

    ONNX's default is ``constant``, but pnnx lowers a Pad to ncnn's Padding only when the
    attribute is written out; without it pnnx keeps ``Pad``, a layer ncnn does not have
    (tf2onnx writes Keras' ZeroPadding2D that way: ResNet50, DenseNet121, MobileNetV3).
    """
    from onnx import helper

    missing = [
        n
        for n in graph.node
        if n.op_type == "Pad" and n.domain in ("", "ai.onnx") and not any(a.name == "mode" for a in n.attribute)
    ]
    if rewrite:
        for node in missing:
            node.attribute.append(helper.make_attribute("mode", "constant"))
    return len(missing)


def pnnx_readable_onnx(src: Path, scratch: Path, sample: dict[str, np.ndarray] | None = None) -> tuple[Path, list[str]]:
    """Return an ONNX file pnnx can open and lower whole: ``src``, or a rewritten copy; and what was changed.

    - onnx >= 1.23 writes IR version 14, which pnnx's onnxruntime refuses outright; the version
      says which format features a file may use, and a model that uses none added after 13
      reads the same at 13 (one that does fails in pnnx, as before);
    - Pads get their default ``mode`` written out (see _pads_without_mode);
    - with a ``sample`` (one batch-1 feed, the shapes pnnx traces at): open axes are pinned at
      its shapes and the shape arithmetic folded, then the operators ncnn has no layer for are
      rewritten (services/exporters/ncnn_graph.py). The rewrite is used only when onnxruntime
      gives the pinned graph's outputs from it on ``sample``; otherwise the pinned graph goes
      to pnnx as it is, and the note says why.
    """
    from services.onnx_io import load_onnx, save_onnx

    header = load_onnx(src, load_external_data=False)
    new_ir = header.ir_version > PNNX_MAX_IR_VERSION
    if sample is None and not new_ir and not _pads_without_mode(header.graph, rewrite=False):
        return src, []
    model = load_onnx(src)
    notes: list[str] = []
    if sample is not None:
        model, notes = _pinned_and_rewritten(model, sample)
    if model.ir_version > PNNX_MAX_IR_VERSION:
        notes.append(
            f"ONNX IR version {model.ir_version} stamped {PNNX_MAX_IR_VERSION} for pnnx (its onnxruntime reads up to 13)"
        )
        model.ir_version = PNNX_MAX_IR_VERSION
    pads = _pads_without_mode(model.graph, rewrite=True)
    if pads:
        notes.append(f"mode=constant (ONNX's default) written on {pads} Pad node(s), which pnnx lowers only so")
    if not notes:
        return src, []
    scratch.mkdir(parents=True, exist_ok=True)
    dst = scratch / "model.onnx"
    save_onnx(model, dst)
    return dst, notes


def _outputs_on(model: Any, sample: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    # An input the rewrite declared float (an attention mask) is fed as ncnn feeds it: as float32.
    feed = {
        i.name: np.asarray(sample[i.name]).astype(types.get(i.type, sample[i.name].dtype)) for i in session.get_inputs()
    }
    return list(session.run(None, feed))


def _pinned_and_rewritten(model: Any, sample: dict[str, np.ndarray]) -> tuple[Any, list[str]]:
    """Return the model pinned at ``sample``'s shapes with ncnn's rewrites applied (or pinned only), and notes."""
    import onnx

    from services.exporters.ncnn_graph import rewrite_for_ncnn
    from services.passes.pinned_shapes import pin_input_shapes

    notes: list[str] = []
    shapes = {k: list(np.asarray(v).shape) for k, v in sample.items()}
    initializers = {i.name for i in model.graph.initializer}
    open_axes = any(
        not d.HasField("dim_value")
        for i in model.graph.input
        if i.name not in initializers
        for d in i.type.tensor_type.shape.dim
    )
    if open_axes:
        try:
            model, _ = pin_input_shapes(model, {k: v for k, v in shapes.items()})
        except Exception as exc:  # pnnx pins shapes itself; folding first is only a help
            return model, [f"shapes not pinned before pnnx ({type(exc).__name__}: {str(exc)[:160]})"]
        notes.append(
            "inputs pinned at " + ", ".join(f"{k} {v}" for k, v in shapes.items()) + ", shape arithmetic folded"
        )
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    try:
        report = rewrite_for_ncnn(rewritten)
    except Exception as exc:  # a graph the rewrites do not understand goes to pnnx as it is
        return model, [*notes, f"ncnn rewrites skipped ({type(exc).__name__}: {str(exc)[:160]})"]
    if not report.counts:
        return model, notes
    try:
        want, got = _outputs_on(model, sample), _outputs_on(rewritten, sample)
        worst = max(
            (
                float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                for a, b in zip(want, got, strict=True)
            ),
            default=0.0,
        )
        scale = max((float(np.max(np.abs(a))) for a in want if np.size(a)), default=1.0) or 1.0
    except Exception as exc:
        return model, [
            *notes,
            f"ncnn rewrites not used: onnxruntime cannot run them ({type(exc).__name__}: {str(exc)[:160]})",
        ]
    if not worst <= 1e-5 * scale:
        return model, [*notes, f"ncnn rewrites not used: they changed the outputs by {worst:.3g} (Kiln's bug)"]
    return rewritten, [*notes, *(f"rewritten for ncnn: {n}" for n in report.notes())]


def _retyped(items: list[str], model: Path, names: list[str]) -> list[str]:
    """Return pnnx's shape items with each input's dtype as the (possibly rewritten) ONNX file declares it."""
    from onnx import helper

    from services.onnx_io import load_onnx

    declared = {
        i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
        for i in load_onnx(model, load_external_data=False).graph.input
    }
    out = []
    for item, name in zip(items, names, strict=True):
        dtype = _PNNX_DTYPES.get(declared.get(name, ""), None)
        out.append(item[: item.rindex("]") + 1] + dtype if dtype else item)
    return out


#: pnnx's integer shape items: ncnn reads such a blob's 32 bits as int32 (its Embed layer's token ids).
_PNNX_INT_SUFFIXES = ("i64", "i32", "i16", "i8", "u8")


def _blob_map(ref: ReferenceData, shapes: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Return the sidecar's inputs and outputs: source name, pnnx blob, dtype, per-sample shape at batch None.

    An input pnnx traced as an integer (``shapes``' items) is an int32 blob: ncnn's Embed reads
    its token ids as the Mat's 32 bits, so it is fed int32 values, not floats.
    """
    first_in, first_out = ref.inputs[0], ref.outputs[0]
    inputs = [
        {
            "name": t.name,
            "blob": f"in{i}",
            "dtype": "int32" if item.endswith(_PNNX_INT_SUFFIXES) else "float32",
            "shape": [None, *np.asarray(first_in[t.name]).shape[1:]],
        }
        for i, (t, item) in enumerate(zip(ref.input_specs, shapes, strict=True))
    ]
    outputs = []
    for i, t in enumerate(ref.output_specs):
        value = np.asarray(first_out[t.name])
        outputs.append({"name": t.name, "blob": f"out{i}", "dtype": "float32", "shape": [None, *value.shape[1:]]})
    return {"inputs": inputs, "outputs": outputs}


def _unconverted_error(leftover: list[str]) -> ConversionFailed:
    return ConversionFailed(
        f"pnnx left operators ncnn cannot run: {', '.join(leftover)}",
        hint="ncnn has no layer for them; choose another target, or rewrite those operations in the model.",
        tool=TOOL,
        unconverted=leftover,
    )


def _convert(
    ctx: StepContext, ref: ReferenceData, shapes: list[str], shapes2: list[str] | None, fp16: bool
) -> tuple[Path, Path, dict[str, Any], list[str]]:
    """Run pnnx on the step's model; return (.param, .bin, what ran, the shape items it traced at).

    An ONNX model goes first pinned and rewritten for ncnn (pnnx_readable_onnx with a sample),
    then, if pnnx fails on that or leaves operators ncnn cannot run, as it came (the IR version
    and Pad fixes only): a graph the rewrites do not help converts as it did before them. The
    first attempt's error is the one reported when both fail.
    """
    if Format(ctx.model.kind) is not Format.ONNX:
        param, weights, ran = run_pnnx(ctx.model.path, ctx.scratch / "pnnx", shapes, fp16=fp16, input_shapes2=shapes2)
        leftover = unconverted_layers(param)
        if leftover:
            raise _unconverted_error(leftover)
        return param, weights, ran, shapes
    names = [t.name for t in ref.input_specs]
    sample = {name: np.asarray(ref.inputs[0][name])[:1] for name in names}
    prepared = pnnx_readable_onnx(ctx.model.path, ctx.scratch / "pnnx-input", sample)
    plain = pnnx_readable_onnx(ctx.model.path, ctx.scratch / "pnnx-input-plain")
    attempts = [prepared] if plain[1] == prepared[1] else [prepared, plain]
    first: ConversionFailed | None = None
    for attempt, (model, rewrites) in enumerate(attempts):
        items = _retyped(shapes, model, names)
        try:
            param, weights, ran = run_pnnx(model, ctx.scratch / f"pnnx-{attempt}", items, fp16=fp16)
            leftover = unconverted_layers(param)
            if leftover:
                raise _unconverted_error(leftover)
        except ConversionFailed as exc:
            first = first or exc
            continue
        if attempt:
            rewrites = [
                *rewrites,
                f"the graph pinned and rewritten for ncnn did not convert ({first.message if first else ''}); "
                "converted as it came",
            ]
        if rewrites:
            ran["onnx_rewrites"] = rewrites
        return param, weights, ran, items
    assert first is not None
    raise first


def export_ncnn(ctx: StepContext) -> Artifact:
    """Write model.ncnn.param/.bin (+ model.ncnn.json) at the job's precision, validated on ncnn."""
    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    ref = load_reference(ctx.reference)
    shapes = pnnx_input_shapes(ref)
    fp16 = precision is Precision.FP16
    ctx.progress(f"converting {Format(ctx.model.kind).value} to ncnn with pnnx ({precision.value}, {' '.join(shapes)})")
    shapes2 = None
    if Format(ctx.model.kind) is Format.TORCHSCRIPT:
        traced = _traced_shapes(ctx.model.path, shapes)
        if traced is not None:
            shapes, shapes2 = traced, shapes
    param, weights, ran, shapes = _convert(ctx, ref, shapes, shapes2, fp16)
    shutil.copyfile(param, ctx.out_dir / PARAM_FILE)
    shutil.copyfile(weights, ctx.out_dir / BIN_FILE)
    blobs = _blob_map(ref, shapes2 or shapes)
    options = FP16_OPTIONS if fp16 else FP32_OPTIONS
    meta = {
        "param": PARAM_FILE,
        "bin": BIN_FILE,
        "precision": precision.value,
        "weights": "float16" if fp16 else "float32",
        "options": options,
        "batch": "one sample per inference: a batch of N runs N times (ncnn blobs have no batch axis)",
        **blobs,
    }
    (ctx.out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    try:  # what pnnx wrote must load: a failure here is the converter's, not the user's file
        NcnnRunner(ctx.out_dir / PARAM_FILE).close()
    except SourceUnreadable as exc:
        raise ConversionFailed(
            f"ncnn cannot load what pnnx wrote: {exc.message}",
            hint="pnnx emitted a layer or weights this ncnn cannot read; the pnnx log tail is in the details.",
            tool=TOOL,
            output_tail=ran["log_tail"],
        ) from exc
    details = {
        "converter": TOOL,
        **ran,
        "input_shapes": shapes2 or shapes,
        "blobs": {
            "inputs": {e["name"]: e["blob"] for e in blobs["inputs"]},
            "outputs": {e["name"]: e["blob"] for e in blobs["outputs"]},
        },
        "options": options,
        "batch": meta["batch"],
        "size_bytes": (ctx.out_dir / PARAM_FILE).stat().st_size + (ctx.out_dir / BIN_FILE).stat().st_size,
    }
    return finish_export(
        ctx,
        fmt=Format("ncnn"),
        entry=PARAM_FILE,
        precision=precision,
        serving={"ncnn": {"param": PARAM_FILE, "bin": BIN_FILE, "blobs": META_FILE}},
        engine_details={"ncnn": details},
    )
