"""Message classes for the part of a foreign ``.proto`` that Kiln reads, built at run time.

Vetting a TensorFlow SavedModel needs a handful of TensorFlow's messages, and the API must
not import TensorFlow (or ship its generated modules) to read them. protobuf builds message
classes from a descriptor as well as from generated code; declaring only the fields Kiln
reads, with upstream's field numbers, parses any real file: the other fields are kept as
unknown fields and never looked at. A ``map<K, V>`` field is declared as the repeated
``{key = 1, value = 2}`` entry message it is on the wire.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Field", "message_classes"]

#: (field name, number, type, repeated, message type name for "message" fields)
Field = tuple[str, int, str, bool, str | None]


def message_classes(package: str, messages: dict[str, list[Field]]) -> dict[str, Any]:
    """Return a message class per entry of ``messages`` (proto3 semantics), keyed by its name."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name=f"kiln_{package}.proto", package=package, syntax="proto3")
    fd = descriptor_pb2.FieldDescriptorProto
    types = {
        "string": fd.TYPE_STRING,
        "bytes": fd.TYPE_BYTES,
        "int32": fd.TYPE_INT32,
        "int64": fd.TYPE_INT64,
        "bool": fd.TYPE_BOOL,
        "float": fd.TYPE_FLOAT,
        "message": fd.TYPE_MESSAGE,
    }
    for name, fields in messages.items():
        m = fdp.message_type.add(name=name)
        for fname, number, typ, repeated, ref in fields:
            f = m.field.add(name=fname, number=number, type=types[typ])
            f.label = fd.LABEL_REPEATED if repeated else fd.LABEL_OPTIONAL
            if ref is not None:
                f.type_name = f".{package}.{ref}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}")) for name in messages}
