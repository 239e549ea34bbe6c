"""MindIR models run by MindSpore itself (``nn.GraphCell``): the source's reference outputs.

MindSpore loads the compiled graph and runs it without the network's Python code. The file
is vetted first (:func:`services.formats.mindir.vet_mindir`). Names: MindIR prefixes every
value with its graph's name (``1_Net_construct:x``); inputs are reported by the part after
the last colon, outputs as ``output_0``, ``output_1``, ... (MindIR's own output names are
generated node ids), and the ONNX conversion uses the same names. A MindIR graph is
compiled for the shapes it was exported with, so every axis is fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.errors import EngineUnavailable, SourceUnreadable
from services.formats.mindir import vet_mindir
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["MindIRRunner", "mindir_signature"]

#: mind_ir TensorProto.DataType -> numpy dtype name.
DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool"}
DTYPES.update({10: "float16", 11: "float64", 12: "uint32", 13: "uint64"})


def public_name(name: str) -> str:
    """Return a MindIR value name without its graph prefix (``g:x`` -> ``x``)."""
    return name.rsplit(":", 1)[-1] if ":" in name else name


def mindir_signature(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Return the inputs and outputs of a parsed MindIR ModelProto as Kiln names them."""
    graph = model.graph
    inputs = []
    for vi in graph.input:
        t = vi.tensor[0] if len(vi.tensor) else None
        if t is None:
            raise SourceUnreadable(f"MindIR input {vi.name!r} carries no tensor type")
        inputs.append(
            TensorSpec(public_name(vi.name), DTYPES.get(t.data_type, "float32"), tuple(int(d) for d in t.dims))
        )
    # A network returning several tensors has one graph output, a tuple, whose member types are
    # in its attr_info (no `tensor` entries): every member is an output, numbered in order.
    found: list[Any] = []
    for vi in graph.output:
        tensors = list(vi.tensor)
        if not tensors and vi.HasField("attr_info"):
            tensors = [t for v in vi.attr_info.values for t in v.tensors]
        found.extend(tensors or [None])
    outputs = []
    for k, t in enumerate(found):
        dims = tuple(int(d) for d in t.dims) if t is not None else ()
        dtype = DTYPES.get(t.data_type, "float32") if t is not None else "float32"
        outputs.append(TensorSpec(f"output_{k}", dtype, dims))
    return inputs, outputs


class MindIRRunner(ModelRunner):
    """A vetted .mindir loaded with ``mindspore.load`` and run by ``nn.GraphCell`` on the CPU."""

    def __init__(self, path: Path, **_: Any) -> None:
        model = vet_mindir(Path(path))
        try:
            import mindspore as ms
            from mindspore import nn
        except ImportError as exc:  # pragma: no cover - vet_mindir already needs MindSpore
            raise EngineUnavailable("MindSpore is not installed here", hint="Install Kiln's mindspore extra.") from exc
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_device("CPU")
        try:
            self._cell = nn.GraphCell(ms.load(str(path)))
        except Exception as exc:
            raise SourceUnreadable(f"MindSpore could not load {Path(path).name}: {str(exc)[:400]}") from exc
        self._ms = ms
        self.inputs, self.outputs = mindir_signature(model)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [self._ms.Tensor(contiguous(feeds[t.name], dtype=t.dtype)) for t in self.inputs]
        result = self._cell(*args)
        flat = list(result) if isinstance(result, (tuple, list)) else [result]
        return {t.name: np.asarray(r.asnumpy()) for t, r in zip(self.outputs, flat, strict=True)}
