"""The core description of a model input or output, shared by runners, the repository and the steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TensorSpec"]


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, numpy dtype name, shape (None for a dynamic axis)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]))
