"""Model formats: detection from content, safe archive extraction."""

from services.formats._types import Format
from services.formats.archives import ArchiveLimits, safe_extract
from services.formats.detect import DetectedSource, detect_format, open_source, sha256_path

__all__ = [
    "ArchiveLimits",
    "DetectedSource",
    "Format",
    "detect_format",
    "open_source",
    "safe_extract",
    "sha256_path",
]
