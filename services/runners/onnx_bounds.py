"""What values a model's integer inputs may take, read from the model itself: vocabularies of id inputs.

Generated parity inputs must exercise the model: token ids drawn from a handful of values
touch a handful of embedding rows, so a converter that broke the rest of the table would pass.
The valid range of an id input is the size of the embedding table it indexes; an ONNX graph
says so directly (a ``Gather`` whose indices come from the input, through casts and reshapes,
and whose data is a weight), a Hugging Face checkpoint in its ``config.json``. Where no bound
can be read, ids stay in a small safe range and the provenance says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.runners.base import InputBound

__all__ = ["onnx_input_bounds"]

#: Ops an id passes through unchanged in value on its way to the embedding lookup.
_VALUE_PRESERVING = frozenset(
    {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose", "Slice", "Concat"}
)


def onnx_input_bounds(path: Path) -> dict[str, InputBound]:
    """Return the id bound of each integer input of the ONNX model at ``path`` that indexes a weight table.

    An input reaching several tables (word and position embeddings) gets the smallest.
    Weights are not loaded: the tables' shapes are in the graph.
    """
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # the reference step reports an unreadable model with the engine's own words
        return {}
    graph = model.graph
    tables: dict[str, tuple[int, ...]] = {i.name: tuple(i.dims) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.t is not None:
                    tables[node.output[0]] = tuple(attr.t.dims)
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    integer = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
    bounds: dict[str, InputBound] = {}
    for inp in graph.input:
        if inp.name in tables or inp.type.tensor_type.elem_type not in integer:
            continue
        found = _tables_reached(inp.name, consumers, tables)
        if found:
            high, gather = min(found)
            bounds[inp.name] = InputBound(high, f"the {high}-row table {gather!r} it indexes")
    return bounds


def _tables_reached(
    start: str, consumers: dict[str, list[Any]], tables: dict[str, tuple[int, ...]]
) -> list[tuple[int, str]]:
    """Return (rows, table name) of every weight table ``start`` indexes through value-preserving ops."""
    found: list[tuple[int, str]] = []
    seen = {start}
    frontier = [start]
    while frontier:
        name = frontier.pop()
        for node in consumers.get(name, ()):
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name:
                dims = tables.get(node.input[0])
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if dims and axis in (0, -len(dims)) and dims[0] > 0:
                    found.append((int(dims[0]), node.input[0]))
            elif node.op_type in _VALUE_PRESERVING and node.input and node.input[0] == name:
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return found
