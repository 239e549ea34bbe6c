"""The reference step: the source model, run by its own framework, on the parity inputs.

Its artifact holds the signature, the inputs every target is checked on (calibration rows
or seeded random samples) and the source's outputs for them. Exporters read it for parity
and as int8 calibration data, so the source framework runs once per job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.formats import Format
from services.pipeline.context import StepContext
from services.runners import ModelRunner, TensorSpec, open_runner
from services.validation import load_calibration, make_validation_inputs

__all__ = ["ReferenceData", "load_reference", "run_reference_step", "source_runner"]


def source_runner(ctx: StepContext) -> ModelRunner:
    """Open the job's source model with its own framework."""
    return open_runner(ctx.source.format, ctx.source.path, signature=ctx.spec.signature, inputs=ctx.spec.inputs)


def _pack(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{i}/{name}": arr for i, feed in enumerate(samples) for name, arr in feed.items()}


def _unpack(npz: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for key, arr in npz.items():
        i, _, name = key.partition("/")
        out[int(i)][name] = arr
    return out


def run_reference_step(ctx: StepContext) -> Artifact:
    """Compute the signature, parity inputs and source outputs; return the reference artifact."""
    runner = source_runner(ctx)
    calibration = None
    if ctx.spec.calibration:
        calibration = load_calibration(ctx.extras.get("calibration_path", ctx.spec.calibration), runner.inputs)
    feeds, inputs_from = make_validation_inputs(runner.inputs, ctx.spec, calibration)
    ctx.progress(f"running the {ctx.source.format.value} source on {len(feeds)} samples ({inputs_from})")
    outputs = [runner.run(feed) for feed in feeds]
    runner.close()
    out = ctx.out_dir
    np.savez(out / "inputs.npz", **_pack(feeds))
    np.savez(out / "outputs.npz", **_pack(outputs))
    signature = {
        "inputs": [t.to_dict() for t in runner.inputs],
        "outputs": [t.to_dict() for t in runner.outputs],
    }
    (out / "signature.json").write_text(json.dumps(signature, indent=2))
    return Artifact(
        root=out,
        kind="reference",
        meta={
            "samples": len(feeds),
            "inputs_from": inputs_from,
            "source_format": ctx.source.format.value,
            "signature": signature,
        },
    )


class ReferenceData:
    """The reference artifact, loaded: signature, per-sample inputs and source outputs."""

    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        meta: dict[str, Any] = artifact.meta
        self.samples: int = meta["samples"]
        self.inputs_from: str = meta["inputs_from"]
        self.source_format = Format(meta["source_format"])
        sig = meta["signature"]
        self.input_specs = [TensorSpec.from_dict(t) for t in sig["inputs"]]
        self.output_specs = [TensorSpec.from_dict(t) for t in sig["outputs"]]
        self.inputs = _load(artifact.root / "inputs.npz", self.samples)
        self.outputs = _load(artifact.root / "outputs.npz", self.samples)

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.output_specs]


def _load(path: Path, n: int) -> list[dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as npz:
        return _unpack({k: npz[k] for k in npz.files}, n)


def load_reference(artifact: Artifact) -> ReferenceData:
    """Return the loaded reference data of a reference artifact."""
    return ReferenceData(artifact)
