"""ONNX to a serving SavedModel with onnx2tf, keeping the ONNX model's input shapes and layouts.

Layout: onnx2tf rewrites NCHW graphs to NHWC (TensorFlow's native layout) and, left to
itself, reads axis 1 of every rank 3-5 input as channels. That is wrong for a transformer's
``[batch, seq, hidden]`` activations (the encoder block broke on it), so every input is
passed in ``keep_shape_absolutely_input_names``: the SavedModel takes exactly the tensors
the ONNX model (and the reference) takes, and onnx2tf still moves an image input to NHWC
inside the graph where its convolutions need it. Outputs may come out channel-last, so each
output is probed against onnxruntime and transposed back inside the serving signature when
that is what matches. A caller never has to know that a layout changed.

Shapes: onnx2tf converts shape arithmetic on dynamic axes poorly (a BERT's attention mask,
built from ``Range``/``Expand``/``GatherND`` over the batch and sequence sizes, loses its
rank). So the conversion is tried twice at most:

1. ``dynamic``: the declared shapes. The result must match onnxruntime at the job's
   validation shapes *and* at a second shape where every dynamic axis differs, or the
   dynamic axes it claims would be a lie.
2. ``fixed``: every input pinned at the shape the job validates with (the spec's, else
   batch 1 and 16 for other dynamic axes), the now-constant shape arithmetic folded by
   Kiln's own passes, then converted. The SavedModel serves that shape only; the artifact
   says so (``input_shapes``, ``fixed_axes``) and the fixing passes are listed with the
   other passes in the provenance manifest. An axis the spec asks to keep open (``-1`` in
   ``shape``, or a min/max range) is never pinned: the job fails instead.

Graph preparation (Kiln passes, recorded like the optimizer's and listed in the manifest):
the constant operand of ``Add``/``Mul`` goes second (onnx2tf pairs a swapped constant with
the wrong ONNX input while broadcasting and turned a torch ``Linear``'s ``Add(bias, x @ W)``
bias into ``[1, C, 1]``); the erf GELU becomes one ``Gelu`` node (TFLite has no Erf kernel
but lowers ``tf.nn.gelu`` to its GELU builtin); every node gets a unique name here, because
onnx2tf's own namer drops node domains; at fixed shapes, ConstantOfShape folds too.

Strict mode: onnx2tf's strict mode checks each op against onnxruntime and brute-forces
transpositions when they disagree. With static shapes that is cheap and needed (without it
the tiny BERT converts, but wrong by 1e-2 on a padded mask), so it is on; with dynamic axes
it tries every permutation of every ``Expand`` (the tiny BERT's doomed dynamic conversion:
51 s with it, 2 s without) while Kiln's probe checks the result anyway, so it is off.

Offline: onnx2tf fetches sample images from the network in two places, its int8
calibration path (``output_integer_quantized_tflite``, never used here: Kiln quantizes
with TFLite's converter on the job's own data) and an optional dummy-inference check for
small fixed-batch NHWC image inputs. The second is swapped for a seeded local generator
for the duration of the call, so a conversion never touches the network. An empty
parameter-replacement file stops onnx2tf from searching for one after a failure (it only
writes a suggestion to disk, after up to three rounds of trial conversions).

onnx2tf overwrites its input file (after shape inference), so it works on a copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from services.artifacts import Artifact
from services.errors import ConversionFailed
from services.formats import Format
from services.passes._base import KilnPass, PassResult, SequencePass
from services.passes._rules import RulesPass
from services.runners.tensorflow import DEFAULT_SIGNATURE
from services.steps.context import StepContext

if TYPE_CHECKING:
    import onnx

    from services.spec import CompileSpec
    from services.tensors import TensorSpec

__all__ = ["ConstantOperandLast", "FuseErfGelu", "ScopeSafeNodeNames", "onnx_to_savedmodel"]

TOOL = "onnx2tf"
SAVEDMODEL_DIR = "saved_model"
DYNAMIC, FIXED = "dynamic", "fixed"
#: Agreement the probe asks of onnx2tf's graph against onnxruntime: float32 round-off in a
#: differently ordered computation, not the job's parity bound (the exporters check that).
PROBE_RTOL, PROBE_ATOL = 1e-3, 1e-4


# --------------------------------------------------------------------------- graph preparation


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return (
        value.const_value is not None
        or value.is_initializer()
        or (producer is not None and producer.op_type == "Constant")
    )


class ConstantOperandLast(KilnPass):
    """Put the constant operand of Add and Mul second; the ops commute, onnx2tf's broadcasting does not."""

    name = "onnx2tf_constant_operand_last"
    summary = "put the constant operand of Add/Mul second (onnx2tf transposes a constant first operand)"

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for graph in model.graphs():
            for node in graph:
                if node.op_type not in ("Add", "Mul") or node.domain not in ("", "ai.onnx"):
                    continue
                if len(node.inputs) != 2:
                    continue
                first, second = node.inputs
                if first is None or second is None:
                    continue
                if _is_constant(first) and not _is_constant(second):
                    node.replace_input_with(0, second)
                    node.replace_input_with(1, first)
                    modified = True
        return PassResult(model, modified)


