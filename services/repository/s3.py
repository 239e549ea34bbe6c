"""Model repository on S3-compatible object storage, published in an order readers can trust.

Triton (``--model-repository=s3://...``), TF Serving and OVMS (``base_path: "s3://..."``)
read ``s3://bucket/prefix/<name>/<version>/`` directly. Object storage has no rename and no
multi-object transaction: each PutObject (or CompleteMultipartUpload) is atomic for ITS
object, and nothing is atomic across objects. Staging the files elsewhere and copying them
into place would not help: server-side copy is also one object at a time, so it doubles the
traffic without closing the window, and a staging prefix inside the repository would itself
look like a model directory to Triton. Kiln therefore publishes a version in a fixed order
and makes its own readers gate on the object written last.

Publish protocol (``write_version`` then :func:`~services.repository.publish.publish_version`):

1. Under the repository lock, delete leftovers of an earlier failed publish of the same
   ``<name>/<N>/`` (a version with a manifest is complete and is refused instead).
2. Upload the payload files a model file refers to (``model.bin``, ``variables/*``,
   external ONNX data, ...) in parallel.
3. Upload the model files a server opens (``model.xml``, ``saved_model.pb``, ``model.onnx``,
   ``*.tflite``, ``*.plan``), so anything that opens one finds what it references.
4. Upload ``kiln-manifest.json`` LAST. It is the version's commit record.
5. Then ``kiln-model.json``, ``config.pbtxt`` (Triton) and the root ``models.config`` /
   ``config.json``, each one PutObject, so each is replaced whole.

What each reader can observe:

- Kiln's readers (``versions()``, ``fetch_version``, GET /repository, the next publish)
  count a version only when its ``kiln-manifest.json`` exists. Since that object is written
  after every other file of the version, they see the old set of versions or the complete
  new one, never half — the same promise the local backend gets from ``rename``.
- A third-party server listing the bucket during steps 2-4 can see a numeric ``<N>/``
  holding only part of the files. Until step 3 finishes the model file it would open is
  missing, so a load attempt fails (it cannot load a truncated model: every object it sees
  is whole). From step 3 on, every file the server needs is present. The window is bounded
  by the upload time of one version. What the servers then do, per their docs: TF Serving
  retries a failed load (``--max_num_load_retries``, default 5, one minute apart) and keeps
  serving the versions it has; Triton in POLL mode reports the version UNAVAILABLE and
  tries again when a later poll sees the model change, and its docs warn that polling can
  catch a repository mid-change — run Triton with ``--model-control-mode=explicit`` and load
  the model after Kiln publishes for a race-free rollout (NONE mode reads the repository
  only at start-up). For a model's first version, ``config.pbtxt`` is written after all of
  the version's files, so a Triton that requires the config does not see the model at all
  until it is complete.
- A publish that dies half-way leaves a numeric ``<N>/`` without a manifest: invisible to
  Kiln (the next publish takes that number again and clears it first, step 1), visible to a
  third-party server as a version that fails to load.

Locking: S3 has no locks, so :meth:`S3ModelRepository.lock` is a lease object
``<prefix>/.kiln-lock`` created with a conditional write (``PutObject`` with
``If-None-Match: *``: exactly one concurrent creator succeeds; AWS S3 enforces it since
2024, and the contract tests check it against SeaweedFS 4.48). The holder renews it every
``ttl/3`` seconds with ``If-Match`` on its ETag and deletes it with ``If-Match`` on release. A waiter that finds the lease older than its TTL —
measured with the server's clock, the object's Last-Modified against the response's Date,
so client clock skew does not matter — deletes it with ``If-Match`` on the ETag it saw, so
two waiters cannot both break the same lease. Guarantee: mutual exclusion between Kiln
publishers as long as a live holder renews within the TTL; a crashed holder delays others
by at most one TTL. A holder stalled longer than the TTL (a frozen VM) can lose the lease;
it notices at its next renewal or at release, and ``lock()`` raises SERVICE_UNAVAILABLE on
exit instead of reporting success. A server that ignores conditional headers would give no exclusion; the
contract tests run the lock against the real server to catch that.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time
import uuid
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from services.errors import KilnError, NotFound, RepositoryConflict, ServiceUnavailable
from services.repository.base import ModelRepository
from services.repository.publish import MANIFEST
from services.s3 import (
    S3Location,
    delete_keys,
    download_keys,
    is_missing,
    is_precondition_failed,
    is_transient,
    list_keys,
    make_client,
    s3_errors,
    safe_relpath,
    upload_files,
)

__all__ = ["LOCK_OBJECT", "S3ModelRepository", "upload_phases"]

LOCK_OBJECT = ".kiln-lock"
#: How long taking the lock rides out transient S3 failures (5xx, lost connections) in a row.
TRANSIENT_GRACE = 60.0

# Files a serving engine opens first; each may refer to others (weights, variables/, external
# data), which must already be there when it appears.
_ENTRY_NAMES = {"saved_model.pb", "saved_model.pbtxt"}
_ENTRY_SUFFIXES = {".xml", ".onnx", ".tflite", ".plan", ".engine", ".pt", ".pt2", ".graphdef", ".savedmodel", ".param"}


def upload_phases(relpaths: list[str]) -> list[list[str]]:
    """Return the version's files in upload order: referenced payload, model files, manifest."""
    payload, entries, commit = [], [], []
    for rel in sorted(relpaths):
        p = PurePosixPath(rel)
        if rel == MANIFEST:
            commit.append(rel)
        elif p.name in _ENTRY_NAMES or p.suffix in _ENTRY_SUFFIXES:
            entries.append(rel)
        else:
            payload.append(rel)
    return [phase for phase in (payload, entries, commit) if phase]


