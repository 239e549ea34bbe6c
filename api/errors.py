"""The API's one error handler: a KilnError's code picks the status from HTTP_STATUS.

FastAPI's own request validation errors become INVALID_SPEC (422) naming each field, so
every 4xx body has the same shape: ``{code, message, hint, details}``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.errors import HTTP_STATUS, InvalidSpec, KilnError
from services.spec import TargetName

__all__ = ["error_response", "install_error_handlers"]

log = logging.getLogger("kiln.api")


def error_response(err: KilnError) -> JSONResponse:
    """Return the JSON response for ``err``."""
    status = HTTP_STATUS.get(err.code, 500)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(err.to_dict(), status_code=status, headers=headers)


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def _kiln_error(_: Request, exc: KilnError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Any:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(KilnError(f"internal error: {type(exc).__name__}"))
