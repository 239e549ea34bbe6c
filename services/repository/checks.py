"""Whether each published version still holds the files Kiln signed, as the API and dashboard show it.

Verifying reads every byte of a version (on S3, downloads it), so a :class:`SignatureChecks`
remembers each version's verdict with the version's fingerprint (file names, sizes and change
stamps: mtime, ctime and inode on disk; ETag and Last-Modified on S3) and verifies again only
when the fingerprint changed. A file altered in any way changes its fingerprint, so a version
whose files no longer match is never shown from a stale "verified".
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from services.repository.base import ModelRepository
from services.repository.signing import VersionVerification, verify_version
from services.repository.signing_keys import PublicKey, TrustedCAs

__all__ = ["SignatureChecks", "verify_published"]


def verify_published(
    repo: ModelRepository, model_dir: str, version: int, keys: Sequence[PublicKey], cas: TrustedCAs | None = None
) -> VersionVerification:
    """Return the verification of ``<model_dir>/<version>/``: in place on disk, from a download elsewhere."""
    relpath = f"{model_dir}/{version}"
    local = repo.local_dir(relpath)
    if local is not None:
        return verify_version(local, keys, cas)
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        dest = Path(tmp) / f"{model_dir.rsplit('/', 1)[-1]}.v{version}"
        repo.download_dir(relpath, dest)
        return verify_version(dest, keys, cas)


class SignatureChecks:
    """Verdicts of published versions, each recomputed only when the version's files changed."""

    def __init__(self, keys: Sequence[PublicKey], cas: TrustedCAs | None = None, *, max_entries: int = 10_000) -> None:
        self.keys = list(keys)
        self.cas = cas
        self.max_entries = max_entries
        self._memo: dict[str, tuple[tuple[tuple[str, ...], ...], VersionVerification]] = {}
        self._lock = threading.Lock()

    def check(self, repo: ModelRepository, model_dir: str, version: int) -> VersionVerification:
        """Return the verdict of one version (verifying it when its files changed since the last check)."""
        where = repo.uri(f"{model_dir}/{version}")
        # Taken before verifying: a change made meanwhile leaves a fingerprint that no longer
        # matches, so the next check verifies again rather than trusting this verdict.
        fingerprint = repo.version_fingerprint(model_dir, version)
        with self._lock:
            known = self._memo.get(where)
        if known is not None and known[0] == fingerprint:
            return known[1]
        verdict = verify_published(repo, model_dir, version, self.keys, self.cas)
        with self._lock:
            if len(self._memo) >= self.max_entries:
                self._memo.pop(next(iter(self._memo)))
            self._memo[where] = (fingerprint, verdict)
        return verdict
