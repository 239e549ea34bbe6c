"""Detect what a model file is from its content, not its name.

Magic bytes and archive members decide; the file name is only a tie-breaker and a clue for
error messages. A spec may override detection with ``source_format``.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.descriptors import registry
from services.errors import KilnError, SourceUnreadable, UnsafeInput, UnsupportedFormat
from services.formats._types import Format
from services.formats.archives import archive_kind, list_members, safe_extract
from services.formats.vetting import vet_source

__all__ = ["DetectedSource", "detect_format", "open_source", "sha256_path"]

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
PICKLE_PROTOCOLS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass
class DetectedSource:
    """A model on disk, resolved to the path its format's loader reads."""

    format: Format
    path: Path  # the file or directory a loader opens (model.onnx, saved_model dir, model.xml, ...)
    seen: str  # what detection saw, for messages and the manifest
    sha256: str = ""
    extras: dict[str, str] = field(default_factory=dict)
    #: The format vetting approved it as (services/formats/vetting.py), "off" when vetting was
    #: switched off, "" when nothing vetted it (a worker refuses to load such a source).
    vetted: str = ""


def sha256_path(path: Path) -> str:
    """Return the sha256 of a file, or of a directory's sorted relative paths and contents."""
    h = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _head(path: Path, n: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _looks_like_onnx(head: bytes) -> bool:
    # ModelProto's first field on disk is ir_version (field 1, varint): tag byte 0x08,
    # followed by a small version number. Producers always write it first.
    return len(head) >= 2 and head[0] == 0x08 and 1 <= head[1] <= 20


def _zip_kind(members: list[str]) -> tuple[Format | None, str]:
    names = set(members)
    base = {m.rsplit("/", 1)[-1] for m in members}
    if "config.json" in names and ("model.weights.h5" in names or "metadata.json" in names):
        return Format.KERAS, "Keras v3 archive (config.json, model.weights.h5)"
    # torch.export's .pt2 is a zip holding a serialized ExportedProgram.
    if any(m.endswith(("serialized_exported_program.json", "models/model.json")) for m in members) or any(
        "/models/" in m and m.endswith(".json") for m in members
    ):
        return Format.TORCH_EXPORT, "torch.export archive (serialized ExportedProgram)"
    has_code = any("/code/" in m for m in members)
    if has_code and "constants.pkl" in base:
        return Format.TORCHSCRIPT, "TorchScript archive (code/, constants.pkl)"
    if "data.pkl" in base:
        return None, "a torch.save pickle (data.pkl without TorchScript code/)"
    if "saved_model.pb" in base or "saved_model.pbtxt" in base:
        return Format.SAVEDMODEL, "archive holding a TF SavedModel"
    return None, f"zip archive with members {sorted(members)[:6]}"


def _descriptor_sniff(hook: str, subject: Path | list[str]) -> tuple[Format, str] | None:
    """Return the first registered format whose ``hook`` sniffer recognises ``subject``."""
    for f in registry().formats.values():
        entry = getattr(f, hook)
        if entry is not None:
            seen = _load(entry)(subject)
            if seen:
                return Format(f.name), str(seen)
    return None


def _load(entry: str) -> Any:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)


