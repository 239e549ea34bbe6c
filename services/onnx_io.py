"""Loading and saving ONNX models, with external data when a model outgrows protobuf's 2 GB."""

from __future__ import annotations

from pathlib import Path

import onnx
from google.protobuf.message import EncodeError
from onnx.external_data_helper import load_external_data_for_model

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


def save_onnx(model: onnx.ModelProto, path: Path, *, threshold: int = EXTERNAL_DATA_THRESHOLD) -> list[Path]:
    """Save ``model`` to ``path``, moving weights to ``<name>.data`` when it is too large; return the files.

    ``model`` is left as it was. (onnx's external-data save strips the weights out of the
    message it is given and points them at the file; callers keep using their model, e.g.
    the optimiser after the safety net saved the original for onnxruntime, so the weights
    are read back in.)
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if _too_large_for_one_file(model, threshold):
        data_name = path.name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
        load_external_data_for_model(model, str(path.parent))
        return [path, path.parent / data_name]
    onnx.save_model(model, str(path))
    return [path]


def _too_large_for_one_file(model: onnx.ModelProto, threshold: int) -> bool:
    """True when ``model`` must keep its weights in external data (near or past protobuf's 2 GiB)."""
    try:
        return model.ByteSize() > threshold
    except (ValueError, EncodeError):  # past 2 GiB protobuf cannot even measure it
        return True
