"""Streaming multipart upload: file parts go to disk while hashed, under a hard size cap.

Starlette's ``request.form()`` would spool each file before we see it and cannot enforce a
limit while reading; here python-multipart's push parser is fed ``request.stream()``
chunks, file parts are written and hashed as they arrive (parsing and disk writes run in a
worker thread, one ~1 MiB batch at a time, so the event loop stays free), and the upload
stops with UPLOAD_TOO_LARGE the moment the cap is crossed. Memory stays at one batch plus
the text parts, which are bounded too: at most ``MAX_PARTS`` parts, ``MAX_FIELD_BYTES`` per
text part and ``MAX_TEXT_BYTES`` for all of them together; python-multipart itself bounds
each part's headers (8 of them, 4 KiB each: a malformed body past that).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from anyio import to_thread
from python_multipart.exceptions import ParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from services.errors import InvalidSpec, SourceUnreadable, UploadTooLarge

__all__ = ["ReceivedFile", "Upload", "receive_upload", "safe_filename"]

#: Parts that carry files; anything else is a small text field (the spec).
FILE_PARTS = ("model", "calibration", "evaluation")
MAX_FIELD_BYTES = 1 << 20
#: All text parts together (the spec, and whatever else a client sends): held in memory.
MAX_TEXT_BYTES = 2 << 20
#: Parts of one request: model, spec, calibration and evaluation, and room for a client's extra fields.
MAX_PARTS = 16
BATCH_BYTES = 1 << 20

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_filename(name: str, default: str = "model") -> str:
    """Return a file name safe to store: no directories, no odd characters, no leading dots."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = _UNSAFE.sub("_", base).lstrip(".")[:128]
    return base or default


@dataclass
class ReceivedFile:
    """A file part written to disk."""

    field: str
    filename: str
    path: Path
    sha256: str
    size: int


@dataclass
class Upload:
    """The parsed request: text fields and files on disk (under ``tmp_dir``, removed by ``cleanup``)."""

    tmp_dir: Path
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, ReceivedFile] = field(default_factory=dict)
    total_bytes: int = 0

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


class _Collector:
    """python-multipart callbacks: route each part to a hashed file or a bounded buffer."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.headers: dict[bytes, bytes] = {}
        self._hname = b""
        self._hvalue = b""
        self.name: str | None = None
        self.file: IO[bytes] | None = None
        self.hasher: Any = None
        self.size = 0
        self.text: bytearray | None = None
        self.filename = ""
        self.parts = 0
        self.text_bytes = 0  # of every text part so far

    # header callbacks
    def on_part_begin(self) -> None:
        self.headers, self.name, self.file, self.text = {}, None, None, None
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidSpec(
                f"the request has more than {MAX_PARTS} parts",
                hint="POST /compile takes a `model` file, a `spec` and optional `calibration` and `evaluation` files.",
            )

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self._hname.strip().lower()] = self._hvalue.strip()
        self._hname, self._hvalue = b"", b""

    def on_headers_finished(self) -> None:
        _, params = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        self.name = name
        self.size = 0
        if name in FILE_PARTS:
            if name in self.upload.files:
                raise InvalidSpec(f"the request has two `{name}` parts", hint="Send one model file per job.")
            raw = params.get(b"filename", b"").decode("utf-8", "replace")
            self.filename = safe_filename(raw, default=name)
            part_dir = self.upload.tmp_dir / name
            part_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(part_dir / self.filename, "wb")
            self.hasher = hashlib.sha256()
        else:
            self.text = bytearray()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        self.size += len(chunk)
        if self.file is not None:
            self.file.write(chunk)
            self.hasher.update(chunk)
        elif self.text is not None:
            if self.size > MAX_FIELD_BYTES:
                raise InvalidSpec(f"the `{self.name}` part is over {MAX_FIELD_BYTES} bytes", field=self.name)
            self.text_bytes += len(chunk)
            if self.text_bytes > MAX_TEXT_BYTES:
                raise UploadTooLarge(
                    f"the request's text parts are over {MAX_TEXT_BYTES} bytes together", limit=MAX_TEXT_BYTES
                )
            self.text += chunk

    def on_part_end(self) -> None:
        if self.file is not None:
            self.file.close()
            assert self.name is not None
            self.upload.files[self.name] = ReceivedFile(
                field=self.name,
                filename=self.filename,
                path=Path(self.file.name),
                sha256=self.hasher.hexdigest(),
                size=self.size,
            )
            self.file = None
        elif self.text is not None and self.name:
            self.upload.fields[self.name] = self.text.decode("utf-8", "replace")
            self.text = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _boundary(request: Request) -> bytes:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise SourceUnreadable(
            "POST /compile takes multipart/form-data with a `model` file part and a `spec` part",
            hint='curl -F model=@model.onnx -F \'spec={"targets":["onnxruntime"]};type=application/json\' ...',
        )
    return params[b"boundary"]


def _too_large(limit: int) -> UploadTooLarge:
    return UploadTooLarge(f"the upload is larger than this server's limit of {limit} bytes", limit=limit)


async def receive_upload(request: Request, *, max_bytes: int, tmp_root: Path) -> Upload:
    """Read the multipart body of ``request`` into an Upload; 413 as soon as ``max_bytes`` is crossed."""
    boundary = _boundary(request)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)  # refuse before reading a byte
    tmp_root.mkdir(parents=True, exist_ok=True)
    upload = Upload(tmp_dir=Path(tempfile.mkdtemp(prefix="upload-", dir=tmp_root)))
    collector = _Collector(upload)
    callbacks: Any = {
        name: getattr(collector, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)
    batch: list[bytes] = []
    batched = 0

    def feed(chunks: list[bytes]) -> None:
        for c in chunks:
            parser.write(c)

    try:
        async for chunk in request.stream():
            upload.total_bytes += len(chunk)
            if upload.total_bytes > max_bytes:
                raise _too_large(max_bytes)
            batch.append(chunk)
            batched += len(chunk)
            if batched >= BATCH_BYTES:
                await to_thread.run_sync(feed, batch)
                batch, batched = [], 0
        await to_thread.run_sync(feed, batch)
        parser.finalize()
    except ParseError as exc:
        collector.close()
        upload.cleanup()
        raise SourceUnreadable(f"the multipart body is malformed: {exc}") from exc
    except BaseException:
        collector.close()
        upload.cleanup()
        raise
    collector.close()
    return upload