class _S3Lease:
    """The lease behind :meth:`S3ModelRepository.lock` (see the module docstring)."""

    def __init__(self, client: Any, location: S3Location, *, ttl: float, timeout: float, poll: float) -> None:
        self.client = client
        self.location = location
        self.key = location.key(LOCK_OBJECT)
        self.ttl = ttl
        self.timeout = timeout
        self.poll = poll
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.etag: str | None = None
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "ttl": self.ttl}).encode()

    def __enter__(self) -> None:
        deadline = time.monotonic() + self.timeout
        holder = "?"
        failing_since: float | None = None
        with s3_errors("taking the repository lock", self.location):
            while True:
                try:
                    try:
                        resp = self.client.put_object(
                            Bucket=self.location.bucket, Key=self.key, Body=self._body(), IfNoneMatch="*"
                        )
                        self.etag = resp["ETag"]
                        break
                    except Exception as exc:
                        if not is_precondition_failed(exc):
                            raise
                    holder = self._break_if_stale()
                    failing_since = None
                except Exception as exc:
                    # A server that has just come back answers "InternalError, please try
                    # again" until its storage is ready (SeaweedFS: seconds after its gateway
                    # answers), longer than botocore's own retries last. Waiting for a lock is
                    # already a wait, so keep trying for a bounded while before failing.
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if not is_transient(exc) or now - failing_since >= TRANSIENT_GRACE or now > deadline:
                        raise
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(
                        f"the repository {self.location.url()} stayed locked by {holder} for {self.timeout:.0f}s",
                        hint="Another publish is running; retry later. A crashed holder's lock expires by itself.",
                    )
                # Jitter, so waiters that saw the same release do not all retry at once.
                time.sleep(self.poll * (0.5 + random.random()))
        self._renewer = threading.Thread(target=self._renew, name="kiln-s3-lock-renew", daemon=True)
        self._renewer.start()

    def _break_if_stale(self) -> str:
        """Delete the lease if its holder stopped renewing it; return who holds it."""
        try:
            resp = self.client.get_object(Bucket=self.location.bucket, Key=self.key)
        except Exception as exc:
            if is_missing(exc):
                return "nobody (just released)"
            raise
        try:
            body = json.loads(resp["Body"].read())
        except ValueError:
            body = {}
        holder = str(body.get("owner", "?"))
        ttl = float(body.get("ttl", self.ttl))
        server_now = _server_time(resp)
        modified: datetime = resp["LastModified"]
        if server_now is not None and (server_now - modified).total_seconds() > ttl:
            try:
                self.client.delete_object(Bucket=self.location.bucket, Key=self.key, IfMatch=resp["ETag"])
            except Exception as exc:
                # Renewed, released or broken by another waiter meanwhile: just retry.
                if not (is_precondition_failed(exc) or is_missing(exc)):
                    raise
        return holder

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                resp = self.client.put_object(
                    Bucket=self.location.bucket, Key=self.key, Body=self._body(), IfMatch=self.etag
                )
                self.etag = resp["ETag"]
            except Exception as exc:
                if is_precondition_failed(exc) or is_missing(exc):
                    self.lost = True  # someone broke our lease: stop renewing, report on exit
                    return
                # A transient error: the next tick retries well before the TTL runs out.

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if not self.lost:
            try:
                self.client.delete_object(Bucket=self.location.bucket, Key=self.key, IfMatch=self.etag)
            except Exception as err:
                if is_precondition_failed(err) or is_missing(err):
                    # Our lease is gone or someone else's now: it was broken while we held it.
                    self.lost = True
                elif exc_type is None:
                    # Otherwise the lease expires by itself; never hide the block's own error.
                    with s3_errors("releasing the repository lock", self.location):
                        raise
        if self.lost and exc_type is None:
            raise ServiceUnavailable(
                f"lost the lock of {self.location.url()} while holding it (no renewal for {self.ttl:.0f}s)",
                hint="Another publisher may have run at the same time; check the repository and retry.",
            )


def _server_time(resp: dict[str, Any]) -> datetime | None:
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    return parsedate_to_datetime(date) if date else None


