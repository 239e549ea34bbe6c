"""Artifacts: a directory of files plus a small JSON descriptor, the unit steps pass along.

A step reads its inputs as artifacts and writes exactly one artifact. The descriptor
(``kiln-artifact.json``) says what format the directory holds, which file a loader opens,
and free-form metadata (reports, signatures, tool versions) the next steps and the
provenance manifest read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DESCRIPTOR", "Artifact"]

DESCRIPTOR = "kiln-artifact.json"


@dataclass
class Artifact:
    """A directory on local disk holding one step's output."""

    root: Path
    kind: str  # a Format value for models; "reference" or "report" for data artifacts
    entry: str = ""  # path of the main file (or dir) relative to root; "" means root itself
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """Return the path a loader opens."""
        return self.root / self.entry if self.entry else self.root

    def save(self) -> Artifact:
        """Write the descriptor into root; return self."""
        self.root.mkdir(parents=True, exist_ok=True)
        body = {"kind": self.kind, "entry": self.entry, "meta": self.meta}
        (self.root / DESCRIPTOR).write_text(json.dumps(body, indent=2, sort_keys=True, default=str))
        return self

    @classmethod
    def load(cls, root: Path) -> Artifact:
        """Read an artifact directory written by :meth:`save`."""
        body = json.loads((root / DESCRIPTOR).read_text())
        return cls(root=root, kind=body["kind"], entry=body.get("entry", ""), meta=body.get("meta", {}))

    def files(self) -> list[Path]:
        """Return the artifact's payload files (descriptor excluded), sorted."""
        return sorted(p for p in self.root.rglob("*") if p.is_file() and p.name != DESCRIPTOR)
