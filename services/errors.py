"""Kiln's one root error type and its stable codes.

Every failure a user can see is a :class:`KilnError` with a stable ``code``, a message
and a hint. The CLI prints them and exits non-zero; the API maps ``code`` to an HTTP
status through :data:`HTTP_STATUS` in a single handler. No traceback reaches a user.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "HTTP_STATUS",
    "AccuracyDropExceeded",
    "Cancelled",
    "ConversionFailed",
    "EngineUnavailable",
    "Forbidden",
    "IdempotencyKeyReused",
    "InvalidModel",
    "InvalidSettings",
    "InvalidSpec",
    "KilnError",
    "NoCandidate",
    "NoRoute",
    "NotFound",
    "ParityFailed",
    "QuotaExceeded",
    "RepositoryConflict",
    "ServiceUnavailable",
    "SlowerThanFp32",
    "SourceNonfinite",
    "SourceUnreadable",
    "StorageFull",
    "Timeout",
    "Unauthorized",
    "UnsafeInput",
    "UnsupportedFormat",
    "UnsupportedOps",
    "UploadTooLarge",
    "install_formats_hint",
    "tool_said",
]


class KilnError(Exception):
    """Root of every error Kiln reports to a user; ``code`` never changes meaning."""

    code = "INTERNAL"
    default_hint = "This is a bug in Kiln; please report it with the job id."

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON body shared by the CLI (--json) and the API."""
        body: dict[str, Any] = {"code": self.code, "message": self.message, "hint": self.hint}
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> KilnError:
        """Rebuild an error recorded in a job (the code selects the class)."""
        err_cls = _BY_CODE.get(body.get("code", ""), KilnError)
        err = err_cls(body.get("message", ""), hint=body.get("hint"), **(body.get("details") or {}))
        if err_cls is KilnError:
            err.code = body.get("code", KilnError.code)
        return err

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidSpec(KilnError):
    code = "INVALID_SPEC"
    default_hint = "Check the spec against the JSON Schema printed by `kiln schema`."


#: Builds UnsupportedFormat's default hint, which names every source format. Errors sit below the
#: descriptors that declare the formats (and raise these errors), so services.descriptors installs
#: it when imported: every module that can meet an unsupported format has imported it by then.
_formats_hint: Callable[[], str] | None = None


def install_formats_hint(build: Callable[[], str]) -> None:
    """Set the function that gives UnsupportedFormat's default hint (services.descriptors calls it)."""
    global _formats_hint
    _formats_hint = build


def _readable_formats_hint() -> str:
    """Return the hint naming every source format, or the bare advice before any format is declared."""
    if _formats_hint is None:
        return "Set `source_format` in the spec if detection guessed wrong."
    return _formats_hint()


class UnsupportedFormat(KilnError):
    code = "UNSUPPORTED_FORMAT"

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message, hint=hint if hint is not None else _readable_formats_hint(), **details)


class SourceUnreadable(KilnError):
    code = "SOURCE_UNREADABLE"
    default_hint = "The file looks truncated or corrupt; re-export it from the training framework."


class SourceNonfinite(KilnError):
    """The source gives no finite number on an output: nothing an artifact gives could be checked against it."""

    code = "SOURCE_NONFINITE"
    default_hint = (
        "The source model gives no finite outputs on these inputs, so no artifact can be verified against it: "
        "give real sample data (`calibration`), or value ranges for the inputs (`inputs.<name>.range`)."
    )


class InvalidModel(KilnError):
    """A readable model file whose graph its format's own checker refuses (not truncated: invalid)."""

    code = "INVALID_MODEL"
    default_hint = "Re-export the model from its framework; the message names what the checker refused."


class UnsafeInput(KilnError):
    code = "UNSAFE_INPUT"
    default_hint = "Kiln never runs code from a model; export a format that carries no code."


class UploadTooLarge(KilnError):
    code = "UPLOAD_TOO_LARGE"
    default_hint = "Raise KILN_MAX_UPLOAD_BYTES on the server or upload a smaller model."


