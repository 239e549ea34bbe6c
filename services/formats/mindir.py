"""MindSpore MindIR models (``.mindir``), detected from content and vetted before MindSpore loads them.

A MindIR file is a protobuf ``mind_ir.ModelProto``: the compiled graph, its primitives and
its weights. Detection reads only its first bytes (``ir_version`` then ``producer_name``
"MindSpore"), so the API never imports MindSpore. At submission :func:`vet_mindir_upload`
parses the whole file with the part of ``mind_ir.proto`` declared here (no MindSpore); the
runner's :func:`vet_mindir` parses it again with MindSpore's own ``mind_ir_pb2`` (plain
protobuf, no graph compiler); both refuse, in the main graph, every function and every graph
nested in an attribute, what would make MindSpore reach outside the file when it loads or runs it:

- ``Custom`` operators (AOT kernels name a shared library to dlopen; ``pyfunc`` ones a Python
  function), ``PyFunc``/``PyExecute``/``ScriptFunc`` primitives, and a graph that names a
  ``bprop_filepath``: UNSAFE_INPUT;
- tensors whose data lives in external files (a path Kiln did not receive), parameters,
  map parameters and attribute tensors alike: UNSAFE_INPUT;
- a data-preprocessing pipeline (it names dataset files and operations): UNSAFE_INPUT;
- encrypted or oversized files: UNSUPPORTED_FORMAT / UNSAFE_INPUT.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from services.errors import EngineUnavailable, SourceUnreadable, UnsafeInput
from services.formats._proto_subset import Field, message_classes

__all__ = ["MAX_MINDIR_BYTES", "looks_like_mindir", "mindir_proto", "sniff_mindir", "vet_mindir", "vet_mindir_upload"]

MAX_MINDIR_BYTES = 2 << 30  # protobuf's own message limit

#: Primitives that run code from outside the file (a shared library, a Python function).
CODE_PRIMITIVES = frozenset({"Custom", "PyFunc", "PyExecute", "ScriptFunc", "PyInterpret", "CustomAOT"})


def looks_like_mindir(head: bytes) -> bool:
    """Return True when ``head`` starts a MindIR ModelProto (ir_version string, producer MindSpore)."""
    # Field 1 (ir_version, a short string): tag 0x0a, then its length; field 2 (producer_name).
    if len(head) < 16 or head[0] != 0x0A or head[1] > 16:
        return False
    rest = head[2 + head[1] :]
    return rest[:1] == b"\x12" and rest[2 : 2 + 9] == b"MindSpore"


def sniff_mindir(path: Path) -> str | None:
    """Return what detection saw when ``path`` is a MindIR file (read from its header only), else None."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        head = f.read(64)
    return "protobuf with producer MindSpore (MindIR ModelProto)" if looks_like_mindir(head) else None


def mindir_proto() -> Any:
    """Return MindSpore's ``mind_ir_pb2`` module (ENGINE_UNAVAILABLE without MindSpore)."""
    try:
        from mindspore.train import mind_ir_pb2
    except ImportError as exc:
        raise EngineUnavailable(
            "MindSpore is not installed here: it reads MindIR sources",
            hint="Install Kiln's mindspore extra (pip install 'kiln[mindspore]') in the worker that reads the source.",
        ) from exc
    return mind_ir_pb2


_M, _B = "message", "bytes"
#: mind_ir.proto's messages, the fields vetting reads (MindSpore's field numbers; strings read as bytes,
#: as MindSpore's proto2 parser does, so a name that is not UTF-8 is no reason to refuse).
_MESSAGES: dict[str, list[Field]] = {
    "ModelProto": [
        ("graph", 7, _M, False, "GraphProto"),
        ("functions", 8, _M, True, "GraphProto"),
        ("preprocessor", 9, _M, False, "PreprocessorProto"),
        ("primitives", 12, _M, True, "PrimitiveProto"),
    ],
    "GraphProto": [
        ("node", 1, _M, True, "NodeProto"),
        ("name", 2, _B, False, None),
        ("parameter", 3, _M, True, "TensorProto"),
        ("attribute", 8, _M, True, "AttributeProto"),
        ("bprop_filepath", 9, _B, False, None),
        ("map_parameter", 10, _M, True, "MapTensorProto"),
    ],
    "NodeProto": [
        ("name", 3, _B, False, None),
        ("op_type", 4, _B, False, None),
        ("attribute", 5, _M, True, "AttributeProto"),
        ("node_attr", 8, _M, True, "AttributeProto"),
        ("primal_attr", 9, _M, True, "AttributeProto"),
    ],
    "AttributeProto": [
        ("t", 6, _M, False, "TensorProto"),
        ("g", 7, _M, False, "GraphProto"),
        ("tensors", 12, _M, True, "TensorProto"),
        ("graphs", 13, _M, True, "GraphProto"),
        ("values", 17, _M, True, "AttributeProto"),
    ],
    "TensorProto": [("name", 7, _B, False, None), ("external_data", 12, _M, False, "ExternalDataProto")],
    "ExternalDataProto": [("location", 1, _B, False, None)],
    "MapTensorProto": [
        ("name", 1, _B, False, None),
        ("default_value", 2, _M, False, "AttributeProto"),
        ("key_tensor", 3, _M, False, "TensorProto"),
        ("value_tensor", 4, _M, False, "TensorProto"),
        ("status_tensor", 5, _M, False, "TensorProto"),
    ],
    "PrimitiveProto": [
        ("name", 1, _B, False, None),
        ("op_type", 2, _B, False, None),
        ("attribute", 3, _M, True, "AttributeProto"),
    ],
    "PreprocessorProto": [("op", 1, _M, True, "PreprocessOpProto")],
    "PreprocessOpProto": [("op_type", 4, _B, False, None)],
}
_CODE_HINT = "Kiln never runs code from a model; export the network without custom operators."