class FuseErfGelu(RulesPass):
    """Fuse the exact (erf) GELU into one ``com.microsoft.Gelu`` node, which onnx2tf maps to ``tf.nn.gelu``.

    TFLite has no Erf kernel, but lowers ``tf.nn.gelu`` to its GELU builtin; onnx2tf's own
    GELU detection never fires on initializer constants. onnxruntime runs the fused node,
    and onnxscript's rules match both operand orders torch's exporters produce.
    """

    name = "onnx2tf_fuse_erf_gelu"
    summary = "fuse x*0.5*(1+erf(x/sqrt(2))) into com.microsoft.Gelu (TFLite has GELU, not Erf)"
    triggers = frozenset({"Erf"})

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.ort_fusions.erfgelu import rule1, rule2

        return [rule1, rule2]

    def call(self, model: ir.Model) -> PassResult:
        result = super().call(model)
        if result.modified:
            # The fused pattern's constants (0.5, 1, sqrt 2) are left unread.
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return result


class NameNodes(SequencePass):
    """Give every node and value a unique name (onnx_ir's NameFixPass), in place of onnx2tf's own namer.

    onnx2tf names unnamed nodes with sng4onnx, which rebuilds every node without its domain:
    ``com.microsoft.Gelu`` turns into an unregistered default-domain ``Gelu``, onnxruntime
    then refuses the graph, and onnx2tf's per-op checks against it silently stop (a BERT's
    attention then fails to convert: its key reaches the score MatMul in the wrong layout).
    """

    name = "onnx2tf_name_nodes"
    summary = "give every node and value a unique name (onnx_ir NameFixPass)"

    def passes(self) -> list[ir.passes.PassBase]:
        return [ir.passes.common.NameFixPass()]


class ScopeSafeNodeNames(KilnPass):
    """Drop the leading ``/`` of node names (torch's exporter writes ``/2/Conv``).

    onnx2tf names the variables it creates after the node (a grouped Conv becomes a Keras
    Conv2D whose kernel is ``/2/Conv/kernel``), and TensorFlow refuses to save a variable
    whose name is not a valid root scope, which may not start with ``/``.
    """

    name = "onnx2tf_scope_safe_node_names"
    summary = "drop the leading '/' of node names (TensorFlow cannot save variables named after them)"

    def call(self, model: ir.Model) -> PassResult:
        taken = {node.name for graph in model.graphs() for node in graph}
        modified = False
        for graph in model.graphs():
            for node in graph:
                name = node.name or ""
                if not name.startswith("/"):
                    continue
                base = name.lstrip("/") or "node"
                new, n = base, 1
                while new in taken:
                    new, n = f"{base}_{n}", n + 1
                taken.add(new)
                node.name = new
                modified = True
        return PassResult(model, modified)


