"""The API's error handling: every error body is ``{code, message, hint, details}``.

A KilnError's code picks the status from HTTP_STATUS. FastAPI's own request validation
errors become INVALID_SPEC (422) naming each field; the framework's own HTTP errors (404 for
an unknown path, 405, 400 for a body it cannot parse) get a code from :data:`FRAMEWORK_CODES`.
Anything else is caught by :class:`UnexpectedErrorMiddleware`: a backing service that does not
answer (database, broker, S3) is 503 SERVICE_UNAVAILABLE like /readyz, a full disk 507
STORAGE_FULL, the rest 500 INTERNAL,
logged with its traceback but never sent to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.errors import HTTP_STATUS, InvalidSpec, KilnError, ServiceUnavailable, StorageFull
from services.outages import backing_service_down, storage_full
from services.spec import TargetName

__all__ = ["FRAMEWORK_CODES", "UnexpectedErrorMiddleware", "error_response", "install_error_handlers"]

log = logging.getLogger("kiln.api")

#: Status of a framework HTTP error -> (code, hint). Statuses not listed fall back to INTERNAL.
FRAMEWORK_CODES: dict[int, tuple[str, str]] = {
    400: ("MALFORMED_REQUEST", "The request body could not be parsed; send well-formed JSON or multipart data."),
    404: ("NOT_FOUND", "No such path; the OpenAPI document at /openapi.json lists every route."),
    405: ("METHOD_NOT_ALLOWED", "This path does not take this method; see the Allow header."),
    413: ("UPLOAD_TOO_LARGE", "Send a smaller request."),
    415: ("UNSUPPORTED_MEDIA_TYPE", "Send the content type the OpenAPI document names for this route."),
}


def error_response(err: KilnError, headers: dict[str, str] | None = None) -> JSONResponse:
    """Return the JSON response for ``err``."""
    status = HTTP_STATUS.get(err.code, 500)
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(err.to_dict(), status_code=status, headers=headers or None)


def _validation_error(exc: RequestValidationError) -> InvalidSpec:
    problems = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ())]
        # ("body", "spec", "targets", 0) -> "spec.targets.0"; FastAPI's location prefix is noise.
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        problems.append({"field": ".".join(loc) or "(request)", "problem": e.get("msg", "")})
    text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
    hint = None
    if any(".targets" in f".{p['field']}" for p in problems):
        hint = "Valid targets: " + ", ".join(t.value for t in TargetName) + "."
    return InvalidSpec(f"invalid request: {text}", hint=hint, errors=problems)


def _framework_error(exc: StarletteHTTPException) -> JSONResponse:
    code, hint = FRAMEWORK_CODES.get(exc.status_code, ("INTERNAL", KilnError.default_hint))
    body = {"code": code, "message": str(exc.detail), "hint": hint}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _unexpected_error(exc: BaseException, method: str, path: str) -> KilnError:
    """Return what the client is told about ``exc``: SERVICE_UNAVAILABLE or INTERNAL, no traceback."""
    if storage_full(exc):
        log.error("%s %s: out of disk space: %s", method, path, exc)
        return StorageFull("the server has no disk space left for this request")
    service = backing_service_down(exc)
    if service is not None:
        log.warning("%s %s: %s is not answering: %s: %s", method, path, service, type(exc).__name__, exc)
        return ServiceUnavailable(f"the {service} is not answering", service=service)
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return KilnError(f"internal error: {type(exc).__name__}")


class UnexpectedErrorMiddleware:
    """Turn an exception no handler took into a JSON error *without re-raising it*.

    Starlette's handler for ``Exception`` answers and then re-raises, so uvicorn logs it and
    drops the connection: the client's next request on the same keep-alive connection was
    reset. Answering here ends the request normally and keeps the connection.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            err = _unexpected_error(exc, scope.get("method", ""), scope.get("path", ""))
            if started:  # a stream broke off mid-answer: nothing can be said any more
                return
            await error_response(err)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def _kiln_error(_: Request, exc: KilnError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _framework(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _framework_error(exc)

    app.add_middleware(UnexpectedErrorMiddleware)
