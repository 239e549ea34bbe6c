"""What a step function receives: its inputs as local artifacts, the spec, an output dir."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.artifacts import Artifact
from services.formats import DetectedSource
from services.graph.planner import PlanStep
from services.spec import CompileSpec

if TYPE_CHECKING:
    from services.repository.base import ModelRepository

__all__ = ["Progress", "StepContext"]

#: A progress line of a running step: its text, or its text with structured data for the
#: pages that draw it (``{"message": ..., "tune": {...}}``: a tune's candidates as they come).
Progress = str | dict[str, Any]


@dataclass
class StepContext:
    """One step's view of the job. Step functions write into ``out_dir`` and return an Artifact."""

    job_id: str
    step: PlanStep
    spec: CompileSpec
    source: DetectedSource
    inputs: dict[str, Artifact]
    out_dir: Path
    scratch: Path
    repository: ModelRepository | None = None
    on_progress: Callable[[Progress], None] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    input_keys: dict[str, str] = field(default_factory=dict)  # role -> store key (content address) of each input
    use_cache: bool = True  # False: the user asked for a rebuild (and so for a new version)

    @property
    def model(self) -> Artifact:
        """Return the model artifact this step transforms."""
        return self.inputs["model"]

    @property
    def reference(self) -> Artifact:
        """Return the reference artifact (validation inputs and source outputs)."""
        return self.inputs["reference"]

    def opset(self, default: int) -> int:
        """Return the ONNX opset a conversion writes: the step's option, else the spec's, else ``default``."""
        return int(self.step.options.get("opset") or self.spec.opset or default)

    def progress(self, message: Progress) -> None:
        if self.on_progress is not None:
            self.on_progress(message)
