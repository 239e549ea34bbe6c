"""Run ncnn models (``.param`` + ``.bin``) with the ncnn Python package on the CPU.

ncnn's blobs have no batch axis: a ``Mat`` is at most 4-D (c, d, h, w) and holds one sample.
pnnx converts a model at batch 1 and drops that axis, so this runner feeds a batch one sample
at a time and stacks the outputs: a batch of N costs N inferences (the benchmark's larger
batch sizes measure that loop, not batched kernels). What the blobs mean (which source input
``in0`` is, each output's shape without the batch axis, the precision options the artifact
was validated with, each input's dtype: ``int32`` for token ids, whose 32 bits ncnn's Embed
layer reads as integers, ``float32`` otherwise) is in the artifact's sidecar, ``<model>.json``,
written by the exporter (services/exporters/ncnn.py): the ``.param`` file itself names blobs only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import ConversionFailed, InvalidSpec, SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec

__all__ = ["FP16_OPTIONS", "FP32_OPTIONS", "NcnnRunner", "sidecar_path"]

#: ncnn's defaults store and compute in fp16 (and may use bf16) wherever the CPU can: an fp32
#: artifact is validated, benchmarked and served with all of it off.
FP32_OPTIONS = {
    "use_fp16_packed": False,
    "use_fp16_storage": False,
    "use_fp16_arithmetic": False,
    "use_bf16_packed": False,
    "use_bf16_storage": False,
}
#: fp16 artifacts (fp16 weights in the .bin) run with ncnn's fp16 storage and arithmetic on.
FP16_OPTIONS = {
    "use_fp16_packed": True,
    "use_fp16_storage": True,
    "use_fp16_arithmetic": True,
    "use_bf16_packed": False,
    "use_bf16_storage": False,
}


def sidecar_path(param: Path) -> Path:
    """Return the sidecar describing ``model.ncnn.param``'s blobs: ``model.ncnn.json``."""
    return Path(param).with_suffix(".json")


def _specs(entries: list[dict[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec(e["name"], e.get("dtype", "float32"), tuple(e["shape"])) for e in entries]


class NcnnRunner(ModelRunner):
    """An ncnn ``Net`` loaded from ``path`` (the .param; the .bin and the sidecar sit beside it)."""

    def __init__(self, path: Path, *, threads: int | None = None, **_: Any) -> None:
        import ncnn

        path = Path(path)
        meta_path = sidecar_path(path)
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise SourceUnreadable(
                f"cannot read {meta_path.name}, the ncnn model's blob map: {exc}",
                hint="Kiln's ncnn artifacts carry model.ncnn.json beside the .param; publish through Kiln.",
            ) from exc
        self._ncnn = ncnn
        self.net = ncnn.Net()
        for key, value in self.meta.get("options", FP32_OPTIONS).items():
            setattr(self.net.opt, key, value)
        if threads:
            self.net.opt.num_threads = int(threads)
        bin_path = path.with_name(self.meta.get("bin", path.with_suffix(".bin").name))
        # ncnn reports a bad file as a non-zero status (and a line on stderr), never an exception.
        if self.net.load_param(str(path)) != 0:
            raise SourceUnreadable(f"ncnn cannot parse {path.name}", hint="A layer type this ncnn does not know?")
        if self.net.load_model(str(bin_path)) != 0:
            raise SourceUnreadable(f"ncnn cannot load the weights {bin_path.name}")
        self.inputs = _specs(self.meta["inputs"])
        self.outputs = _specs(self.meta["outputs"])
        self._in_blobs = {e["name"]: e["blob"] for e in self.meta["inputs"]}
        # An int32 blob (token ids for ncnn's Embed) holds the ids' 32 bits, not their float values.
        self._in_dtypes = {e["name"]: np.dtype(e.get("dtype", "float32")) for e in self.meta["inputs"]}
        self._out_blobs = [(e["name"], e["blob"], tuple(e["shape"][1:])) for e in self.meta["outputs"]]

    def _batch_of(self, feeds: dict[str, np.ndarray]) -> int:
        sizes = {name: np.asarray(feeds[name]).shape[0] if np.ndim(feeds[name]) else 1 for name in self._in_blobs}
        if len(set(sizes.values())) != 1:
            raise InvalidSpec(f"inputs disagree on the batch size: {sizes}")
        return next(iter(sizes.values()))

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = sorted(set(self._in_blobs) - set(feeds))
        if missing:
            raise InvalidSpec(f"missing inputs {missing}; the ncnn model takes {sorted(self._in_blobs)}")
        batch = self._batch_of(feeds)
        if batch < 1:
            raise InvalidSpec("an ncnn model runs at least one sample")
        per_output: list[list[np.ndarray]] = [[] for _ in self._out_blobs]
        Mat = self._ncnn.Mat
        for i in range(batch):
            with self.net.create_extractor() as ex:
                for name, blob in self._in_blobs.items():
                    sample = np.ascontiguousarray(np.asarray(feeds[name])[i], dtype=self._in_dtypes[name])
                    # clone(): ncnn's x86 kernels use aligned AVX loads; numpy's buffer is only 16-byte
                    # aligned, and a Mat over it segfaulted in an elementwise layer (EfficientNetV2).
                    if ex.input(blob, Mat(sample).clone()) != 0:
                        raise ConversionFailed(f"ncnn refused input blob {blob} ({name}) of shape {sample.shape}")
                for k, (name, blob, shape) in enumerate(self._out_blobs):
                    status, mat = ex.extract(blob)
                    if status != 0:
                        raise ConversionFailed(f"ncnn could not compute output blob {blob} ({name})")
                    per_output[k].append(self._shaped(np.array(mat), name, shape))
        return {name: np.stack(parts) for (name, _, _), parts in zip(self._out_blobs, per_output, strict=True)}

    @staticmethod
    def _shaped(value: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Return one sample's output in the source's layout (ncnn squeezes axes of size 1 away)."""
        if value.size != int(np.prod(shape, dtype=np.int64)):
            raise ConversionFailed(
                f"ncnn output {name} has {value.size} values in shape {list(value.shape)}; "
                f"the source gives {list(shape)} per sample",
                hint="pnnx converted a graph whose shapes depend on the batch axis; export it at batch 1.",
            )
        return value.reshape(shape).astype(np.float32, copy=False)

    def close(self) -> None:
        self.net.clear()
