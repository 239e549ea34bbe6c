"""Run .tflite models with LiteRT (ai_edge_litert), quantizing and dequantizing int8 I/O.

Callers always exchange float arrays: an input tensor stored as int8/uint8 with a scale is
reported as float32 and quantized here with its own scale and zero point, and quantized
outputs are dequantized, so parity compares real values with the source model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import InvalidSpec, SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec, contiguous

DEFAULT_SIGNATURE = "serving_default"

__all__ = ["TFLiteRunner", "pick_signature"]


@dataclass(frozen=True)
class _Tensor:
    """One signature tensor: its public name and how it is stored in the interpreter."""

    name: str
    tensor_name: str  # the interpreter's own name, e.g. serving_default_image:0
    index: int
    dtype: np.dtype
    shape_signature: tuple[int, ...]
    scale: float
    zero_point: int

    @property
    def quantized(self) -> bool:
        return self.scale != 0.0 and self.dtype.kind in "iu"

    def spec(self) -> TensorSpec:
        dtype = "float32" if self.quantized else self.dtype.name
        return TensorSpec(self.name, dtype, tuple(None if d < 0 else int(d) for d in self.shape_signature))

    def stored(self) -> dict[str, Any]:
        """Return the tensor as the model file stores it: its own dtype, and the scale of a quantized one."""
        d = TensorSpec(self.name, self.dtype.name, self.spec().shape).to_dict()
        if self.quantized:
            d["quantization"] = {"scale": self.scale, "zero_point": self.zero_point}
        return d


def _tensor(name: str, d: dict[str, Any]) -> _Tensor:
    scale, zero = d.get("quantization", (0.0, 0))
    sig = d.get("shape_signature")
    shape = sig if sig is not None and len(sig) else d["shape"]
    return _Tensor(
        name,
        str(d["name"]),
        int(d["index"]),
        np.dtype(d["dtype"]),
        tuple(int(x) for x in shape),
        float(scale),
        int(zero),
    )


def pick_signature(signatures: dict[str, Any], wanted: str | None) -> str:
    """Return the signature to run: the one asked for, or the model's only/first one by default."""
    if wanted in signatures:
        return wanted
    if wanted in (None, DEFAULT_SIGNATURE):
        # The spec's default name; a converter may have called the one signature otherwise.
        return sorted(signatures)[0]
    raise InvalidSpec(
        f"the TFLite model has no signature {wanted!r}; it has {sorted(signatures)}",
        hint="Set `signature` in the spec to one of them.",
        signatures=sorted(signatures),
    )


class TFLiteRunner(ModelRunner):
    """A LiteRT interpreter over one signature (or the bare graph when the model has none)."""

    def __init__(
        self,
        path: Path,
        *,
        signature: str | None = None,
        threads: int | None = None,
        xnnpack: bool = True,
        **_: Any,
    ) -> None:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        # xnnpack=False: LiteRT's own builtin kernels, without its default XNNPACK delegate.
        resolver = OpResolverType.AUTO if xnnpack else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        try:
            self.interpreter = Interpreter(
                model_path=str(path), num_threads=threads, experimental_op_resolver_type=resolver
            )
        except (ValueError, RuntimeError) as exc:
            raise SourceUnreadable(f"LiteRT cannot load {Path(path).name}: {exc}") from exc
        signatures = self.interpreter.get_signature_list()
        self.signature: str | None = None
        self._runner: Any = None
        if signatures:
            self.signature = pick_signature(signatures, signature)
            self._runner = self.interpreter.get_signature_runner(self.signature)
            ins = self._runner.get_input_details()
            outs = self._runner.get_output_details()
            # The signature lists names in its own order; keep the signature's declared order.
            self._in = [_tensor(n, ins[n]) for n in signatures[self.signature]["inputs"]]
            self._out = [_tensor(n, outs[n]) for n in signatures[self.signature]["outputs"]]
        else:
            # A model without signatures (TF1-era converters): its tensor names are the public names.
            self.interpreter.allocate_tensors()
            in_details = self.interpreter.get_input_details()
            self._in = [_tensor(d["name"], d) for d in in_details]
            self._out = [_tensor(d["name"], d) for d in self.interpreter.get_output_details()]
            self._shapes = {int(d["index"]): tuple(int(x) for x in d["shape"]) for d in in_details}
        self.inputs = [t.spec() for t in self._in]
        self.outputs = [t.spec() for t in self._out]

    @property
    def quantized_io(self) -> dict[str, list[str]]:
        """Return the names of inputs and outputs stored as integers with a scale."""
        return {
            "inputs": [t.name for t in self._in if t.quantized],
            "outputs": [t.name for t in self._out if t.quantized],
        }

    def io_contract(self) -> dict[str, list[dict[str, Any]]]:
        """Return the dtypes the .tflite file itself declares (int8 with a scale, where quantized)."""
        return {"inputs": [t.stored() for t in self._in], "outputs": [t.stored() for t in self._out]}

    def tensor_names(self) -> dict[str, str]:
        """Return the interpreter's tensor name -> the public (signature) name, inputs and outputs."""
        return {t.tensor_name: t.name for t in [*self._in, *self._out]}

    @staticmethod
    def _quantize(t: _Tensor, arr: np.ndarray) -> np.ndarray:
        if not t.quantized:
            return contiguous(arr, dtype=t.dtype)
        info = np.iinfo(t.dtype)
        q = np.round(np.asarray(arr, dtype=np.float32) / t.scale) + t.zero_point
        return np.clip(q, info.min, info.max).astype(t.dtype)

    @staticmethod
    def _dequantize(t: _Tensor, arr: np.ndarray) -> np.ndarray:
        if not t.quantized:
            return np.array(arr)  # copy: the interpreter reuses its buffers on the next invoke
        return ((arr.astype(np.float32) - t.zero_point) * t.scale).astype(np.float32)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = {t.name: self._quantize(t, feeds[t.name]) for t in self._in}
        if self._runner is not None:
            # The signature runner resizes dynamic inputs to the fed shapes before it invokes.
            raw = self._runner(**values)
            return {t.name: self._dequantize(t, raw[t.name]) for t in self._out}
        resized = False
        for t in self._in:
            shape = values[t.name].shape
            if self._shapes[t.index] != shape:
                self.interpreter.resize_tensor_input(t.index, list(shape))
                self._shapes[t.index] = shape
                resized = True
        if resized:
            self.interpreter.allocate_tensors()
        for t in self._in:
            self.interpreter.set_tensor(t.index, values[t.name])
        self.interpreter.invoke()
        return {t.name: self._dequantize(t, self.interpreter.get_tensor(t.index)) for t in self._out}

    def close(self) -> None:
        self._runner = None
        self.interpreter = None
