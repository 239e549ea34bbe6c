"""MindSpore MindIR models (``.mindir``), detected from content and vetted before MindSpore loads them.

A MindIR file is a protobuf ``mind_ir.ModelProto``: the compiled graph, its primitives and
its weights. Detection reads only its first bytes (``ir_version`` then ``producer_name``
"MindSpore"), so the API never imports MindSpore. :func:`vet_mindir` parses the whole file
with MindSpore's own ``mind_ir_pb2`` (plain protobuf, no graph compiler) and refuses what
would make MindSpore reach outside the file when it loads or runs it:

- ``Custom`` operators (AOT kernels name a shared library to dlopen; ``pyfunc`` ones a Python
  function), ``PyFunc``/``PyExecute``/``ScriptFunc`` primitives, and a graph that names a
  ``bprop_filepath``: UNSAFE_INPUT;
- tensors whose data lives in external files (a path Kiln did not receive): UNSAFE_INPUT;
- encrypted or oversized files: UNSUPPORTED_FORMAT / UNSAFE_INPUT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.errors import EngineUnavailable, SourceUnreadable, UnsafeInput

__all__ = ["MAX_MINDIR_BYTES", "looks_like_mindir", "mindir_proto", "sniff_mindir", "vet_mindir"]

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


def vet_mindir(path: Path) -> Any:
    """Return the parsed ModelProto of ``path`` after refusing what would run code or read other files."""
    size = path.stat().st_size
    if size > MAX_MINDIR_BYTES:
        raise UnsafeInput(f"{path.name} is {size} bytes; Kiln reads MindIR files up to {MAX_MINDIR_BYTES} bytes")
    pb = mindir_proto()
    model = pb.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except Exception as exc:  # DecodeError, RecursionError
        raise SourceUnreadable(
            f"{path.name} is not a MindIR ModelProto (or it is encrypted): {str(exc)[:200]}",
            hint="Export with mindspore.export(net, x, file_format='MINDIR') and no enc_key.",
        ) from exc
    if not model.HasField("graph") or not len(model.graph.node):
        raise SourceUnreadable(f"{path.name} holds no graph", hint="Export the network with mindspore.export.")
    graphs = [model.graph, *model.functions]
    for graph in graphs:
        if graph.bprop_filepath:
            raise UnsafeInput(f"{path.name}: graph {graph.name!r} names a bprop file ({graph.bprop_filepath!r})")
        for tensor in graph.parameter:
            if tensor.HasField("external_data") and tensor.external_data.location:
                raise UnsafeInput(
                    f"{path.name}: parameter {tensor.name!r} keeps its data in an external file",
                    hint="Export the model with its weights inside the .mindir (under 2 GiB).",
                )
    for prim in model.primitives:
        if prim.op_type in CODE_PRIMITIVES:
            raise UnsafeInput(
                f"{path.name} uses a {prim.op_type} operator ({prim.name}): MindSpore would load code "
                "(a shared library or a Python function) to run it",
                hint="Kiln never runs code from a model; export the network without custom operators.",
            )
    for graph in graphs:
        for node in graph.node:
            op = node.op_type.removeprefix("REF::").split(":")[0]
            if op in CODE_PRIMITIVES:
                raise UnsafeInput(f"{path.name} uses a {op} operator, which would load code")
    return model
