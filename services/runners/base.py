"""The runner interface and its lazily imported registry (format -> implementation)."""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.descriptors import registry
from services.errors import EngineUnavailable
from services.formats import Format
from services.tensors import TensorSpec

__all__ = ["InputBound", "ModelRunner", "TensorSpec", "contiguous", "open_runner", "register_runner"]


def contiguous(arr: Any, dtype: Any = None) -> np.ndarray:
    """``arr`` as a C-contiguous array of its own rank (and ``dtype`` when given), copied only when needed.

    Not ``np.ascontiguousarray``: it returns at least 1-D, so a scalar input (a sample rate, a
    step count) reached engines as shape [1], which OpenVINO refuses for a 0-d port.
    """
    return np.require(arr, dtype=dtype, requirements="C")


@dataclass(frozen=True)
class InputBound:
    """Valid values of an input read from the model: ``[0, high)`` (a vocabulary), and where from.

    ``generatable`` False: no value Kiln could make up is valid (a shape operand, a sequence):
    the input needs real sample data.
    """

    high: int
    why: str
    generatable: bool = True


class ModelRunner(abc.ABC):
    """A loaded model that maps named numpy inputs to named numpy outputs."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    #: Non-tensor arguments pinned by the spec's ``inputs.<name>.value`` and passed on every run
    #: (a PyTorch forward's ``sr: int``): not fed, not in the artifact's signature.
    static_arguments: dict[str, Any] = {}  # noqa: RUF012 - read-only default; runners assign their own

    @abc.abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one inference; return outputs keyed by name, in ``self.outputs`` order."""

    def io_contract(self) -> dict[str, list[dict[str, Any]]]:
        """Return the inputs and outputs as the artifact stores them: what a serving client feeds and reads.

        ``inputs``/``outputs`` above are what parity exchanges; a runner that converts at the
        boundary (TFLite's scaled int8 tensors) reports the stored dtypes here instead.
        """
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    def input_bounds(self) -> dict[str, InputBound]:
        """Return the valid range of integer inputs the model itself states (token ids: its vocabulary)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""


# format -> "module:factory"; factories take (path, **options) and return a ModelRunner.
# From the format descriptors (services/descriptors); register_runner adds others (tests, plugins).
_RUNNERS: dict[Format, str] = {Format(f.name): f.runner for f in registry().formats.values() if f.runner}


def register_runner(fmt: Format, entry: str, *, replace: bool = False) -> None:
    """Register the runner for ``fmt``; refuses to overwrite silently."""
    if fmt in _RUNNERS and not replace:
        raise ValueError(f"a runner for {fmt.value} is already registered: {_RUNNERS[fmt]}")
    _RUNNERS[fmt] = entry


def open_runner(fmt: Format, path: Path, **options: Any) -> ModelRunner:
    """Load ``path`` with the runner of ``fmt``; ENGINE_UNAVAILABLE when its SDK is missing."""
    entry = _RUNNERS.get(fmt)
    if entry is None:
        raise EngineUnavailable(f"no runner for {fmt.value}", hint="Known: " + ", ".join(f.value for f in _RUNNERS))
    module, _, name = entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise EngineUnavailable(
            f"cannot run {fmt.value} here: {exc}", hint=f"Install the engine that reads {fmt.value}."
        ) from exc
    return factory(Path(path), **options)  # type: ignore[no-any-return]
