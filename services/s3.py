"""Shared S3 plumbing for the artifact store and the model repository: client, keys, transfers.

Both S3 backends need the same few things: a boto3 client built from explicit settings (never
read from the environment here), ``s3://bucket/prefix`` parsing, parallel uploads and
streaming downloads of a directory tree, and one translation of botocore failures into
:class:`~services.errors.KilnError` codes so a wrong endpoint or key reads as a hint, not a
traceback. boto3 is imported inside the functions that need it so that importing the
storage package stays cheap for the planner and the API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from services.errors import KilnError, NotFound, ServiceUnavailable

__all__ = [
    "MULTIPART_CHUNK",
    "S3Location",
    "client_error_code",
    "delete_keys",
    "download_keys",
    "is_missing",
    "is_precondition_failed",
    "is_transient",
    "list_keys",
    "make_client",
    "s3_errors",
    "safe_relpath",
    "transfer_config",
    "upload_files",
]

#: Files at or above this size go up in parts (and come down in ranged parts): one slow or
#: failed part is retried alone instead of restarting a multi-GB upload.
MULTIPART_CHUNK = 8 * 1024 * 1024
#: Parallel object transfers; each boto3 transfer also parallelises its own parts.
_WORKERS = 8

T = TypeVar("T")


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix ("" or ending without a slash)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """Return the location named by ``s3://bucket[/prefix]``."""
        if not url.startswith("s3://"):
            raise KilnError(f"not an s3:// URL: {url!r}", hint="Write it as s3://bucket/prefix.")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise KilnError(f"no bucket in {url!r}", hint="Write it as s3://bucket/prefix.")
        return cls(bucket=bucket, prefix=prefix.strip("/"))

    def key(self, *parts: str) -> str:
        """Return the object key for ``parts`` below the prefix."""
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return f"{self.prefix}/{tail}" if self.prefix and tail else (self.prefix or tail)

    def url(self, *parts: str) -> str:
        """Return ``s3://bucket/prefix/parts``."""
        key = self.key(*parts)
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"


def make_client(
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
) -> Any:
    """Return a boto3 S3 client; empty credentials fall back to boto3's default chain."""
    import boto3
    from botocore.config import Config

    config = Config(
        # Path-style URLs work with every S3-compatible server (SeaweedFS, MinIO) and with
        # buckets whose names contain dots; AWS still accepts them.
        s3={"addressing_style": "path"},
        retries={"max_attempts": 5, "mode": "standard"},
        # Enough pooled connections for the parallel transfers below plus their parts.
        max_pool_connections=4 * _WORKERS,
    )
    # A session per client: boto3's default session is not safe to share across threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region or None,
        aws_access_key_id=access_key_id or None,
        aws_secret_access_key=secret_access_key or None,
        config=config,
    )


def transfer_config() -> Any:
    """Return the TransferConfig used for every file transfer (multipart above 8 MiB)."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK)


def client_error_code(exc: BaseException) -> str:
    """Return the S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def is_missing(exc: BaseException) -> bool:
    """Return True when ``exc`` says the object is not there (GET gives NoSuchKey, HEAD 404)."""
    return client_error_code(exc) in ("404", "NoSuchKey", "NotFound")


def is_precondition_failed(exc: BaseException) -> bool:
    """Return True when a conditional request lost (412, or 409 for a concurrent conditional write)."""
    return client_error_code(exc) in ("412", "PreconditionFailed", "409", "ConditionalRequestConflict")


# Codes an S3 server sends while it is (re)starting or overloaded: "please try again".
_TRANSIENT_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}


def is_transient(exc: BaseException) -> bool:
    """Return True when the server answered but asked to be tried again (5xx, SlowDown).

    A refused connection is not counted: a wrong endpoint should fail fast, after botocore's
    own retries, not wait out a grace period.
    """
    return client_error_code(exc) in _TRANSIENT_CODES


_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken", "ExpiredToken"}


