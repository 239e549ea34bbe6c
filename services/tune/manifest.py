"""Record a tune in the published version's manifest: the settings chosen, the margin, the serving
pick and its throughput curve, the profiles.

The recommendation is published through the compile pipeline, whose manifest knows nothing of
the search; this adds a ``tune`` section to that version's ``kiln-manifest.json`` (replaced
atomically by the repository), so whoever deploys the version sees which engine settings were
measured best and where the time goes.
"""

from __future__ import annotations

import json
from typing import Any

from services.repository.base import ModelRepository
from services.repository.publish import MANIFEST, replace_version_file

__all__ = ["record_tune", "tune_section"]

_KEEP = ("id", "target", "precision", "settings", "batch", "p50_ms", "p99_ms", "iqr_ms", "p50_ci_ms", "throughput")


def tune_section(rec: dict[str, Any], profiles: dict[str, Any], measurement: dict[str, Any]) -> dict[str, Any]:
    """Return the manifest's ``tune`` section: the chosen settings and figures, the runner-up, margin, profiles."""
    runner_up = rec.get("runner_up") or {}
    return {
        "objective": rec.get("objective"),
        "chosen": {k: rec.get(k) for k in _KEEP},
        "runner_up": {k: runner_up.get(k) for k in _KEEP} if runner_up else None,
        "margin": rec.get("margin"),
        "margin_within_noise": rec.get("margin_within_noise"),
        "verdict": rec.get("verdict"),
        "rounds": measurement.get("rounds"),
        # How the published config serves it (batch, instances, engine parameters) and, for the
        # throughput objective, the throughput-vs-concurrency curve those were picked from.
        "serving": rec.get("serving"),
        "profiles": profiles,
    }


def record_tune(repository: ModelRepository, published: dict[str, Any], section: dict[str, Any]) -> str | None:
    """Add ``section`` as ``tune`` to the published version's manifest; return its path (None when not found)."""
    root = repository.uri("").rstrip("/")
    uri = str(published.get("uri", ""))
    if not uri.startswith(root):
        return None
    version_dir = uri[len(root) :].strip("/")
    relpath = f"{version_dir}/{MANIFEST}"
    raw = repository.read_file(relpath)
    if raw is None:
        return None
    manifest = json.loads(raw)
    manifest["tune"] = section
    # The manifest is one of the files the version's signature covers: signed again with it.
    replace_version_file(repository, version_dir, MANIFEST, json.dumps(manifest, indent=2, default=str).encode())
    return relpath
