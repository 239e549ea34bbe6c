"""The pass contract: a named, in-place rewrite of an onnx_ir model that says whether it changed anything.

Kiln's passes are onnx_ir passes (``onnx_ir.passes.InPlacePass``) with a stable ``name`` for
reports and error messages. Most wrap a library pass or a set of onnxscript rewrite rules;
the few written here say why no library does the job.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import ClassVar

import onnx_ir as ir
from onnx_ir.passes import PassResult

__all__ = ["KilnPass", "PassResult", "SequencePass", "count_nodes", "op_types", "opset_version", "quiet_logger"]


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.as_graph()
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.as_graphs()


def _count(graph: ir.Graph) -> int:
    # Plain loops: onnx_ir's RecursiveGraphIterator costs more than the passes on small graphs,
    # and the manager counts around every pass.
    total = len(graph)
    for node in graph:
        if node.op_type in _CONTROL_FLOW:
            total += sum(_count(g) for g in _subgraphs(node))
    return total


#: Ops whose attributes hold subgraphs (onnx and onnxruntime's contrib ops).
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def count_nodes(model: ir.Model) -> int:
    """Return the number of nodes in the model, subgraphs (If/Loop/Scan bodies) included."""
    return _count(model.graph)


def op_types(model: ir.Model) -> set[str]:
    """Return the op types used anywhere in the model's graphs (functions excluded)."""
    return {node.op_type for graph in model.graphs() for node in graph}


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise logger ``name`` to ``level`` for the duration: library chatter an operator cannot act on."""
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(old)


def opset_version(model: ir.Model, domain: str = "") -> int:
    """Return the model's opset for ``domain`` (0 when it does not import that domain)."""
    version = model.opset_imports.get(domain)
    if version is None and domain == "":
        version = model.opset_imports.get("ai.onnx")
    return int(version or 0)


class KilnPass(ir.passes.InPlacePass):
    """A named in-place pass; ``call`` returns ``PassResult(model, modified)``."""

    #: Stable identifier used in reports, provenance manifests and errors.
    name: ClassVar[str] = ""
    #: One line for ``kiln`` listings and the docs.
    summary: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __str__(self) -> str:
        return self.name


class SequencePass(KilnPass):
    """Run library passes one after the other as one named Kiln pass."""

    def passes(self) -> list[ir.passes.PassBase]:
        """Return fresh library pass instances (library passes may keep per-run state)."""
        raise NotImplementedError

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for inner in self.passes():
            result = inner(model)
            # Every pass Kiln wraps is in place; onnx_ir's __call__ has already enforced it.
            modified = modified or result.modified
        return PassResult(model, modified)
