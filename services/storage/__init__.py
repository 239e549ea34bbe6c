"""Artifact stores: where step outputs (content-addressed) and uploaded sources live."""

from services.storage.base import ArtifactStore
from services.storage.local import LocalArtifactStore

__all__ = ["ArtifactStore", "LocalArtifactStore"]
