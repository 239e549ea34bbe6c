"""Loading and saving ONNX models, with external data when a model outgrows protobuf's 2 GB."""

from __future__ import annotations

from pathlib import Path

import onnx

from services.errors import SourceUnreadable

__all__ = ["EXTERNAL_DATA_THRESHOLD", "load_onnx", "save_onnx"]

#: Protobuf refuses messages over 2 GiB; stay clear of it.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_onnx(path: Path, *, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX model (external data from beside it); SOURCE_UNREADABLE when it will not parse."""
    try:
        return onnx.load(str(path), load_external_data=load_external_data)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise SourceUnreadable(f"{Path(path).name} is not a readable ONNX model: {exc}") from exc


def save_onnx(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Save ``model`` to ``path``, moving weights to ``<name>.data`` when it is too large; return the files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        data_name = path.name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
        return [path, path.parent / data_name]
    onnx.save_model(model, str(path))
    return [path]
