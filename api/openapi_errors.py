"""Put every error status the API can answer into its OpenAPI document, as JSON ``ErrorPublic``.

Routes declare the errors of their own logic; the ones that any route can give come from the
layers around it and are added here for every operation, so the document cannot fall behind
(schemathesis checks it in tests/test_api_schemathesis.py):

- 401/403 from the bearer-token dependency (operations with ``security``);
- 422 INVALID_SPEC from request validation (operations with parameters or a body);
- 400 MALFORMED_REQUEST when the framework cannot parse a body;
- 500 INTERNAL and 503 SERVICE_UNAVAILABLE from api/errors.py's middleware, and 507
  STORAGE_FULL on uploads.

An error body is always JSON, also on routes whose success is text or a tar. FastAPI's own
``HTTPValidationError`` for 422 is replaced too: api/errors.py answers INVALID_SPEC instead.
"""

from __future__ import annotations

from typing import Any

from api.schemas import ErrorPublic

__all__ = ["document_errors"]

_REF = "#/components/schemas/ErrorPublic"
#: Schemas FastAPI adds for its 422 answer, which the API never sends.
_FASTAPI_422 = ("HTTPValidationError", "ValidationError")


def _statuses(op: dict[str, Any]) -> dict[str, str]:
    found = {
        "500": "INTERNAL (a bug; the server's log has the details)",
        "503": "SERVICE_UNAVAILABLE (the database, broker or storage is not answering)",
    }
    if op.get("security"):
        found["401"] = "UNAUTHORIZED (no or unknown token, with auth enabled)"
        found["403"] = "FORBIDDEN (the token lacks the scope)"
    if op.get("parameters") or op.get("requestBody"):
        found["422"] = "INVALID_SPEC (naming the field)"
    if op.get("requestBody"):
        found["400"] = "MALFORMED_REQUEST (a body that cannot be parsed)"
    if "multipart/form-data" in op.get("requestBody", {}).get("content", {}):
        found["507"] = "STORAGE_FULL (no disk space left for the upload)"
    return found


def document_errors(doc: dict[str, Any]) -> None:
    """Add the error responses every operation can give, and make every error body JSON ``ErrorPublic``."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("ErrorPublic", ErrorPublic.model_json_schema(ref_template="#/components/schemas/{model}"))
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            for status, description in _statuses(op).items():
                responses.setdefault(status, {"description": description})
                if responses[status].get("description") == "Validation Error":  # FastAPI's 422
                    responses[status]["description"] = description
            for status, response in responses.items():
                if not status.isdigit() or int(status) < 400:
                    continue
                content = response.get("content", {})
                # A route's own error model (e.g. /readyz's checks) stays; anything else is ErrorPublic.
                ref = content.get("application/json", {}).get("schema", {}).get("$ref")
                if ref is None or ref.rsplit("/", 1)[-1] in _FASTAPI_422:
                    response["content"] = {"application/json": {"schema": {"$ref": _REF}}}
                elif len(content) > 1:
                    response["content"] = {"application/json": content["application/json"]}
    for name in _FASTAPI_422:
        schemas.pop(name, None)