class S3ModelRepository(ModelRepository):
    """``s3://bucket/prefix/<name>/<version>/``; a version counts once its manifest exists."""

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
        lock_ttl: float = 60.0,
        lock_timeout: float = 600.0,
        lock_poll: float = 0.2,
    ) -> None:
        self.location = S3Location(bucket=bucket, prefix=prefix.strip("/"))
        self.client = client or make_client(
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
        )
        self.lock_ttl = lock_ttl
        self.lock_timeout = lock_timeout
        self.lock_poll = lock_poll

    def _key(self, relpath: str) -> str:
        return self.location.key(safe_relpath(relpath).as_posix())

    def _dir_prefix(self, relpath: str = "") -> str:
        key = self._key(relpath) if relpath else self.location.prefix
        return f"{key}/" if key else ""

    def lock(self) -> _S3Lease:
        return _S3Lease(self.client, self.location, ttl=self.lock_ttl, timeout=self.lock_timeout, poll=self.lock_poll)

    def model_names(self, under: str = "") -> list[str]:
        root = self._dir_prefix(under)
        names: list[str] = []
        with s3_errors("listing models", self.location):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=root, Delimiter="/"):
                for cp in page.get("CommonPrefixes", []):
                    name = cp["Prefix"][len(root) :].rstrip("/")
                    if name and not name.startswith("."):
                        names.append(name)
        return sorted(names)

    def versions(self, name: str) -> list[int]:
        base = self._dir_prefix(name)
        pattern = re.compile(rf"^(\d+)/{re.escape(MANIFEST)}$")
        found: set[int] = set()
        with s3_errors(f"listing versions of {name}", self.location):
            for obj in list_keys(self.client, self.location.bucket, base):
                m = pattern.match(obj["Key"][len(base) :])
                if m:
                    found.add(int(m.group(1)))
        return sorted(found)

    def write_version(self, name: str, version: int, local_dir: Path) -> None:
        local_dir = Path(local_dir)
        if not (local_dir / MANIFEST).is_file():
            # The manifest is this backend's commit record; without it the version would
            # never become visible, which is a caller bug, not a user error.
            raise KilnError(f"write_version({name!r}, {version}) needs {MANIFEST} in {local_dir}")
        vdir = self._dir_prefix(f"{name}/{version}")
        rels = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        with s3_errors(f"publishing {name} version {version}", self.location):
            leftovers = [o["Key"] for o in list_keys(self.client, self.location.bucket, vdir)]
            if vdir + MANIFEST in leftovers:
                raise RepositoryConflict(f"model {name!r} already has version {version}", name=name, version=version)
            # A publish of this version died before its manifest: clear what it left so the
            # new version holds exactly the new files.
            delete_keys(self.client, self.location.bucket, leftovers)
            for phase in upload_phases(rels):
                upload_files(self.client, self.location.bucket, [(local_dir / rel, vdir + rel) for rel in phase])

    def read_file(self, relpath: str) -> bytes | None:
        with s3_errors(f"reading {relpath}", self.location):
            try:
                resp = self.client.get_object(Bucket=self.location.bucket, Key=self._key(relpath))
            except Exception as exc:
                if is_missing(exc):
                    return None
                raise
            return resp["Body"].read()  # type: ignore[no-any-return]

    def write_file(self, relpath: str, data: bytes) -> None:
        # One PutObject is atomic: a reader gets the old object or the new one, never a mix.
        with s3_errors(f"writing {relpath}", self.location):
            self.client.put_object(Bucket=self.location.bucket, Key=self._key(relpath), Body=data)

    def uri(self, relpath: str = "") -> str:
        return self.location.url(safe_relpath(relpath).as_posix()) if relpath else self.location.url()

    def fetch_version(self, name: str, version: int, dest: Path) -> Path:
        vdir = self._dir_prefix(f"{name}/{version}")
        with s3_errors(f"fetching {name} version {version}", self.location):
            objects = list(list_keys(self.client, self.location.bucket, vdir))
            if not any(o["Key"] == vdir + MANIFEST for o in objects):
                raise NotFound(f"model {name} version {version} is not in the repository ({self.uri(name)})")
            dest = Path(dest)
            dest.mkdir(parents=True, exist_ok=True)
            pairs = [(o["Key"], dest / safe_relpath(o["Key"][len(vdir) :])) for o in objects]
            download_keys(self.client, self.location.bucket, pairs)
        return dest

    def download_dir(self, relpath: str, dest: Path) -> int:
        base = self._dir_prefix(relpath)
        with s3_errors(f"fetching {relpath or 'the prefix'}", self.location):
            objects = list(list_keys(self.client, self.location.bucket, base))
            if not objects:
                raise NotFound(f"nothing under {self.uri(relpath)}")
            dest = Path(dest)
            dest.mkdir(parents=True, exist_ok=True)
            download_keys(
                self.client,
                self.location.bucket,
                [(o["Key"], dest / safe_relpath(o["Key"][len(base) :])) for o in objects],
            )
        return len(objects)

    def version_fingerprint(self, model_dir: str, version: int) -> tuple[tuple[str, ...], ...]:
        # Every PutObject gives an object a new ETag and Last-Modified.
        base = self._dir_prefix(f"{model_dir}/{version}")
        with s3_errors(f"listing {model_dir} version {version}", self.location):
            return tuple(
                (o["Key"][len(base) :], str(o["Size"]), str(o.get("ETag")), str(o.get("LastModified")))
                for o in sorted(list_keys(self.client, self.location.bucket, base), key=lambda o: o["Key"])
            )
