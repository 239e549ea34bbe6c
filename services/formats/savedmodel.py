"""Vet a TensorFlow SavedModel's graphs before TensorFlow loads them.

A SavedModel is a program: its graph and every function in its library run inside the
process that loads it, and TensorFlow has ops that read and write files (``ReadFile``,
``WriteFile``, ``MatchingFiles``, readers, ``tf.data`` sources), print (``PrintV2``,
summaries), call back into Python (``PyFunc``, ``EagerPyFunc``) or talk to other machines
(RPC, collectives, the tf.data service, debugger streams). :func:`vet_savedmodel` reads
``saved_model.pb`` as data (no TensorFlow import: the messages are declared here with
TensorFlow's field numbers) and refuses, with UNSAFE_INPUT naming them, every op outside an
allowlist: the tensor-computation op families of TensorFlow (services/formats/savedmodel_ops.py,
generated from TensorFlow itself).

One exception is needed for real models: every SavedModel carries its saver, the graph
nodes and ``__inference__traced_save/restore`` functions that write and read its
``variables/`` checkpoint (``SaveV2``, ``RestoreV2``, ``MergeV2Checkpoints``,
``ShardedFilename``). Those ops are accepted only where nothing but the saver reaches them:
in graph nodes that the ``saver_def``'s save and restore ops depend on and that no
signature output or collection depends on, and in library functions called from those
nodes only. The same op in a serving function, an initializer or any other function is
refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from services.errors import SourceUnreadable, UnsafeInput
from services.formats._proto_subset import Field, message_classes
from services.formats.savedmodel_ops import ALLOWED_TF_OPS

__all__ = ["MAX_SAVED_MODEL_BYTES", "SAVER_OPS", "savedmodel_ops", "vet_savedmodel"]

MAX_SAVED_MODEL_BYTES = 2 << 30  # protobuf's own message limit

#: File ops the saver itself uses to write and read ``variables/``.
SAVER_OPS = frozenset(
    {"SaveV2", "RestoreV2", "MergeV2Checkpoints", "ShardedFilename", "ShardedFilespec", "Save", "Restore",
     "SaveSlices", "RestoreSlice"}
)  # fmt: skip

_HINT = (
    "Export the model without file, printing, Python-calling or network ops in its functions "
    "(no tf.io.read_file/write_file, tf.print, tf.py_function, tf.data or summaries in the "
    "serving function): tf.saved_model.save of the inference model."
)

_M, _S = "message", "string"
# TensorFlow's messages, the fields vetting reads (field numbers as in tensorflow/core/{framework,protobuf}).
_MESSAGES: dict[str, list[Field]] = {
    "SavedModel": [("meta_graphs", 2, _M, True, "MetaGraphDef")],
    "MetaGraphDef": [
        ("graph_def", 2, _M, False, "GraphDef"),
        ("saver_def", 3, _M, False, "SaverDef"),
        ("collection_def", 4, _M, True, "CollectionEntry"),
        ("signature_def", 5, _M, True, "SignatureEntry"),
    ],
    "CollectionEntry": [("key", 1, _S, False, None), ("value", 2, _M, False, "CollectionDef")],
    "CollectionDef": [("node_list", 1, _M, False, "NodeList")],
    "NodeList": [("value", 1, _S, True, None)],
    "SignatureEntry": [("key", 1, _S, False, None), ("value", 2, _M, False, "SignatureDef")],
    "SignatureDef": [("outputs", 2, _M, True, "TensorInfoEntry")],
    "TensorInfoEntry": [("key", 1, _S, False, None), ("value", 2, _M, False, "TensorInfo")],
    "TensorInfo": [("name", 1, _S, False, None)],
    "SaverDef": [
        ("filename_tensor_name", 1, _S, False, None),
        ("save_tensor_name", 2, _S, False, None),
        ("restore_op_name", 3, _S, False, None),
    ],
    "GraphDef": [("node", 1, _M, True, "NodeDef"), ("library", 2, _M, False, "FunctionDefLibrary")],
    "NodeDef": [
        ("name", 1, _S, False, None),
        ("op", 2, _S, False, None),
        ("input", 3, _S, True, None),
        ("attr", 5, _M, True, "AttrEntry"),
    ],
    "AttrEntry": [("key", 1, _S, False, None), ("value", 2, _M, False, "AttrValue")],
    "AttrValue": [("list", 1, _M, False, "ListValue"), ("func", 10, _M, False, "NameAttrList")],
    "ListValue": [("func", 9, _M, True, "NameAttrList")],
    "NameAttrList": [("name", 1, _S, False, None), ("attr", 2, _M, True, "AttrEntry")],
    "FunctionDefLibrary": [("function", 1, _M, True, "FunctionDef")],
    "FunctionDef": [("signature", 1, _M, False, "OpDef"), ("node_def", 3, _M, True, "NodeDef")],
    "OpDef": [("name", 1, _S, False, None)],
}


@cache
def _messages() -> dict[str, Any]:
    return message_classes("kiln_tf", _MESSAGES)


@dataclass
class _Graph:
    """One MetaGraph: its main graph's nodes and its library's functions."""

    nodes: dict[str, Any]
    functions: dict[str, Any]
    roots: set[str] = field(default_factory=set)  # what serving and initialisation fetch
    saver: set[str] = field(default_factory=set)  # what the saver's save and restore ops fetch


def _node_name(tensor: str) -> str:
    return tensor.lstrip("^").split(":", 1)[0]


def _attr_functions(attrs: Iterable[Any]) -> Iterator[str]:
    """Yield the function names an attribute map refers to (``f``, ``body``, ``branches``, nested)."""
    for entry in attrs:
        value = entry.value
        if value.HasField("func"):
            yield value.func.name
            yield from _attr_functions(value.func.attr)
        if value.HasField("list"):
            for func in value.list.func:
                yield func.name
                yield from _attr_functions(func.attr)


def _calls(node: Any, functions: dict[str, Any]) -> set[str]:
    """Return the library functions ``node`` calls (through attributes, or as its op)."""
    called = set(_attr_functions(node.attr))
    if node.op in functions:
        called.add(node.op)
    return {f for f in called if f in functions}


def _closure(nodes: dict[str, Any], start: Iterable[str]) -> set[str]:
    """Return the main-graph nodes ``start`` depends on, itself included (data and control inputs)."""
    seen: set[str] = set()
    todo = [n for n in start if n in nodes]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(i for i in (_node_name(t) for t in nodes[name].input) if i in nodes and i not in seen)
    return seen


def _reach(functions: dict[str, Any], start: Iterable[str]) -> set[str]:
    """Return the library functions reachable from ``start`` (themselves included)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in functions[name].node_def:
            todo.extend(_calls(node, functions) - seen)
    return seen


