"""The API's OpenAPI document: FastAPI's rendering, completed where it falls short of what the API sends.

A client generated from the document (tests/test_openapi_client.py builds one with
openapi-python-client) and schemathesis (tests/test_api_schemathesis.py) both rely on it, so:

- CompileSpec and what it references are pydantic's own JSON Schema (FastAPI's drops defaults);
- ``GET /jobs/{id}/events`` is ``text/event-stream`` with an ``itemSchema`` per event and the
  event models as components (api/events.py); FastAPI's ``schema: {"type": "string"}`` next to
  it goes, since beside an ``itemSchema`` a ``schema`` describes the whole stream;
- POST /compile's multipart body is the ``JobCreate`` component;
- every error answer is JSON ``ErrorPublic`` (api/openapi_errors.py), never FastAPI's
  ``HTTPValidationError``, which the API does not send;
- an operation's id is its route function's name (``submit``, ``get_job``, ``job_events``...),
  which generated clients use as function names.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from api.events import event_stream_schemas
from api.openapi_errors import document_errors
from services.spec import CompileSpec
from services.tune.options import TuneOptions

__all__ = ["complete_openapi", "operation_id", "response_header"]


def operation_id(route: APIRoute) -> str:
    """Return the operation id of ``route``: its function's name (unique across the API's routes)."""
    return route.name


def response_header(description: str, type_: str = "string") -> dict[str, Any]:
    """Return the OpenAPI Header Object of a header the answer always carries."""
    return {"description": description, "required": True, "schema": {"type": type_}}


def _drop_stream_schemas(doc: dict[str, Any]) -> None:
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            for response in op.get("responses", {}).values():
                for media in response.get("content", {}).values():
                    if "itemSchema" in media:
                        media.pop("schema", None)


def _name_inline_bodies(doc: dict[str, Any]) -> None:
    # A request body written out by a route (POST /compile's multipart parts) becomes the
    # component its title names, so generated clients name its class for it.
    schemas = doc["components"]["schemas"]
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            for media in op.get("requestBody", {}).get("content", {}).values():
                schema = media.get("schema", {})
                if "title" in schema and "$ref" not in schema:
                    schemas[schema["title"]] = schema
                    media["schema"] = {"$ref": f"#/components/schemas/{schema['title']}"}


def complete_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        spec_schema = CompileSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        # POST /compile's multipart body refers to CompileSpec; pydantic's own JSON Schema is the
        # source, so the document shows exactly what `kiln schema` prints.
        for name, sub in spec_schema.pop("$defs", {}).items():
            schemas[name] = sub
        schemas["CompileSpec"] = spec_schema
        # POST /tune's `tune` part, likewise pydantic's own (its defaults are the search's).
        schemas["TuneOptions"] = TuneOptions.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in event_stream_schemas().items():
            schemas.setdefault(name, sub)
        _name_inline_bodies(doc)
        _drop_stream_schemas(doc)
        document_errors(doc)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