def _prepare(
    model: onnx.ModelProto, fixed: dict[str, list[int]] | None
) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """Return the graph onnx2tf gets and the records of the passes that made it.

    A fixed attempt runs Kiln's default passes even when the spec turns the optimize step
    off: shape inference and folding are what turn the pinned shapes into constants, and
    the records say they ran.
    """
    from services.passes.folding import ShapeInference
    from services.passes.pinned_shapes import pinning_passes
    from services.passes.pipeline import optimize_model

    # onnx2tf needs the intermediate shapes (a dynamic batch fails without them), which the
    # optimiser's output leaves out for onnxruntime's sake (issue 12): infer them again.
    passes = pinning_passes(fixed) if fixed else [ShapeInference()]
    prepared, report = optimize_model(
        model,
        [*passes, FuseErfGelu(), ConstantOperandLast(), NameNodes(), ScopeSafeNodeNames()],
        keep_inferred_shapes=True,
    )
    return prepared, [r.to_dict() for r in report.passes]


# --------------------------------------------------------------------------- onnx2tf


def _offline_sample_images() -> np.ndarray:
    # Same shape as onnx2tf's downloadable sample (20 x 128 x 128 x 3, values in [0, 1]).
    return np.random.default_rng(0).random((20, 128, 128, 3), dtype=np.float32)


#: What onnx2tf sets the interpreter's recursion limit to when it is imported (C int's maximum):
#: its graph walks recurse per node.
ONNX2TF_RECURSION_LIMIT = 2147483647


@contextlib.contextmanager
def _onnx2tf_recursion() -> Iterator[None]:
    """Give onnx2tf its recursion limit while it runs, and the process its own limit back after.

    onnx2tf raises the limit on import and never lowers it. Left so, a recursion in C anywhere
    else in the process (json's decoder on a deeply nested spec, pickle, repr) runs until the C
    stack overflows: a segfault instead of the RecursionError Kiln turns into INVALID_SPEC.
    """
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(ONNX2TF_RECURSION_LIMIT)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    import onnx2tf.onnx2tf as o2t

    original = o2t.download_test_image_data
    o2t.download_test_image_data = _offline_sample_images
    try:
        yield
    finally:
        o2t.download_test_image_data = original


def _sanitized(name: str) -> str:
    # onnx2tf's own renaming: SavedModel op names may not hold ':' or start with '/'.
    return name.replace(":", "__").lstrip("/")


def _onnx2tf_options(work: Path, input_names: list[str], strict: bool) -> dict[str, Any]:
    no_replacements = work.parent / "no-replacements.json"
    no_replacements.write_text(json.dumps({"format_version": 1, "operations": []}))
    return {
        "input_onnx_file_path": str(work),
        "output_folder_path": str(work.parent / "onnx2tf-out"),
        "keep_shape_absolutely_input_names": input_names,
        "not_use_opname_auto_generate": True,  # NameNodes named them, keeping their domains
        "not_use_onnxsim": True,  # Kiln folds the graph itself; onnxsim would run as a PATH subprocess
        "disable_strict_mode": not strict,
        "param_replacement_file": str(no_replacements),
        "disable_model_save": True,  # Kiln writes the SavedModel itself, with named outputs
        "non_verbose": True,
    }


def _ops_without_converter(model: onnx.ModelProto) -> list[str]:
    """Return the op types (subgraphs included) onnx2tf has no module for, sorted.

    onnx2tf picks ``onnx2tf.ops.<OpType>`` by op type alone; asking first names every missing
    op at once, where onnx2tf would stop at the first after converting everything before it.
    """
    import importlib.util

    import onnx

    seen: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            seen.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    graphs.extend(attr.graphs)
    with _onnx2tf_recursion():  # find_spec imports the onnx2tf package first
        return sorted(op for op in seen if importlib.util.find_spec(f"onnx2tf.ops.{op}") is None)


