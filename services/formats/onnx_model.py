"""Vet an ONNX model before an engine loads it: standard operator domains, weights inside its folder.

An ONNX graph is data, but two of its features reach outside it when a runtime loads it:

- nodes of a custom operator domain run whatever the process registered under that domain:
  onnxruntime-extensions' ``ai.onnx.contrib`` runs Python functions (``PyOp``), and any
  other domain needs a custom-op library that some runtime loads;
- an initializer's external data names a file that the loader reads into the tensor, and a
  ``location`` of ``/proc/self/environ`` or ``../../secret`` would put that file's bytes in
  the model.

:func:`vet_onnx` reads the model without its weights and refuses, with UNSAFE_INPUT naming
them, nodes outside the allowed domains (:data:`ALLOWED_DOMAINS`: the ONNX standard and
ONNX-ML sets and onnxruntime's built-in contrib operators, plus the model's own local
functions, whose bodies are vetted alike), in the main graph, every subgraph (If, Loop, Scan)
and every function; and external data, of any tensor (initializers, node attributes, sparse
ones, inside subgraphs and local functions), that is absolute, climbs out with ``..`` or
resolves (through links) outside the model's folder. A file that does not parse as a
ModelProto is refused (SOURCE_UNREADABLE), never passed on to a loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from services.errors import UnsafeInput

__all__ = ["ALLOWED_DOMAINS", "onnx_custom_ops", "vet_onnx"]

#: Operator domains whose operators an engine implements itself: ONNX, ONNX-ML, ONNX's
#: training operators (Gradient, Adam, ...) and onnxruntime's contrib operators (com.microsoft,
#: and its NCHWc layout variants). An engine that lacks one says so (UNSUPPORTED_OPS).
ALLOWED_DOMAINS = frozenset(
    {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "com.microsoft", "com.microsoft.nchwc"}
)
_HINT = (
    "Export the model with standard ONNX operators only (no custom-op domains such as "
    "onnxruntime-extensions' ai.onnx.contrib), with any external weights beside the .onnx file."
)


def _subgraphs(node: Any) -> Iterator[Any]:
    import onnx

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _nodes(graphs: Iterable[Any]) -> Iterator[Any]:
    todo = list(graphs)
    while todo:
        graph = todo.pop()
        for node in graph.node:
            yield node
            todo.extend(_subgraphs(node))


def onnx_custom_ops(model: Any) -> list[str]:
    """Return ``domain::op`` for every node outside the allowed domains and the model's local functions."""
    local = {(f.domain, f.name) for f in model.functions}
    found: set[str] = set()
    bodies: list[Any] = [model.graph]
    functions = list(model.functions)
    nodes = list(_nodes(bodies))
    for func in functions:
        nodes.extend(func.node)
        for node in func.node:
            nodes.extend(_nodes(_subgraphs(node)))
    for node in nodes:
        if node.domain not in ALLOWED_DOMAINS and (node.domain, node.op_type) not in local:
            found.add(f"{node.domain}::{node.op_type}")
    return sorted(found)


def _tensors(model: Any) -> Iterator[Any]:
    """Yield every tensor of the model: initializers, sparse ones and node attributes, in the main graph,
    every subgraph and every local function (a function's Constant may keep its value in external data)."""
    import onnx

    graphs = [model.graph]
    node_lists = [list(f.node) for f in model.functions]
    while graphs or node_lists:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield sparse.values
                yield sparse.indices
            nodes = list(graph.node)
        else:
            nodes = node_lists.pop()
        for node in nodes:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                elif attr.type == onnx.AttributeProto.SPARSE_TENSORS:
                    for sparse in attr.sparse_tensors:
                        yield sparse.values
                        yield sparse.indices
            graphs.extend(_subgraphs(node))


def _check_external_data(model: Any, folder: Path) -> None:
    import onnx

    root = folder.resolve()
    for tensor in _tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        rel = PurePosixPath(location.replace("\\", "/"))
        escapes = not location or rel.is_absolute() or ".." in rel.parts or location.startswith("~")
        if not escapes:
            target = (folder / rel).resolve()
            escapes = target != root and root not in target.parents
        if escapes:
            raise UnsafeInput(
                f"ONNX tensor {tensor.name!r} keeps its data in {location!r}, outside the model's folder",
                hint="Keep external data files beside the .onnx file (onnx.save_model(..., location='model.data')).",
                tensor=tensor.name,
            )


def vet_onnx(path: Path) -> None:
    """Refuse (UNSAFE_INPUT) an ONNX model with custom-domain operators or external data outside its folder."""
    from services.onnx_io import load_onnx

    # A file protobuf cannot parse as a ModelProto is refused here (SOURCE_UNREADABLE): what vetting
    # cannot read, no loader is given.
    model = load_onnx(path, load_external_data=False)
    custom = onnx_custom_ops(model)
    if custom:
        raise UnsafeInput(
            f"{path.name} uses operators of custom domains, which run code registered outside the model "
            f"(onnxruntime-extensions' ai.onnx.contrib runs Python): {', '.join(custom)}",
            hint=_HINT,
            ops=custom,
        )
    _check_external_data(model, path.parent)