def detect_format(path: Path) -> tuple[Format, str]:
    """Return the format of ``path`` and a description of what was seen.

    Raises UNSUPPORTED_FORMAT (naming what was seen), UNSAFE_INPUT for pickles, and
    SOURCE_UNREADABLE for an empty or missing file.
    """
    if not path.exists():
        raise SourceUnreadable(f"{path} does not exist", hint="Check the path.")
    if path.is_dir():
        return _detect_dir(path)
    size = path.stat().st_size
    if size == 0:
        raise SourceUnreadable(f"{path.name} is empty")
    head = _head(path)
    if head.startswith(HDF5_MAGIC):
        return Format.KERAS, "HDF5 file (Keras .h5)"
    if len(head) >= 8 and head[4:8] == b"TFL3":
        return Format.TFLITE, "FlatBuffer with file identifier TFL3"
    if head.lstrip().startswith(b"<?xml") or head.lstrip().startswith(b"<net"):
        if b"<net" in head:
            return Format.OPENVINO_IR, "OpenVINO IR XML (<net>)"
        raise UnsupportedFormat(f"{path.name} is XML but not an OpenVINO IR (no <net> element)")
    if head.startswith(PICKLE_PROTOCOLS):
        raise UnsafeInput(
            f"{path.name} is a Python pickle; Kiln never unpickles untrusted data",
            hint="Export TorchScript (torch.jit.script/trace(...).save) or torch.export (torch.export.save) instead.",
        )
    kind = archive_kind(path)
    if kind == "zip":
        fmt, seen = _zip_kind(list_members(path))
        if fmt is Format.TORCH_EXPORT:
            # torch.export is recognised loosely (any JSON under models/); a registered format
            # whose sniffer claims the archive outright (a Paddle models/model.json with its
            # model.pdiparams) is the more specific verdict.
            found = _descriptor_sniff("detect_archive", list_members(path))
            if found is not None:
                return found
        if fmt is None and "pickle" in seen:
            raise UnsafeInput(
                f"{path.name} is {seen}; loading it would run arbitrary code",
                hint="Export TorchScript (torch.jit.script/trace(...).save) or torch.export (torch.export.save) instead.",
            )
        if fmt is None:
            found = _descriptor_sniff("detect_archive", list_members(path))
            if found is not None:
                return found
            raise UnsupportedFormat(f"{path.name}: {seen}")
        return fmt, seen
    if kind == "tar":
        members = list_members(path)
        if any(m.rsplit("/", 1)[-1] in ("saved_model.pb", "saved_model.pbtxt") for m in members):
            return Format.SAVEDMODEL, "tar archive holding a TF SavedModel"
        if any(m.endswith(".onnx") for m in members):
            return Format.ONNX, "tar archive holding an ONNX model"
        if any(m.endswith(".xml") for m in members):
            return Format.OPENVINO_IR, "tar archive holding an OpenVINO IR"
        found = _descriptor_sniff("detect_archive", members)
        if found is not None:
            return found
        raise UnsupportedFormat(f"{path.name}: tar archive with members {sorted(members)[:6]}")
    if _looks_like_onnx(head):
        return Format.ONNX, "protobuf starting with ir_version (ONNX ModelProto)"
    if path.suffix in (".plan", ".engine"):
        return Format.TENSORRT_PLAN, "TensorRT plan (by name; plans carry no public magic)"
    found = _descriptor_sniff("detect", path)
    if found is not None:
        return found
    raise UnsupportedFormat(
        f"{path.name}: unrecognised content (first bytes {head[:8].hex()}, {size} bytes)",
        seen=head[:16].hex(),
    )


