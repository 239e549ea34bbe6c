"""Artifact store on S3-compatible object storage (AWS S3, SeaweedFS, MinIO).

Layout: ``s3://bucket/prefix/<key>/<relpath>`` for every file of the stored directory, and
``<key>/.kiln-complete`` written LAST. The marker is a small JSON listing every file with its
size (and the directory's empty sub-directories, which object storage cannot hold), so:

- ``exists`` is one HEAD of the marker: a key whose upload died half-way has no marker and
  is not there, whatever objects it left behind;
- ``fetch_dir`` downloads exactly the files the marker lists and checks their sizes, so
  leftovers of an earlier failed attempt under the same key are never mixed in;
- two workers storing the same content-addressed key at once both upload identical bytes
  and both write the marker; whichever lands last wins with the same content.

Files of 8 MiB or more go up as multipart uploads and come down as parallel ranged GETs,
streamed to disk (boto3's transfer manager); nothing is held whole in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.errors import NotFound, ServiceUnavailable
from services.s3 import (
    S3Location,
    delete_keys,
    download_keys,
    is_missing,
    list_keys,
    make_client,
    s3_errors,
    safe_relpath,
    upload_files,
)
from services.storage.base import ArtifactStore

__all__ = ["COMPLETE_MARKER", "S3ArtifactStore"]

COMPLETE_MARKER = ".kiln-complete"


class S3ArtifactStore(ArtifactStore):
    """Directories under ``s3://bucket/prefix/<key>/``, each published by a completeness marker."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> None:
        self.location = S3Location(bucket=bucket, prefix=prefix.strip("/"))
        self.client = client or make_client(
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
        )

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad store key {key!r}")
        return self.location.key(key)

    def _marker(self, key: str) -> str:
        return f"{self._key(key)}/{COMPLETE_MARKER}"

    def exists(self, key: str) -> bool:
        with s3_errors(f"checking artifact {key}", self.location):
            try:
                self.client.head_object(Bucket=self.location.bucket, Key=self._marker(key))
            except Exception as exc:
                if is_missing(exc):
                    return False
                raise
        return True

    def put_dir(self, key: str, local_dir: Path, *, move: bool = False) -> str:
        del move  # objects are uploaded; the local directory stays for the caller to discard
        if self.exists(key):
            return self.uri(key)
        local_dir = Path(local_dir)
        base = self._key(key)
        files: dict[str, int] = {}
        empty_dirs: list[str] = []
        uploads: list[tuple[Path, str]] = []
        for p in sorted(local_dir.rglob("*")):
            rel = p.relative_to(local_dir).as_posix()
            if p.is_file():
                if rel == COMPLETE_MARKER:
                    continue
                files[rel] = p.stat().st_size
                uploads.append((p, f"{base}/{rel}"))
            elif p.is_dir() and not any(p.iterdir()):
                empty_dirs.append(rel)
        marker = json.dumps({"kiln_store": 1, "files": files, "dirs": empty_dirs}, sort_keys=True).encode()
        with s3_errors(f"storing artifact {key}", self.location):
            upload_files(self.client, self.location.bucket, uploads)
            # The marker goes last: until it exists, readers treat the key as absent.
            self.client.put_object(Bucket=self.location.bucket, Key=self._marker(key), Body=marker)
        return self.uri(key)

    def _read_marker(self, key: str) -> dict[str, Any]:
        with s3_errors(f"reading artifact {key}", self.location):
            try:
                body = self.client.get_object(Bucket=self.location.bucket, Key=self._marker(key))["Body"].read()
            except Exception as exc:
                if is_missing(exc):
                    raise NotFound(f"artifact {key} is not in the store ({self.uri(key)})") from exc
                raise
        return json.loads(body)  # type: ignore[no-any-return]

    def fetch_dir(self, key: str, dest: Path) -> Path:
        marker = self._read_marker(key)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        base = self._key(key)
        files: dict[str, int] = marker.get("files", {})
        pairs = [(f"{base}/{rel}", dest / safe_relpath(rel)) for rel in files]
        with s3_errors(f"fetching artifact {key}", self.location):
            download_keys(self.client, self.location.bucket, pairs)
        for rel in marker.get("dirs", []):
            (dest / safe_relpath(rel)).mkdir(parents=True, exist_ok=True)
        for rel, size in files.items():
            got = (dest / rel).stat().st_size
            if got != size:
                # Someone replaced an object under a complete key: refuse rather than hand a
                # step a model that is not the one the cache key names.
                raise ServiceUnavailable(
                    f"artifact {key}: {rel} has {got} bytes in the store, the marker says {size}",
                    hint=f"Delete the key ({self.uri(key)}) so the step runs again.",
                )
        return dest

    def uri(self, key: str) -> str:
        self._key(key)  # validates
        return self.location.url(key)

    def delete(self, key: str) -> None:
        base = self._key(key)
        with s3_errors(f"deleting artifact {key}", self.location):
            # Marker first, so a concurrent reader stops trusting the key before files vanish.
            self.client.delete_object(Bucket=self.location.bucket, Key=self._marker(key))
            keys = [o["Key"] for o in list_keys(self.client, self.location.bucket, base + "/")]
            delete_keys(self.client, self.location.bucket, keys)