class NoRoute(KilnError):
    code = "NO_ROUTE"
    default_hint = "Run `kiln routes` to see which formats reach which targets."


class EngineUnavailable(KilnError):
    code = "ENGINE_UNAVAILABLE"
    default_hint = "Install the engine's extra (pip install 'kiln[<engine>]') or start its worker."


class ConversionFailed(KilnError):
    code = "CONVERSION_FAILED"
    default_hint = "The step's tool failed; its output tail is in the details."


class ParityFailed(KilnError):
    code = "PARITY_FAILED"
    default_hint = (
        "The artifact's outputs differ from the source model beyond tolerance; "
        "try a higher precision or relax `tolerances` in the spec if the difference is acceptable."
    )


class AccuracyDropExceeded(KilnError):
    """An artifact scores worse than its source on the spec's labelled data by more than ``evaluation.max_drop``."""

    code = "ACCURACY_DROP_EXCEEDED"
    default_hint = (
        "The artifact loses more task accuracy on your labelled data than evaluation.max_drop allows (both scores "
        "are in details.evaluation): compile at a higher precision, give calibration data closer to real inputs, "
        "or raise max_drop if the loss is acceptable."
    )


class SlowerThanFp32(KilnError):
    code = "SLOWER_THAN_FP32"
    default_hint = (
        "The spec asks for an artifact no slower than the fp32 one on the same engine; deploy fp32, "
        "or drop benchmark.require_no_slower_than_fp32 if the smaller size is worth the latency."
    )


class NoCandidate(KilnError):
    code = "NO_CANDIDATE"
    default_hint = (
        "No candidate of the tune met every constraint; its report says why each failed: loosen max_p99_ms, "
        "add targets or precisions, or give a larger budget."
    )


class Timeout(KilnError):
    code = "TIMEOUT"
    default_hint = "The step exceeded its time limit; raise it in the settings or simplify the model."


class Cancelled(KilnError):
    code = "CANCELLED"
    default_hint = "The job was cancelled by a user."


class NotFound(KilnError):
    code = "NOT_FOUND"
    default_hint = "Check the id or name."


class Unauthorized(KilnError):
    code = "UNAUTHORIZED"
    default_hint = "Send `Authorization: Bearer <token>` with a valid API token."


class Forbidden(KilnError):
    code = "FORBIDDEN"
    default_hint = "The token is valid but lacks the scope this call needs."


class RepositoryConflict(KilnError):
    code = "REPOSITORY_CONFLICT"
    default_hint = "Pick another model name or version, or leave `version` unset to take the next free one."


class ServiceUnavailable(KilnError):
    code = "SERVICE_UNAVAILABLE"
    default_hint = "A backing service (broker, database or storage) is not answering; retry shortly."


class StorageFull(KilnError):
    code = "STORAGE_FULL"
    default_hint = (
        "The disk holding the artifact store, the repository or the scratch space is full; free space and resubmit."
    )


class InvalidSettings(KilnError):
    code = "INVALID_SETTINGS"
    default_hint = "Fix the KILN_* settings named above (services/settings.py documents each); see docs/security.md."


class IdempotencyKeyReused(KilnError):
    code = "IDEMPOTENCY_KEY_REUSED"
    default_hint = (
        "An Idempotency-Key names one request: this key was sent with another model or spec within 24 h. "
        "Send a new key for a new request (the same key only to repeat the same one)."
    )


class QuotaExceeded(KilnError):
    code = "QUOTA_EXCEEDED"
    default_hint = (
        "This tenant has as many jobs waiting to start as its quota allows (GET /quota shows it): wait for "
        "some to start, or cancel one, then submit again."
    )


class UnsupportedOps(KilnError):
    code = "UNSUPPORTED_OPS"
    default_hint = "The target engine cannot import some of the model's operators; the list is in the details."