@contextlib.contextmanager
def s3_errors(what: str, location: S3Location) -> Iterator[None]:
    """Translate botocore failures inside the block into KilnErrors with a hint."""
    from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        try:
            yield
        except (S3UploadFailedError, S3TransferFailedError) as wrapped:
            # boto3's transfer manager wraps the S3 error; unwrap it so the code survives.
            cause = wrapped.__cause__ or wrapped.__context__
            if isinstance(cause, (ClientError, BotoCoreError)):
                raise cause from wrapped
            raise ServiceUnavailable(f"{what}: {wrapped}", hint="Retry; check the S3 server's log.") from wrapped
    except KilnError:
        raise
    except NoCredentialsError as exc:
        raise ServiceUnavailable(
            f"{what}: no S3 credentials",
            hint="Set KILN_S3_ACCESS_KEY_ID and KILN_S3_SECRET_ACCESS_KEY (or an AWS profile/role).",
        ) from exc
    except ClientError as exc:
        code = client_error_code(exc)
        if code == "NoSuchBucket":
            raise NotFound(
                f"{what}: bucket {location.bucket!r} does not exist",
                hint="Create the bucket, or fix the s3:// URL in KILN_REPOSITORY / KILN_ARTIFACT_STORE.",
            ) from exc
        if code in _AUTH_CODES:
            raise ServiceUnavailable(
                f"{what}: S3 refused the credentials ({code}) for {location.url()}",
                hint="Check KILN_S3_ACCESS_KEY_ID / KILN_S3_SECRET_ACCESS_KEY and the bucket policy.",
            ) from exc
        raise ServiceUnavailable(f"{what}: S3 error {code}: {exc}", hint="Retry; check the S3 server's log.") from exc
    except BotoCoreError as exc:  # connection refused, DNS, timeouts
        raise ServiceUnavailable(
            f"{what}: cannot reach S3 ({type(exc).__name__}: {exc})",
            hint="Check KILN_S3_ENDPOINT_URL and that the S3 server is running.",
        ) from exc


def list_keys(client: Any, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Yield every object (``Key``, ``Size``, ``ETag`` ...) whose key starts with ``prefix``."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def delete_keys(client: Any, bucket: str, keys: Iterable[str]) -> None:
    """Delete ``keys`` in batches of 1000 (the DeleteObjects limit)."""
    batch: list[str] = []

    def flush() -> None:
        if batch:
            resp = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise ServiceUnavailable(f"S3 refused to delete {len(errors)} objects, e.g. {errors[0]}")
            batch.clear()

    for key in keys:
        batch.append(key)
        if len(batch) == 1000:
            flush()
    flush()


def _parallel(func: Callable[[T], None], items: list[T]) -> None:
    if len(items) <= 1:
        for it in items:
            func(it)
        return
    with ThreadPoolExecutor(max_workers=min(_WORKERS, len(items))) as pool:
        # list() re-raises the first failure in the caller's thread.
        list(pool.map(func, items))


def upload_files(client: Any, bucket: str, files: list[tuple[Path, str]]) -> None:
    """Upload ``(local path, key)`` pairs in parallel; each file over 8 MiB goes multipart."""
    config = transfer_config()
    _parallel(lambda pair: client.upload_file(str(pair[0]), bucket, pair[1], Config=config), files)


def download_keys(client: Any, bucket: str, pairs: list[tuple[str, Path]]) -> None:
    """Stream ``(key, local path)`` pairs to disk in parallel (ranged parts for big objects)."""
    config = transfer_config()

    def one(pair: tuple[str, Path]) -> None:
        key, dest = pair
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(dest), Config=config)

    _parallel(one, pairs)


def safe_relpath(rel: str) -> PurePosixPath:
    """Return ``rel`` as a relative path, refusing absolute paths and ``..`` (keys come from a bucket)."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise KilnError(f"refusing object path {rel!r} outside its directory")
    return p
