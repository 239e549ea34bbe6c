"""Refuse Keras files that carry Python code, reading their config without deserializing it.

A Keras ``Lambda`` layer stores its function as marshalled Python bytecode (base64 in the
config); deserializing it runs that code. Keras' safe mode refuses it too, but only once
loading has begun, and older ``.h5`` configs pass through other paths. Kiln decides before
any Keras object exists: the ``.keras`` archive's ``config.json`` and the ``.h5`` file's
``model_config`` attribute are plain JSON, so they are parsed as JSON and walked.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.errors import SourceUnreadable, UnsafeInput

__all__ = ["UNSAFE_HINT", "check_keras_file", "find_code_payloads", "read_keras_config"]

UNSAFE_HINT = (
    "Replace the Lambda layer with a registered custom layer "
    "(@keras.saving.register_keras_serializable) or submit a TF SavedModel export of the model "
    "(model.export(path)); Kiln never runs code stored in a model."
)

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"

#: Serialized function kinds that hold bytecode rather than a name Keras resolves.
_CODE_CLASS_NAMES = {"__lambda__"}
#: tf.keras 2.x wrote Lambda functions as [bytecode, defaults, closure] with this marker.
_CODE_FUNCTION_TYPES = {"lambda", "raw"}


def read_keras_config(path: Path) -> dict[str, Any]:
    """Return the model config of a ``.keras`` archive or ``.h5`` file as plain JSON."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if head == HDF5_MAGIC:
            return _h5_config(path)
        with zipfile.ZipFile(path) as zf:
            raw = zf.read("config.json")
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise SourceUnreadable(f"{path.name} has no readable Keras model config: {exc}") from exc
    return _parse(raw, path)


def _h5_config(path: Path) -> dict[str, Any]:
    import h5py  # shipped with keras; reading an attribute runs no model code

    with h5py.File(path, "r") as f:
        raw = f.attrs.get("model_config")
    if raw is None:
        raise SourceUnreadable(
            f"{path.name} is an HDF5 file without a model_config (weights only?)",
            hint="Save the whole model (model.save('model.keras')), not only its weights.",
        )
    return _parse(raw, path)


def _parse(raw: bytes | str, path: Path) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceUnreadable(f"{path.name}: the Keras model config is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise SourceUnreadable(f"{path.name}: the Keras model config is not a JSON object")
    return config


def _walk(node: Any, trail: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    if isinstance(node, dict):
        inner = node.get("config")
        name = node.get("name") or (inner.get("name") if isinstance(inner, dict) else None)
        here = (*trail, str(name)) if name and "class_name" in node else trail
        yield here, node
        for value in node.values():
            yield from _walk(value, here)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value, trail)


def find_code_payloads(config: dict[str, Any]) -> list[str]:
    """Return a description of every place in a Keras config that holds Python code."""
    found: list[str] = []
    for trail, node in _walk(config, ()):
        where = "/".join(trail) or "(model)"
        cls = node.get("class_name")
        if cls == "Lambda":
            found.append(f"Lambda layer {where}")
        elif cls in _CODE_CLASS_NAMES:
            found.append(f"Python lambda bytecode in {where}")
        elif node.get("function_type") in _CODE_FUNCTION_TYPES:
            found.append(f"marshalled Python function in {where}")
    return list(dict.fromkeys(found))


def check_keras_file(path: Path) -> dict[str, Any]:
    """Return the file's model config; UNSAFE_INPUT when any layer carries Python code."""
    config = read_keras_config(path)
    payloads = find_code_payloads(config)
    if payloads:
        raise UnsafeInput(
            f"{Path(path).name} carries Python code that loading would run: {'; '.join(payloads[:5])}",
            hint=UNSAFE_HINT,
            payloads=payloads,
        )
    return config
