"""Vet a TFLite model before an interpreter loads it: built-in operators only.

A ``.tflite`` file is a FlatBuffer (``tflite.Model``) whose operators are TFLite's built-in
kernels or *custom* operators named by a string: whatever the loading process registered
under that name runs, and the ``Flex*`` custom operators hand a serialized TensorFlow
NodeDef to TensorFlow itself (``FlexReadFile``, ``FlexWriteFile``, ``FlexPrintV2``...).
:func:`vet_tflite` reads the operator table with the ``flatbuffers`` runtime (no TensorFlow
import) and refuses with UNSAFE_INPUT, naming them, every custom operator that is not one
of TFLite's own (:data:`ALLOWED_CUSTOM_OPS`). Flex operators are refused whole: the op they
run is in their options, not their name.
"""

from __future__ import annotations

import struct
from pathlib import Path

from services.errors import SourceUnreadable, UnsafeInput

__all__ = ["ALLOWED_CUSTOM_OPS", "tflite_custom_ops", "tflite_signatures", "vet_tflite"]

#: Custom operators whose kernels TFLite itself ships and registers (tflite::ops::custom).
ALLOWED_CUSTOM_OPS = frozenset({"TFLite_Detection_PostProcess"})
_CUSTOM = 32  # BuiltinOperator.CUSTOM
# Field slots (schema.fbs): Model.operator_codes is field 1; OperatorCode has
# deprecated_builtin_code (0, int8), custom_code (1, string) and builtin_code (3, int32).
_MODEL_OPERATOR_CODES = 1
_CODE_DEPRECATED, _CODE_CUSTOM, _CODE_BUILTIN = 0, 1, 3
_HINT = (
    "Convert without custom operators or SELECT_TF_OPS (tf.lite.TFLiteConverter with the default "
    "TFLITE_BUILTINS op set), or upload the SavedModel or Keras model instead."
)


def _slot(field: int) -> int:
    return 4 + 2 * field


def tflite_custom_ops(data: bytes) -> list[str]:
    """Return the names of the custom operators in a TFLite FlatBuffer (built-ins are not listed)."""
    from flatbuffers import encode, number_types, packer
    from flatbuffers.table import Table

    buf = bytearray(data)
    model = Table(buf, encode.Get(packer.uoffset, buf, 0))
    found: set[str] = set()
    o = model.Offset(_slot(_MODEL_OPERATOR_CODES))
    if not o:
        return []
    vec, count = model.Vector(o), model.VectorLen(o)
    for i in range(count):
        code = Table(buf, model.Indirect(vec + i * 4))
        dep = code.Offset(_slot(_CODE_DEPRECATED))
        builtin = code.Offset(_slot(_CODE_BUILTIN))
        op = max(
            code.Get(number_types.Int8Flags, code.Pos + dep) if dep else 0,
            code.Get(number_types.Int32Flags, code.Pos + builtin) if builtin else 0,
        )
        if op == _CUSTOM:
            name = code.Offset(_slot(_CODE_CUSTOM))
            found.add(code.String(code.Pos + name).decode("utf-8", "replace") if name else "<unnamed>")
    return sorted(found)


# schema.fbs: Model.subgraphs is field 2 and signature_defs field 7; SubGraph.tensors is 0;
# Tensor.name is 3; SignatureDef has inputs (0), outputs (1), signature_key (2), subgraph_index (4);
# TensorMap has name (0) and tensor_index (1).
_MODEL_SUBGRAPHS, _MODEL_SIGNATURES = 2, 7
_SUBGRAPH_TENSORS, _TENSOR_NAME = 0, 3
_SIG_INPUTS, _SIG_OUTPUTS, _SIG_KEY, _SIG_SUBGRAPH = 0, 1, 2, 4
_MAP_NAME, _MAP_INDEX = 0, 1


def tflite_signatures(data: bytes) -> dict[str, dict[str, dict[str, str]]]:
    """Return each signature's inputs and outputs: ``{key: {"inputs": {name: tensor name}, "outputs": {...}}}``.

    A signature names tensors by its own keys (``note``, ``onset``) and points at subgraph
    tensors by index; the tensor names (``StatefulPartitionedCall:1``) are what other readers
    of the file, OpenVINO's TFLite frontend among them, call them. Read with the ``flatbuffers``
    runtime, no TensorFlow. A model without signatures gives ``{}``.
    """
    from flatbuffers import encode, number_types, packer
    from flatbuffers.table import Table

    buf = bytearray(data)
    model = Table(buf, encode.Get(packer.uoffset, buf, 0))

    def tables(table: Table, field: int) -> list[Table]:
        o = table.Offset(_slot(field))
        if not o:
            return []
        vec = table.Vector(o)
        return [Table(buf, table.Indirect(vec + i * 4)) for i in range(table.VectorLen(o))]

    def string(table: Table, field: int) -> str:
        o = table.Offset(_slot(field))
        return table.String(table.Pos + o).decode("utf-8", "replace") if o else ""

    def uint(table: Table, field: int) -> int:
        o = table.Offset(_slot(field))
        return int(table.Get(number_types.Uint32Flags, table.Pos + o)) if o else 0

    subgraphs = tables(model, _MODEL_SUBGRAPHS)
    out: dict[str, dict[str, dict[str, str]]] = {}
    for sig in tables(model, _MODEL_SIGNATURES):
        tensors = tables(subgraphs[uint(sig, _SIG_SUBGRAPH)], _SUBGRAPH_TENSORS)
        out[string(sig, _SIG_KEY)] = {
            side: {string(m, _MAP_NAME): string(tensors[uint(m, _MAP_INDEX)], _TENSOR_NAME) for m in tables(sig, field)}
            for side, field in (("inputs", _SIG_INPUTS), ("outputs", _SIG_OUTPUTS))
        }
    return out


def vet_tflite(path: Path) -> None:
    """Refuse (UNSAFE_INPUT) a TFLite model with custom operators other than TFLite's own."""
    try:
        custom = tflite_custom_ops(path.read_bytes())
    except (IndexError, struct.error, ValueError) as exc:
        raise SourceUnreadable(f"{path.name} is not a readable TFLite FlatBuffer: {exc}") from exc
    refused = [op for op in custom if op not in ALLOWED_CUSTOM_OPS]
    if refused:
        raise UnsafeInput(
            f"{path.name} uses custom operators, which run code registered outside the model: {', '.join(refused)}",
            hint=_HINT,
            ops=refused,
        )
