"""Pre-flight for the TensorRT target: what in an ONNX model TensorRT's ONNX parser will refuse.

Runs without TensorRT (and without a GPU), from the parser's published support matrix kept as
data in :mod:`services.tensorrt.onnx_support`, so a job learns in seconds — before it waits
for a GPU worker — that its model has, say, two ``NonZero`` nodes and a ``com.microsoft``
op. It walks the whole model: the main graph, the subgraphs of ``If``/``Loop``/``Scan`` (and
any other graph attribute), and model-local functions, which the parser inlines. Besides
unknown ops it reports tensor types TensorRT has no kernels for (strings, complex, 16-bit and
unsigned integers other than UINT8 I/O), the opset range, and the per-node restrictions in
:mod:`services.tensorrt.restrictions`.

The verdict is a :class:`PreflightReport`; :func:`require_tensorrt_support` turns a failing
report into ``UNSUPPORTED_OPS`` with ``details.ops`` = ``{op: count}``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from services.errors import UnsupportedOps
from services.onnx_io import load_onnx
from services.tensorrt.onnx_support import ParserSupport, parser_support
from services.tensorrt.restrictions import node_problems

__all__ = ["PreflightReport", "preflight", "raise_if_unsupported", "require_tensorrt_support"]

_DEFAULT_DOMAINS = ("", "ai.onnx")
#: How many restriction / dtype entries an error carries; the counts are always complete.
_MAX_LISTED = 50


@dataclass
class PreflightReport:
    """What TensorRT's ONNX parser would refuse in a model, per the table of one TensorRT release."""

    tensorrt: str  # the release the support table describes
    opset: int | None
    nodes: int  # nodes checked, subgraphs and functions included
    ops: dict[str, int] = field(
        default_factory=dict
    )  # unsupported op -> node count ("domain::Op" off the default domain)
    restrictions: list[dict[str, str]] = field(default_factory=list)  # {"op", "node", "problem"}
    dtypes: list[dict[str, str]] = field(default_factory=list)  # {"tensor", "dtype", "problem"}
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.ops or self.restrictions or self.dtypes)

    def summary(self) -> str:
        """Return one line naming every unsupported op and counting the other problems."""
        parts = []
        if self.ops:
            parts.append("unsupported ops " + ", ".join(f"{op} ×{n}" for op, n in self.ops.items()))
        if self.restrictions:
            first = self.restrictions[0]
            more = f" (and {len(self.restrictions) - 1} more)" if len(self.restrictions) > 1 else ""
            parts.append(f"{first['op']} {first['node']!r}: {first['problem']}{more}")
        if self.dtypes:
            types = sorted({d["dtype"] for d in self.dtypes})
            parts.append(f"{len(self.dtypes)} tensors of unsupported types ({', '.join(types)})")
        return "; ".join(parts) or "no problems found"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensorrt": self.tensorrt,
            "opset": self.opset,
            "nodes": self.nodes,
            "ops": dict(self.ops),
            "restrictions": self.restrictions[:_MAX_LISTED],
            "restriction_count": len(self.restrictions),
            "dtypes": self.dtypes[:_MAX_LISTED],
            "dtype_count": len(self.dtypes),
            "warnings": list(self.warnings),
        }


def _type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type)


class _Facts:
    """Constants, dtypes and ranks visible from one graph (outer scopes included)."""

    def __init__(
        self,
        nodes: list[onnx.NodeProto],
        initializers: list[onnx.TensorProto],
        types: dict[str, tuple[int, int | None]],
        base_dir: Path | None,
        parent: _Facts | None = None,
    ) -> None:
        self._init = {t.name: t for t in initializers}
        self._const_nodes = {n.output[0]: n for n in nodes if n.op_type == "Constant" and n.output}
        self._types = types
        self._base_dir = base_dir
        self._parent = parent

    def constant(self, name: str) -> np.ndarray | None:
        if name in self._init:
            base = str(self._base_dir) if self._base_dir else ""
            return numpy_helper.to_array(self._init[name], base_dir=base)
        node = self._const_nodes.get(name)
        if node is not None and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            if isinstance(value, onnx.TensorProto):
                return numpy_helper.to_array(value)
            if isinstance(value, (int, float, list)):
                return np.asarray(value)
            return None  # sparse or string constants: reported by the Constant check
        return self._parent.constant(name) if self._parent else None

    def dtype(self, name: str) -> str | None:
        found = self._types.get(name)
        if found and found[0]:
            return _type_name(found[0])
        if name in self._init:
            return _type_name(self._init[name].data_type)
        return self._parent.dtype(name) if self._parent else None

    def rank(self, name: str) -> int | None:
        found = self._types.get(name)
        return found[1] if found else None


def _collect_types(graph: onnx.GraphProto, out: dict[str, tuple[int, int | None]]) -> None:
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is None:
            continue
        rank = len(tt.shape.dim) if tt.HasField("shape") else None
        out[vi.name] = (tt.elem_type, rank)
    for init in graph.initializer:
        out.setdefault(init.name, (init.data_type, len(init.dims)))
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _collect_types(sub, out)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    # Shape inference gives the dtypes and ranks of intermediate tensors. Models it cannot
    # handle (over 2 GB, unknown custom ops in strict mode) are checked on what they declare.
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # onnx raises several types; the declared types are still checkable
        return model