_BY_CODE: dict[str, type[KilnError]] = {
    cls.code: cls
    for cls in (
        KilnError,
        InvalidSpec,
        UnsupportedFormat,
        SourceUnreadable,
        UnsafeInput,
        UploadTooLarge,
        NoRoute,
        EngineUnavailable,
        ConversionFailed,
        ParityFailed,
        AccuracyDropExceeded,
        NoCandidate,
        Timeout,
        Cancelled,
        NotFound,
        Unauthorized,
        Forbidden,
        InvalidSettings,
        RepositoryConflict,
        ServiceUnavailable,
        UnsupportedOps,
        StorageFull,
        IdempotencyKeyReused,
        QuotaExceeded,
    )
}

#: The one table from error code to HTTP status, used by the API's single handler.
HTTP_STATUS: dict[str, int] = {
    "INVALID_SPEC": 422,
    "UNSUPPORTED_FORMAT": 415,
    "SOURCE_UNREADABLE": 400,
    "UNSAFE_INPUT": 400,
    "SOURCE_NONFINITE": 422,
    "INVALID_MODEL": 422,
    "UPLOAD_TOO_LARGE": 413,
    "NO_ROUTE": 422,
    "ENGINE_UNAVAILABLE": 503,
    "CONVERSION_FAILED": 500,
    "PARITY_FAILED": 500,
    "ACCURACY_DROP_EXCEEDED": 500,
    "SLOWER_THAN_FP32": 500,
    "NO_CANDIDATE": 422,
    "TIMEOUT": 504,
    "CANCELLED": 409,
    "NOT_FOUND": 404,
    "UNAUTHORIZED": 401,
    "FORBIDDEN": 403,
    "REPOSITORY_CONFLICT": 409,
    "SERVICE_UNAVAILABLE": 503,
    "UNSUPPORTED_OPS": 422,
    "INVALID_SETTINGS": 500,
    "INTERNAL": 500,
    "STORAGE_FULL": 507,
    "IDEMPOTENCY_KEY_REUSED": 409,
    "QUOTA_EXCEEDED": 429,
    # The web framework's own refusals (api/errors.py FRAMEWORK_CODES), before any Kiln code runs.
    "MALFORMED_REQUEST": 400,
    "METHOD_NOT_ALLOWED": 405,
    "UNSUPPORTED_MEDIA_TYPE": 415,
}


#: A line that names a failure, in what converters print (pnnx, onnx2tf, MNNConvert, ...).
_FAILURE_LINE = re.compile(
    r"error|exception|fail|cannot|can't|could not|unsupported|not supported|invalid|not found|"
    r"is not|no such|out of range|mismatch|abort",
    re.I,
)


def tool_said(text: str, exc: BaseException | None = None, *, context: int = 2, limit: int = 700) -> str:
    """Return what a tool said about its failure, for an error message: its last lines, and the line naming the failure.

    One line cut out of a tool's output often names nothing (pnnx's ``" is not output of
    any previous nodes."``, tf2onnx's ``list index out of range``): the last line is kept with
    the ``context`` lines before it, joined by `` | ``, and when none of them names a failure
    the last line that does is put in front. For an exception, its type and the innermost
    frame that raised it are added. The whole output stays in the error's ``output_tail``.
    """
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if lines:
        tail = lines[-(context + 1) :]
        said = " | ".join(tail)
        if not any(_FAILURE_LINE.search(ln) for ln in tail):
            named = [ln for ln in lines[: -len(tail)] if _FAILURE_LINE.search(ln)]
            if named:
                said = f"{named[-1]} | … | {said}"
    else:
        said = type(exc).__name__ if exc is not None else "it printed nothing"
    if exc is not None:
        name = type(exc).__name__
        if not said.startswith(name) and f"{name}:" not in said:
            said = f"{name}: {said}"
        frame = _innermost_frame(exc)
        if frame:
            said += f" (raised at {frame})"
    return said if len(said) <= limit else "…" + said[-limit:]


def _innermost_frame(exc: BaseException) -> str | None:
    """Return ``file:line in function`` of the frame that raised ``exc`` (its package-relative path)."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    parts = code.co_filename.replace("\\", "/").split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else parts[-1]
    return f"{short}:{tb.tb_lineno} in {code.co_name}"
