"""Build the artifact store and the model repository a location string names.

``KILN_ARTIFACT_STORE`` and ``KILN_REPOSITORY`` are either a directory (a plain path or
``file://``) or ``s3://bucket/prefix``; the S3 endpoint and credentials come from the
:class:`~services.settings.Settings` passed in, never from the environment directly. The S3
backends (and boto3) are imported only when an s3:// location is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from services.errors import InvalidSpec

if TYPE_CHECKING:
    from services.repository.base import ModelRepository
    from services.settings import Settings
    from services.storage.base import ArtifactStore

__all__ = ["SCHEMES", "artifact_store_from_url", "repository_from_url", "s3_client_options"]

#: Location schemes the factories understand (a bare path means "file").
SCHEMES = ("file", "s3")


def s3_client_options(settings: Settings) -> dict[str, Any]:
    """Return the endpoint/region/credential keyword arguments for the S3 backends."""
    return {
        "endpoint_url": settings.s3_endpoint_url or None,
        "region": settings.s3_region or None,
        "access_key_id": settings.s3_access_key_id or None,
        "secret_access_key": settings.s3_secret_access_key.get_secret_value() or None,
    }


def _split(url: str, what: str) -> tuple[str, Any]:
    """Return ("file", Path) or ("s3", S3Location) for ``url``."""
    if not url or not url.strip():
        raise InvalidSpec(f"empty {what} location", hint="Give a directory path or s3://bucket/prefix.")
    url = url.strip()
    parsed = urlparse(url)
    # A one-letter scheme is a Windows drive ("C:\\repo"), not a URL.
    scheme = parsed.scheme.lower() if len(parsed.scheme) > 1 else ""
    if scheme in ("", "file"):
        if scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise InvalidSpec(
                    f"{what} location {url!r} names a remote host",
                    hint="file:// URLs must be local (file:///absolute/path); for remote storage use s3://bucket/prefix.",
                )
            return "file", Path(unquote(parsed.path))
        return "file", Path(url).expanduser()
    if scheme == "s3":
        from services.s3 import S3Location

        if not parsed.netloc:
            raise InvalidSpec(f"{what} location {url!r} has no bucket", hint="Write it as s3://bucket/prefix.")
        return "s3", S3Location(bucket=parsed.netloc, prefix=parsed.path.strip("/"))
    raise InvalidSpec(
        f"unknown {what} location scheme {parsed.scheme!r} in {url!r}",
        hint="Use a directory path, file:///path or s3://bucket/prefix (known schemes: "
        + ", ".join(SCHEMES)
        + "; S3-compatible servers such as MinIO or SeaweedFS take s3:// with KILN_S3_ENDPOINT_URL).",
    )


def artifact_store_from_url(url: str, settings: Settings) -> ArtifactStore:
    """Return the artifact store at ``url`` (directory, file:// or s3://bucket/prefix)."""
    kind, where = _split(url, "artifact store")
    if kind == "file":
        from services.storage.local import LocalArtifactStore

        return LocalArtifactStore(where)
    from services.storage.s3 import S3ArtifactStore

    return S3ArtifactStore(where.bucket, where.prefix, **s3_client_options(settings))


def repository_from_url(url: str, settings: Settings) -> ModelRepository:
    """Return the model repository at ``url`` (directory, file:// or s3://bucket/prefix), signing with the settings' key."""
    from services.repository.signing_keys import signing_key_from_settings

    kind, where = _split(url, "model repository")
    repo: ModelRepository
    if kind == "file":
        from services.repository.local import LocalModelRepository

        repo = LocalModelRepository(where, serving_root=settings.serving_root)
    else:
        from services.repository.s3 import S3ModelRepository

        repo = S3ModelRepository(where.bucket, where.prefix, **s3_client_options(settings))
        repo.serving_root = settings.serving_root
    repo.signing_key = signing_key_from_settings(settings)
    return repo