class _Walker:
    def __init__(self, model: onnx.ModelProto, support: ParserSupport, base_dir: Path | None) -> None:
        self.support = support
        self.base_dir = base_dir
        self.types: dict[str, tuple[int, int | None]] = {}
        _collect_types(model.graph, self.types)
        self.functions = {(f.domain, f.name): f for f in model.functions}
        self.ops: Counter[str] = Counter()
        self.restrictions: list[dict[str, str]] = []
        self.nodes = 0

    def walk(
        self,
        nodes: list[onnx.NodeProto],
        initializers: list[onnx.TensorProto],
        parent: _Facts | None,
        seen: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        facts = _Facts(nodes, initializers, self.types, self.base_dir, parent)
        for node in nodes:
            self.nodes += 1
            key = (node.domain, node.op_type)
            if key in self.functions and key not in seen:
                # The parser inlines model-local functions (unless a plugin of that name exists).
                body = self.functions[key]
                self.walk(list(body.node), [], facts, seen | {key})
            elif node.domain in _DEFAULT_DOMAINS:
                if node.op_type not in self.support.supported:
                    self.ops[node.op_type] += 1
                else:
                    for problem in node_problems(node, facts, self.support):
                        self.restrictions.append({"op": node.op_type, "node": node.name, "problem": problem})
            elif key not in self.support.custom_domain_ops:
                self.ops[f"{node.domain}::{node.op_type}"] += 1
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for sub in subgraphs:
                    self.walk(list(sub.node), list(sub.initializer), facts, seen)


def _dtype_problems(
    model: onnx.ModelProto, types: dict[str, tuple[int, int | None]], support: ParserSupport
) -> tuple[list[dict[str, str]], list[str]]:
    io = {vi.name for vi in [*model.graph.input, *model.graph.output]}
    problems = []
    doubles = []
    for name, (elem, _) in sorted(types.items()):
        if not elem:
            continue
        dtype = _type_name(elem)
        if dtype == "DOUBLE":
            doubles.append(name)
        elif dtype in support.io_only_types and name not in io:
            problems.append(
                {"tensor": name, "dtype": dtype, "problem": f"{dtype} is only supported on network inputs and outputs"}
            )
        elif dtype not in support.tensor_types:
            problems.append({"tensor": name, "dtype": dtype, "problem": f"TensorRT has no {dtype} tensors"})
    warnings = []
    if doubles:
        warnings.append(
            f"{len(doubles)} DOUBLE tensors (e.g. {doubles[0]!r}): {support.notes.get('DOUBLE', 'cast down to FLOAT')}"
        )
    return problems, warnings


def preflight(model: onnx.ModelProto | Path, *, tensorrt_major: int) -> PreflightReport:
    """Return what TensorRT ``tensorrt_major``.x's ONNX parser would refuse in ``model``."""
    base_dir = None
    if isinstance(model, Path):
        base_dir = model.parent
        model = load_onnx(model, load_external_data=False)
    support = parser_support(tensorrt_major)
    inferred = _infer(model)
    walker = _Walker(inferred, support, base_dir)
    walker.walk(list(inferred.graph.node), list(inferred.graph.initializer), None)
    opset = next((o.version for o in inferred.opset_import if o.domain in _DEFAULT_DOMAINS), None)
    restrictions = []
    if opset is not None and not support.opset_min <= opset <= support.opset_max:
        restrictions.append(
            {
                "op": "opset",
                "node": "",
                "problem": f"opset {opset} is outside TensorRT {support.describes}'s range {support.opset_min}-{support.opset_max}",
            }
        )
    dtypes, warnings = _dtype_problems(inferred, walker.types, support)
    return PreflightReport(
        tensorrt=support.describes,
        opset=opset,
        nodes=walker.nodes,
        ops=dict(sorted(walker.ops.items())),
        restrictions=restrictions + walker.restrictions,
        dtypes=dtypes,
        warnings=warnings,
    )


def require_tensorrt_support(model: onnx.ModelProto | Path, *, tensorrt_major: int) -> PreflightReport:
    """Return the pre-flight report; UNSUPPORTED_OPS with the op list when TensorRT would refuse the model."""
    report = preflight(model, tensorrt_major=tensorrt_major)
    raise_if_unsupported(report)
    return report


def raise_if_unsupported(report: PreflightReport) -> None:
    """Raise UNSUPPORTED_OPS with the op list when ``report`` says TensorRT would refuse the model."""
    if not report.ok:
        raise UnsupportedOps(
            f"TensorRT {report.tensorrt}'s ONNX parser cannot import this model: {report.summary()}",
            hint=(
                "Re-export without these ops (another opset, torch.onnx with dynamo, constant folding "
                "with onnxslim often removes shape-only ops), or compile for onnxruntime / openvino, "
                "which run them. A TensorRT plugin with the op's name also works when the worker loads it."
            ),
            **report.to_dict(),
        )
