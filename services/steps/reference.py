"""The reference artifact, read back: what every step after the reference step checks against.

The reference step itself (services/pipeline/reference.py) runs the source model with its own
framework and writes this artifact; the exporters, which sit below the pipeline, read it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.formats import Format
from services.tensors import TensorSpec

__all__ = [
    "EVALUATION_INPUTS",
    "EVALUATION_LABELS",
    "ReferenceData",
    "ReferenceEvaluation",
    "load_reference",
    "unpack_samples",
]

#: The reference artifact's copy of the spec's labelled data: the feeds, and each feed's labels.
EVALUATION_INPUTS = "evaluation-inputs.npz"
EVALUATION_LABELS = "evaluation-labels.npz"


def unpack_samples(npz: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for key, arr in npz.items():
        i, _, name = key.partition("/")
        out[int(i)][name] = arr
    return out


@dataclass
class ReferenceEvaluation:
    """The spec's labelled data as the reference step batched it, and the source's score on it."""

    feeds: list[dict[str, np.ndarray]]
    labels: list[np.ndarray]
    output: str  # the source's name of the scored output
    samples: int
    source: dict[str, Any]  # the report of the source's own score (services/validation/evaluation.py)
    source_value: float
    source_per_feed: list[float]


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
        # Which shape each sample was made at (0: the first); references from before had one shape.
        self.shape_of: list[int] = list(meta.get("shape_of") or [0] * self.samples)
        self.shapes: list[dict[str, list[int]]] = list(meta.get("shapes") or [])
        self.input_provenance: dict[str, str] = dict(meta.get("input_provenance") or {})
        # Samples no quantiser saw, by kind (real, synthesized, generated); references from before have none.
        self.evidence: dict[str, int] = dict(meta.get("evidence") or {})
        # The source's other kernel set against the reference (services/validation/noise_floor.py); None: one set.
        self.noise_floor: dict[str, Any] | None = meta.get("noise_floor")
        self.reference_runtime: str = meta.get("reference_runtime") or self.source_format.value

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.output_specs]

    @cached_property
    def evaluation(self) -> ReferenceEvaluation | None:
        """Return the labelled data and the source's score, when the spec gave ``evaluation`` (read on first use)."""
        meta = self.artifact.meta.get("evaluation")
        if not meta:
            return None
        feeds = _load(self.artifact.root / EVALUATION_INPUTS, meta["feeds"])
        with np.load(self.artifact.root / EVALUATION_LABELS, allow_pickle=False) as npz:
            labels = [npz[str(i)] for i in range(meta["feeds"])]
        return ReferenceEvaluation(
            feeds=feeds,
            labels=labels,
            output=meta["output"],
            samples=meta["samples"],
            source=meta["report"],
            source_value=float(meta["source_value"]),
            source_per_feed=[float(v) for v in meta["source_per_feed"]],
        )


def _load(path: Path, n: int) -> list[dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as npz:
        return unpack_samples({k: npz[k] for k in npz.files}, n)


def load_reference(artifact: Artifact) -> ReferenceData:
    """Return the loaded reference data of a reference artifact."""
    return ReferenceData(artifact)