def _detect_dir(path: Path) -> tuple[Format, str]:
    if (path / "saved_model.pb").exists() or (path / "saved_model.pbtxt").exists():
        return Format.SAVEDMODEL, "directory with saved_model.pb"
    xmls = sorted(path.glob("*.xml"))
    if xmls:
        return Format.OPENVINO_IR, f"directory with {xmls[0].name}"
    onnx_files = sorted(path.glob("*.onnx"))
    if len(onnx_files) == 1:
        return Format.ONNX, f"directory with {onnx_files[0].name} (external data alongside)"
    subdirs = [p for p in path.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and not any(p.is_file() for p in path.iterdir()):
        return _detect_dir(subdirs[0])
    found = _descriptor_sniff("detect", path)
    if found is not None:
        return found
    listing = sorted(p.name for p in path.iterdir())[:8]
    raise UnsupportedFormat(f"directory {path.name} holds no model Kiln recognises: {listing}")


def _resolve_loadable(fmt: Format, root: Path) -> Path:
    """Return the path a loader opens within an extracted archive or directory (or ``root``, a file).

    A format's ``loadable`` hook (Caffe, Hugging Face, Paddle: each vets as it resolves) runs
    for a plain file too, so a file forced to such a format meets its checks; whatever it
    raises refuses the source.
    """
    entry = registry().formats[fmt.value].loadable
    if entry is not None:
        try:
            return Path(_load(entry)(root))
        except KilnError:
            raise
        except Exception as exc:
            raise SourceUnreadable(
                f"{root.name} cannot be opened as {fmt.value}: {type(exc).__name__}: {str(exc)[:300]}",
                hint="Check source_format in the spec, or upload the model as its framework saves it.",
            ) from exc
    if root.is_file():
        return root
    if fmt is Format.SAVEDMODEL:
        hits = sorted(root.rglob("saved_model.pb")) or sorted(root.rglob("saved_model.pbtxt"))
        if not hits:
            raise SourceUnreadable("no saved_model.pb in the archive")
        return hits[0].parent
    if fmt is Format.ONNX:
        hits = sorted(root.rglob("*.onnx"))
        if len(hits) != 1:
            raise UnsupportedFormat(f"expected one .onnx file, found {len(hits)}")
        return hits[0]
    if fmt is Format.OPENVINO_IR:
        hits = sorted(root.rglob("*.xml"))
        if not hits:
            raise SourceUnreadable("no .xml in the OpenVINO IR directory")
        return hits[0]
    return root


def open_source(
    path: Path, work_dir: Path, override: Format | None = None, *, sha256: str | None = None, vet: bool = True
) -> DetectedSource:
    """Detect ``path`` and make it loadable, extracting archives safely into ``work_dir``.

    ``sha256`` is the file's hash when the caller already has it (the API hashes an upload
    while streaming it to disk); hashing a 1 GiB model again costs seconds. ``vet`` runs the
    format's vetting (its descriptor's ``vet``: UNSAFE_INPUT for graphs that would reach files,
    the network or Python), as the format the source is opened as: a forced ``override``
    included. Any failure of it refuses the source; only a test of the sandbox turns it off
    (KILN_VET_UPLOADS).
    """
    path = Path(path)
    try:
        fmt, seen = detect_format(path)
    except UnsupportedFormat as exc:
        # The spec's word is what `source_format` is for: content Kiln does not recognise is
        # taken as the format named (its loader then says whether it can read it). Pickles
        # and unreadable files raise other errors, which no override lifts.
        if override is None:
            raise
        fmt, seen = override, f"content not recognised ({exc.message}); taken as {override.value} by the spec"
    if override is not None and override is not fmt:
        seen = f"{seen}; overridden to {override.value} by the spec"
        fmt = override
    digest = sha256 if sha256 is not None and path.is_file() else sha256_path(path)
    loadable = path
    kind = archive_kind(path) if path.is_file() else None
    # Keras v3, TorchScript and torch.export files are zips read whole by their own loaders.
    if kind and not registry().formats[fmt.value].archive_is_the_model:
        dest = work_dir / "source"
        if dest.exists():
            shutil.rmtree(dest)
        safe_extract(path, dest)
        loadable = _resolve_loadable(fmt, dest)
    else:
        loadable = _resolve_loadable(fmt, path)
    if fmt is Format.OPENVINO_IR:
        bin_path = loadable.with_suffix(".bin")
        if not bin_path.exists():
            raise SourceUnreadable(
                f"OpenVINO IR {loadable.name} has no {bin_path.name} beside it",
                hint="Upload the .xml and .bin together, in a directory or archive.",
            )
    # The format vetted is the format loaded: a forced one is vetted as itself, and a vetter's
    # failure is the upload's refusal, whatever the spec says (services/formats/vetting.py).
    vetted = vet_source(fmt.value, loadable, sha256=digest if loadable == path else None, enabled=vet)
    return DetectedSource(format=fmt, path=loadable, seen=seen, sha256=digest, vetted=vetted)
