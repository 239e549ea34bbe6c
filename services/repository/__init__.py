"""Model repositories (Triton / TF Serving / OVMS layouts) and atomic publishing."""

from services.repository.base import ModelRepository
from services.repository.local import LocalModelRepository
from services.repository.publish import MANIFEST, PublishedVersion, RepositoryConflict, publish_version, read_manifest

__all__ = [
    "MANIFEST",
    "LocalModelRepository",
    "ModelRepository",
    "PublishedVersion",
    "RepositoryConflict",
    "publish_version",
    "read_manifest",
]
