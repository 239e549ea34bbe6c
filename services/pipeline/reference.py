"""The reference step: the source model, run by its own framework, on the parity inputs.

Its artifact holds the signature, the inputs every target is checked on and the source's
outputs for them, and a separate set of int8 calibration samples. Parity is measured on
samples the quantiser never saw: checking an int8 artifact on its own calibration rows
flatters it (measured: 5-10x lower error than on held-out rows for a transformer block).
With a calibration file every fourth row is held out for parity; with generated samples the
calibration set is drawn with a different seed.
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
from services.validation.inputs import check_spec_inputs

__all__ = ["ReferenceData", "load_reference", "run_reference_step", "source_runner"]


def source_runner(ctx: StepContext) -> ModelRunner:
    """Open the job's source model with its own framework (given its format's spec options, if it has any)."""
    return open_runner(
        ctx.source.format,
        ctx.source.path,
        signature=ctx.spec.signature,
        inputs=ctx.spec.inputs,
        options=ctx.spec.options_for(ctx.source.format.value),
    )


def _pack(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{i}/{name}": arr for i, feed in enumerate(samples) for name, arr in feed.items()}


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # numpy's stub types savez's **kwds against its own `allow_pickle: bool` keyword, so a
    # dict of arrays does not type-check; the call itself is what numpy documents.
    savez: Any = np.savez
    savez(path, **arrays)


def _unpack(npz: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for key, arr in npz.items():
        i, _, name = key.partition("/")
        out[int(i)][name] = arr
    return out


#: Every HOLD_OUT-th calibration row is kept for parity, never shown to the quantiser.
HOLD_OUT = 4


def _split_samples(
    runner: ModelRunner, ctx: StepContext, calibration: dict[str, np.ndarray] | None
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], str, str]:
    """Return (parity feeds, calibration feeds, where parity feeds came from, where calibration came from)."""
    if calibration is not None:
        rows, _ = make_validation_inputs(runner.inputs, ctx.spec, calibration)
        if len(rows) >= HOLD_OUT:
            parity = [r for i, r in enumerate(rows) if i % HOLD_OUT == HOLD_OUT - 1]
            calib = [r for i, r in enumerate(rows) if i % HOLD_OUT != HOLD_OUT - 1]
            return parity, calib, "calibration", "calibration file"
        return rows, rows, "calibration", "calibration file (too few rows to hold any out for parity)"
    parity, inputs_from = make_validation_inputs(runner.inputs, ctx.spec)
    other = ctx.spec.model_copy(
        update={
            "validation": ctx.spec.validation.model_copy(
                update={"seed": ctx.spec.validation.seed + 1, "samples": max(16, ctx.spec.validation.samples)}
            )
        }
    )
    calib, _ = make_validation_inputs(runner.inputs, other)
    return parity, calib, inputs_from, f"generated samples, not real data (seed {ctx.spec.validation.seed + 1})"


def run_reference_step(ctx: StepContext) -> Artifact:
    """Compute the signature, parity inputs and source outputs; return the reference artifact."""
    runner = source_runner(ctx)
    check_spec_inputs(runner.inputs, ctx.spec)
    calibration = None
    if ctx.spec.calibration:
        calibration = load_calibration(ctx.extras.get("calibration_path", ctx.spec.calibration), runner.inputs)
    feeds, calib, inputs_from, calibration_from = _split_samples(runner, ctx, calibration)
    ctx.progress(f"running the {ctx.source.format.value} source on {len(feeds)} samples ({inputs_from})")
    outputs = [runner.run(feed) for feed in feeds]
    runner.close()
    out = ctx.out_dir
    _save(out / "inputs.npz", _pack(feeds))
    _save(out / "outputs.npz", _pack(outputs))
    _save(out / "calibration.npz", _pack(calib))
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
            "calibration_samples": len(calib),
            "calibration_from": calibration_from,
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
        self.calibration_from: str = meta["calibration_from"]
        self.calibration = _load(artifact.root / "calibration.npz", meta["calibration_samples"])

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.output_specs]


def _load(path: Path, n: int) -> list[dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as npz:
        return _unpack({k: npz[k] for k in npz.files}, n)


def load_reference(artifact: Artifact) -> ReferenceData:
    """Return the loaded reference data of a reference artifact."""
    return ReferenceData(artifact)