@cache
def _messages() -> dict[str, Any]:
    return message_classes("kiln_mind_ir", _MESSAGES)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _parse(path: Path, model: Any) -> Any:
    size = path.stat().st_size
    if size > MAX_MINDIR_BYTES:
        raise UnsafeInput(f"{path.name} is {size} bytes; Kiln reads MindIR files up to {MAX_MINDIR_BYTES} bytes")
    try:
        model.ParseFromString(path.read_bytes())
    except Exception as exc:  # DecodeError, RecursionError
        raise SourceUnreadable(
            f"{path.name} is not a MindIR ModelProto (or it is encrypted): {str(exc)[:200]}",
            hint="Export with mindspore.export(net, x, file_format='MINDIR') and no enc_key.",
        ) from exc
    if not model.HasField("graph") or not len(model.graph.node):
        raise SourceUnreadable(f"{path.name} holds no graph", hint="Export the network with mindspore.export.")
    return model


def _attribute_parts(attrs: Any) -> tuple[list[Any], list[Any]]:
    """Return the graphs and tensors held by attributes (nested ``values`` included), without recursion."""
    graphs: list[Any] = []
    tensors: list[Any] = []
    todo = list(attrs)
    while todo:
        attr = todo.pop()
        if attr.HasField("g"):
            graphs.append(attr.g)
        graphs.extend(attr.graphs)
        if attr.HasField("t"):
            tensors.append(attr.t)
        tensors.extend(attr.tensors)
        todo.extend(attr.values)
    return graphs, tensors


def _check(path: Path, model: Any) -> None:
    """Refuse what would make MindSpore reach outside the file (code, other files) anywhere in ``model``."""
    if len(model.preprocessor.op):
        raise UnsafeInput(
            f"{path.name} carries a data-preprocessing pipeline ({_text(model.preprocessor.op[0].op_type)}, ...), "
            "which names files and dataset operations",
            hint="Export the network alone (mindspore.export without a dataset).",
        )
    graphs = [model.graph, *model.functions]
    tensors: list[Any] = []
    for prim in model.primitives:
        op = _text(prim.op_type)
        if op in CODE_PRIMITIVES:
            raise UnsafeInput(
                f"{path.name} uses a {op} operator ({_text(prim.name)}): MindSpore would load code "
                "(a shared library or a Python function) to run it",
                hint=_CODE_HINT,
                ops=[op],
            )
        g, t = _attribute_parts(prim.attribute)
        graphs.extend(g)
        tensors.extend(t)
    while graphs:  # every graph, nested ones included, without recursion
        graph = graphs.pop()
        if graph.bprop_filepath:
            name, where = _text(graph.name), _text(graph.bprop_filepath)
            raise UnsafeInput(f"{path.name}: graph {name!r} names a bprop file ({where!r})", hint=_CODE_HINT)
        tensors.extend(graph.parameter)
        attrs = list(graph.attribute)
        for mp in graph.map_parameter:
            tensors.extend((mp.key_tensor, mp.value_tensor, mp.status_tensor))
            attrs.append(mp.default_value)
        for node in graph.node:
            op = _text(node.op_type).removeprefix("REF::").split(":")[0]
            if op in CODE_PRIMITIVES:
                raise UnsafeInput(f"{path.name} uses a {op} operator, which would load code", hint=_CODE_HINT, ops=[op])
            attrs.extend((*node.attribute, *node.node_attr, *node.primal_attr))
        g, t = _attribute_parts(attrs)
        graphs.extend(g)
        tensors.extend(t)
    for tensor in tensors:
        if tensor.HasField("external_data") and tensor.external_data.location:
            raise UnsafeInput(
                f"{path.name}: tensor {_text(tensor.name)!r} keeps its data in an external file",
                hint="Export the model with its weights inside the .mindir (under 2 GiB).",
            )


def vet_mindir_upload(path: Path) -> None:
    """Vet a MindIR upload at submission, without MindSpore (the format's ``vet``): UNSAFE_INPUT as :func:`vet_mindir`."""
    _check(path, _parse(path, _messages()["ModelProto"]()))


def vet_mindir(path: Path) -> Any:
    """Return the parsed ModelProto of ``path`` (MindSpore's own message) after refusing what would run code or read other files."""
    model = _parse(path, mindir_proto().ModelProto())
    _check(path, model)
    return model