def _graphs(model: Any) -> Iterator[_Graph]:
    for meta in model.meta_graphs:
        graph = meta.graph_def
        g = _Graph(
            nodes={n.name: n for n in graph.node},
            functions={f.signature.name: f for f in graph.library.function},
        )
        for sig in meta.signature_def:
            g.roots.update(_node_name(out.value.name) for out in sig.value.outputs)
        for coll in meta.collection_def:
            g.roots.update(_node_name(v) for v in coll.value.node_list.value)
        saver = meta.saver_def
        g.saver.update(
            _node_name(t) for t in (saver.filename_tensor_name, saver.save_tensor_name, saver.restore_op_name) if t
        )
        yield g


def savedmodel_ops(model: Any) -> dict[str, set[str]]:
    """Return each op a parsed SavedModel uses outside the saver and where: ``{op: {"graph", function names}}``.

    Saver ops (:data:`SAVER_OPS`) used only by the saver are left out; everything else is in.
    """
    used: dict[str, set[str]] = {}
    for g in _graphs(model):
        served = _closure(g.nodes, g.roots)
        saver_only = _closure(g.nodes, g.saver) - served
        others = [n for name, n in g.nodes.items() if name not in saver_only]
        from_saver = _reach(g.functions, (f for n in saver_only for f in _calls(g.nodes[n], g.functions)))
        strict_roots = {f for n in others for f in _calls(n, g.functions)} | (set(g.functions) - from_saver)
        saver_functions = from_saver - _reach(g.functions, strict_roots)
        for name, node in g.nodes.items():
            if not (name in saver_only and node.op in SAVER_OPS):
                used.setdefault(node.op, set()).add("graph")
        for fname, func in g.functions.items():
            for node in func.node_def:
                if not (fname in saver_functions and node.op in SAVER_OPS):
                    used.setdefault(node.op, set()).add(fname)
        for fname in g.functions:  # a node whose op is a library function calls it; that is allowed
            used.pop(fname, None)
    return used


def _parse(pb: Path) -> Any:
    msg = _messages()["SavedModel"]()
    size = pb.stat().st_size
    if size > MAX_SAVED_MODEL_BYTES:
        raise UnsafeInput(f"{pb.name} is {size} bytes; Kiln reads SavedModels up to {MAX_SAVED_MODEL_BYTES} bytes")
    try:
        if pb.suffix == ".pbtxt":
            from google.protobuf import text_format

            text_format.Parse(pb.read_text(), msg, allow_unknown_field=True, allow_unknown_extension=True)
        else:
            msg.ParseFromString(pb.read_bytes())
    except Exception as exc:  # DecodeError, ParseError, RecursionError, UnicodeDecodeError
        raise SourceUnreadable(
            f"{pb.name} is not a readable SavedModel: {str(exc)[:200]}",
            hint="Save the model again with tf.saved_model.save (or model.export for Keras).",
        ) from exc
    if not msg.meta_graphs:
        raise SourceUnreadable(f"{pb.name} holds no MetaGraph", hint="Save the model with tf.saved_model.save.")
    return msg


def vet_savedmodel(directory: Path) -> None:
    """Refuse (UNSAFE_INPUT) a SavedModel directory whose graphs use an op outside the allowlist."""
    pb = directory / "saved_model.pb"
    if not pb.exists():
        pb = directory / "saved_model.pbtxt"
    if not pb.exists():
        raise SourceUnreadable(f"{directory.name} has no saved_model.pb")
    used = savedmodel_ops(_parse(pb))
    refused = {op: where for op, where in used.items() if op not in ALLOWED_TF_OPS}
    if refused:
        ops = sorted(refused)
        places = sorted({w for where in refused.values() for w in where})
        raise UnsafeInput(
            f"the SavedModel uses ops that Kiln does not run on uploads (file, network, process, printing or "
            f"Python-calling ops, or ops outside TensorFlow's tensor computations): {', '.join(ops)} "
            f"(in {', '.join(places[:5])}{', ...' if len(places) > 5 else ''})",
            hint=_HINT,
            ops=ops,
            functions=places[:20],
        )
