"""The artifact store and model repository the service's settings name (API and workers alike)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.repository.base import ModelRepository
    from services.settings import Settings
    from services.storage.base import ArtifactStore

__all__ = ["open_repository", "open_store"]


def open_store(settings: Settings) -> ArtifactStore:
    """Return the artifact store at ``settings.store_location`` (directory or s3://)."""
    try:
        from services.storage.factory import artifact_store_from_url
    except ImportError:  # a checkout without the S3 backends: local directories only
        from services.storage.local import LocalArtifactStore

        return LocalArtifactStore(Path(settings.store_location))
    return artifact_store_from_url(settings.store_location, settings)


def open_repository(settings: Settings) -> ModelRepository:
    """Return the model repository at ``settings.repository`` (directory or s3://)."""
    try:
        from services.storage.factory import repository_from_url
    except ImportError:
        from services.repository.local import LocalModelRepository
        from services.repository.signing_keys import signing_key_from_settings

        repo = LocalModelRepository(Path(settings.repository), serving_root=settings.serving_root)
        repo.signing_key = signing_key_from_settings(settings)
        return repo
    return repository_from_url(settings.repository, settings)