def _run_onnx2tf(options: dict[str, Any]) -> tuple[Any, str]:
    """Return onnx2tf's Keras model and its log; raise _AttemptFailed with the log tail."""
    log = io.StringIO()
    try:
        with _onnx2tf_recursion(), _offline(), contextlib.redirect_stdout(log):
            import onnx2tf

            model = onnx2tf.convert(**options)
    except (Exception, SystemExit) as exc:  # onnx2tf calls sys.exit(1) on some refusals
        text = str(exc).strip() or type(exc).__name__
        raise _AttemptFailed(
            f"{type(exc).__name__}: {_cause(text)}", tail=(log.getvalue() + "\n" + text).strip()
        ) from exc
    if model is None:
        raise _AttemptFailed("onnx2tf produced no model", tail=log.getvalue())
    return model, log.getvalue()


def _cause(text: str) -> str:
    """Return the line of an error that says what went wrong (Keras puts it after a header line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and "Exception encountered when calling layer" in lines[0]:
        return lines[1][:300]
    return (lines[0] if lines else "")[:300]


class _AttemptFailed(Exception):
    """One attempt did not give a faithful graph; ``tail`` is what onnx2tf printed."""

    def __init__(self, message: str, *, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


# --------------------------------------------------------------------------- probing


def _probe_feeds(
    ort: Any, inputs: list[TensorSpec], base: dict[str, list[int]], spec: CompileSpec, dynamic: bool
) -> list[tuple[str, dict[str, np.ndarray]]]:
    """Return labelled probe feeds: the job's shapes, padded masks, and for a dynamic graph other shapes.

    Generated masks are all ones, which leaves a transformer's masking arithmetic untested;
    the second feed pads the last quarter of every integer or boolean ``*mask*`` input.
    A varied shape (every dynamic axis different) that onnxruntime itself cannot run (a
    sequence past the position table, an odd image side) is narrowed to the batch axis
    alone; when even that fails there is nothing to check the dynamic axes against.
    """
    from services.validation.inputs import random_input

    rng = np.random.default_rng(0)
    first = {t.name: random_input(t, base[t.name], rng) for t in inputs}
    feeds = [("job shapes", first)]
    padded = _padded_masks(first)
    if padded is not None:
        feeds.append(("padded masks", padded))
    if not dynamic or all(None not in t.shape for t in inputs):
        return feeds
    for batch_only in (False, True):
        shapes = {t.name: _varied(t, base[t.name], spec, batch_only) for t in inputs}
        if shapes == base:
            continue
        feed = {t.name: random_input(t, shapes[t.name], rng) for t in inputs}
        feed = _padded_masks(feed) or feed
        try:
            ort.run(feed)
        except Exception:
            continue
        feeds.append(("batch varied" if batch_only else "dynamic axes varied", feed))
        break
    return feeds


def _padded_masks(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Return ``feed`` with the last quarter of each integer/boolean mask zeroed, or None if it has no mask."""
    out, changed = dict(feed), False
    for name, arr in feed.items():
        if "mask" in name.lower() and arr.dtype.kind in "iub" and arr.ndim >= 1 and arr.shape[-1] >= 2:
            masked = arr.copy()
            masked[..., arr.shape[-1] - max(1, arr.shape[-1] // 4) :] = 0
            out[name], changed = masked, True
    return out if changed else None


def _varied(t: TensorSpec, base: list[int], spec: CompileSpec, batch_only: bool) -> list[int]:
    given = spec.inputs.get(t.name)
    out = list(base)
    for axis, declared in enumerate(t.shape):
        if declared is not None or (batch_only and axis != 0):
            continue
        if given is not None and given.min is not None and given.max is not None:
            lo, hi = given.min[axis], given.max[axis]
            out[axis] = hi if hi != base[axis] else lo  # stay inside the profile the user gave
        else:
            # Doubling keeps sides divisible by the strides a network already accepts.
            out[axis] = base[axis] + 1 if axis == 0 else base[axis] * 2
    return out


def _probe(
    ort: Any, tf_model: Any, onnx_in: list[str], onnx_out: list[str], feeds: list[dict[str, np.ndarray]]
) -> tuple[list[tuple[int, ...] | None], dict[str, float]]:
    """Return, per output, the permutation mapping onnx2tf's output to the ONNX layout, and the worst |diff|.

    The permutation is chosen on the first feed and must hold on every other one.
    """
    perms: list[tuple[int, ...] | None] = []
    worst = dict.fromkeys(onnx_out, 0.0)
    for i, feed in enumerate(feeds):
        expected = ort.run(feed)
        at = ", ".join(f"{n} {list(feed[n].shape)}" for n in onnx_in)
        try:
            got = tf_model([feed[n] for n in onnx_in], training=False)
        except Exception as exc:
            raise _AttemptFailed(
                f"the TensorFlow graph does not run at {at}: {type(exc).__name__}: {_cause(str(exc))}"
            ) from exc
        got_list = [np.asarray(g) for g in (got if isinstance(got, (list, tuple)) else [got])]
        for j, name in enumerate(onnx_out):
            if i == 0:
                perms.append(_choose_layout(got_list[j], expected[name], f"output {name!r} at {at}"))
            worst[name] = max(worst[name], _compare(got_list[j], expected[name], perms[j], f"output {name!r} at {at}"))
    return perms, worst


def _permuted(arr: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    return arr if perm is None else np.transpose(arr, perm)


def _choose_layout(actual: np.ndarray, want: np.ndarray, where: str) -> tuple[int, ...] | None:
    """Return None (as is) or the channel-last to channel-first permutation that makes ``actual`` match."""
    candidates: list[tuple[int, ...] | None] = [None]
    if want.ndim >= 3:
        candidates.append((0, want.ndim - 1, *range(1, want.ndim - 1)))
    shaped = [p for p in candidates if _permuted(actual, p).shape == want.shape]
    for perm in shaped:
        if _close(_permuted(actual, perm), want):
            return perm
    if not shaped:
        raise _AttemptFailed(f"{where}: shape {list(actual.shape)}, onnxruntime gives {list(want.shape)}")
    return shaped[0]  # _compare reports the numbers


def _compare(actual: np.ndarray, want: np.ndarray, perm: tuple[int, ...] | None, where: str) -> float:
    """Return max |actual - want| after ``perm``; raise _AttemptFailed when they do not agree."""
    arr = _permuted(actual, perm)
    if arr.shape != want.shape:
        raise _AttemptFailed(f"{where}: shape {list(actual.shape)}, onnxruntime gives {list(want.shape)}")
    diff = float(np.abs(arr.astype(np.float64) - want.astype(np.float64)).max()) if want.size else 0.0
    if not _close(arr, want):
        raise _AttemptFailed(f"{where} disagrees with onnxruntime (max |diff| {diff:.3g})")
    return diff


def _close(actual: np.ndarray, want: np.ndarray) -> bool:
    if want.dtype.kind not in "fc":
        return bool(np.array_equal(actual, want))
    scale = 1.0 + (float(np.abs(want).max()) if want.size else 0.0)
    return bool(np.allclose(actual, want, rtol=PROBE_RTOL, atol=PROBE_ATOL * scale))


# --------------------------------------------------------------------------- attempts


@dataclass
class _Attempt:
    """One way of handing the graph to onnx2tf."""

    shapes: str  # DYNAMIC | FIXED
    fixed: dict[str, list[int]] | None = None
    strict: bool = False
    seconds: float = 0.0
    error: str | None = None
    tail: str = field(default="", repr=False)

    def record(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_shapes": self.shapes,
            "strict_mode": self.strict,
            "seconds": round(self.seconds, 2),
        }
        if self.fixed:
            body["fixed_input_shapes"] = self.fixed
        if self.error:
            body["error"] = self.error
        return body


def _open_axes(inputs: list[TensorSpec], spec: CompileSpec) -> dict[str, list[int]]:
    """Return the dynamic axes the spec asks to keep open: -1 in ``shape``, or min != max."""
    out: dict[str, list[int]] = {}
    for t in inputs:
        given = spec.inputs.get(t.name)
        if given is None:
            continue
        axes = []
        for axis, declared in enumerate(t.shape):
            if declared is not None:
                continue
            if given.shape is not None and axis < len(given.shape) and given.shape[axis] == -1:
                axes.append(axis)
            elif given.min is not None and given.max is not None and given.min[axis] != given.max[axis]:
                axes.append(axis)
        if axes:
            out[t.name] = axes
    return out


def _plan_attempts(
    inputs: list[TensorSpec], base: dict[str, list[int]], spec: CompileSpec
) -> tuple[list[_Attempt], str | None]:
    """Return the attempts to make in order, and why there is no fixed-shape attempt (None if there is)."""
    static = all(None not in t.shape for t in inputs)
    attempts = [_Attempt(DYNAMIC, strict=static)]
    if static:
        return attempts, None
    open_axes = _open_axes(inputs, spec)
    if open_axes:
        return attempts, f"the spec keeps axes {open_axes} dynamic, so Kiln did not pin them"
    attempts.append(_Attempt(FIXED, fixed=dict(base), strict=True))
    return attempts, None


@dataclass
class _Converted:
    tf_model: Any
    perms: list[tuple[int, ...] | None]
    worst: dict[str, float]
    passes: list[dict[str, Any]]
    probed: list[dict[str, Any]]


def _try(
    ctx: StepContext,
    model: onnx.ModelProto,
    ort: Any,
    attempt: _Attempt,
    inputs: list[TensorSpec],
    base: dict[str, list[int]],
    onnx_out: list[str],
) -> _Converted:
    from services.onnx_io import save_onnx

    started = time.perf_counter()
    try:
        try:
            prepared, passes = _prepare(model, attempt.fixed)
        except ConversionFailed as exc:  # a pass failed: this attempt cannot be made
            raise _AttemptFailed(exc.message) from exc
        missing = _ops_without_converter(prepared)
        if missing:
            raise _AttemptFailed(f"onnx2tf has no converter for {', '.join(missing)}")
        work = ctx.scratch / f"onnx2tf-{attempt.shapes}" / "model.onnx"
        save_onnx(prepared, work)
        names = [t.name for t in inputs]
        tf_model, log = _run_onnx2tf(_onnx2tf_options(work, names, attempt.strict))
        feeds = _probe_feeds(ort, inputs, base, ctx.spec, dynamic=attempt.shapes == DYNAMIC)
        try:
            perms, worst = _probe(ort, tf_model, names, onnx_out, [feed for _, feed in feeds])
        except _AttemptFailed as exc:
            exc.tail = exc.tail or log
            raise
        probed = [{"feed": label, "shapes": {n: list(f[n].shape) for n in names}} for label, f in feeds]
        return _Converted(tf_model, perms, worst, passes, probed)
    except _AttemptFailed as exc:
        attempt.error, attempt.tail = str(exc), exc.tail
        raise
    finally:
        attempt.seconds = time.perf_counter() - started


def _all_failed(ctx: StepContext, attempts: list[_Attempt], no_fixed: str | None) -> ConversionFailed:
    said = "; ".join(f"with {a.shapes} input shapes{f' {a.fixed}' if a.fixed else ''}: {a.error}" for a in attempts)
    if no_fixed:
        said += f"; {no_fixed}"
    hint = "onnx2tf could not map this graph to TensorFlow faithfully; the onnxruntime or openvino targets read the ONNX model directly."
    if no_fixed:
        hint += " Giving the inputs a fixed `shape` in the spec lets Kiln convert at that shape."
    tail = next((a.tail for a in reversed(attempts) if a.tail), "")
    return ConversionFailed(
        f"{TOOL} could not convert the ONNX model: {said}",
        hint=hint,
        step=ctx.step.id,
        tool=TOOL,
        attempts=[a.record() for a in attempts],
        output_tail=tail[-2000:],
    )


# --------------------------------------------------------------------------- the step


def onnx_to_savedmodel(ctx: StepContext) -> Artifact:
    """Convert model.onnx to a SavedModel whose serving_default takes the ONNX inputs as they are."""
    import tensorflow as tf

    from services.converters.tensorflow_native import signature_tensors
    from services.onnx_io import load_onnx
    from services.runners.onnx import OnnxRuntimeRunner
    from services.validation.inputs import resolve_shape

    src = ctx.model.path
    model = load_onnx(src)
    ort = OnnxRuntimeRunner(src)
    inputs, onnx_out = ort.inputs, [o.name for o in ort.outputs]
    onnx_in = [t.name for t in inputs]
    base = {t.name: resolve_shape(t, ctx.spec) for t in inputs}
    attempts, no_fixed = _plan_attempts(inputs, base, ctx.spec)

    converted: _Converted | None = None
    made: list[_Attempt] = []
    for attempt in attempts:
        made.append(attempt)
        what = f"input shapes fixed at {attempt.fixed}" if attempt.fixed else "the declared input shapes"
        ctx.progress(f"converting ONNX to TensorFlow with onnx2tf ({what})")
        try:
            converted = _try(ctx, model, ort, attempt, inputs, base, onnx_out)
            break
        except _AttemptFailed as exc:
            ctx.progress(f"onnx2tf with {what} failed: {exc}")
    if converted is None:
        raise _all_failed(ctx, made, no_fixed)
    final = made[-1]

    out_keys = [_sanitized(n) for n in onnx_out]
    signature = [
        tf.TensorSpec(t.shape, t.dtype, name=_sanitized(n))
        for t, n in zip(converted.tf_model.inputs, onnx_in, strict=True)
    ]
    tf_model, perms = converted.tf_model, converted.perms

    def serve(*args: Any) -> dict[str, Any]:
        result = tf_model(list(args), training=False)
        flat = result if isinstance(result, (list, tuple)) else [result]
        return {
            key: (tf.transpose(t, perm) if perm is not None else tf.identity(t))
            for key, t, perm in zip(out_keys, flat, perms, strict=True)
        }

    module = tf.Module()
    # Only the variables are tracked, so they are saved with the graph. Tracking the Keras
    # model itself makes TensorFlow serialise every layer's call function as well: measured
    # 62 s against 1.4 s to save an 11M-parameter BERT, for nothing the signature uses.
    # They are the variables the traced signature reads, not the Keras model's own list:
    # onnx2tf builds a grouped Conv as a tf_keras Conv2D inside a Lambda, whose kernel no
    # layer tracks, and saving then failed on a captured 'untracked' ResourceHandle.
    concrete = tf.function(serve, input_signature=signature).get_concrete_function()
    module.kept_variables = list(concrete.variables)
    dest = ctx.out_dir / SAVEDMODEL_DIR
    tf.saved_model.save(module, str(dest), signatures={DEFAULT_SIGNATURE: concrete})
    fixed_axes = {
        t.name: [a for a, d in enumerate(t.shape) if d is None] for t in inputs if final.fixed and None in t.shape
    }
    return Artifact(
        root=ctx.out_dir,
        kind=Format.SAVEDMODEL.value,
        entry=SAVEDMODEL_DIR,
        meta={
            "tool": TOOL,
            "input_shapes": final.shapes,
            # The dynamic axes of the ONNX model this SavedModel does not have (it takes fixed_input_shapes only).
            "fixed_axes": fixed_axes,
            "fixed_input_shapes": final.fixed or {},
            "strict_mode": final.strict,
            "attempts": [a.record() for a in made],
            "passes": converted.passes,
            "probe": {
                "feeds": converted.probed,
                "max_abs_diff": {k: float(f"{v:.3g}") for k, v in converted.worst.items()},
            },
            "kept_input_layout": onnx_in,
            "transposed_outputs": [n for n, p in zip(onnx_out, perms, strict=True) if p is not None],
            "renamed": {n: _sanitized(n) for n in [*onnx_in, *onnx_out] if _sanitized(n) != n},
            "signature": signature_tensors(dest),
        },
    )
