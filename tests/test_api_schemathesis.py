"""Property-based requests from the OpenAPI document (schemathesis): no server error, and every
status code, content type and body the API answers is the one its document declares.

Examples are bounded (``max_examples`` per operation, derandomised) so the module stays a
regular part of the suite; schemathesis and hypothesis are pinned in constraints.txt.
"""

from __future__ import annotations

import os
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from jobs_support import redis_url
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from services.graph.engines import ENGINES
from services.settings import Settings
from workers.app import create_celery_app

MAX_EXAMPLES = 50


def _app() -> object:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="kiln-schemathesis-"))
    s = Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",  # built at import, before conftest points KILN_DATA_DIR away from the home
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
    )
    return create_app(s, create_celery_app(s))


APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# Valid requests and invalid ones (wrong types, out of range, missing fields) alike.
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_the_api_answers_only_what_its_openapi_document_declares(case: schemathesis.Case) -> None:
    # A submission for an engine with no live worker is refused (503 ENGINE_UNAVAILABLE): a
    # worker's heartbeat, refreshed for every case, lets valid jobs through to the rest of the API.
    APP.state.workers.worker_heartbeat(  # type: ignore[attr-defined]
        "schemathesis", engines=list(ENGINES), versions={}, pid=os.getpid(), concurrency=1
    )
    case.call_and_validate(checks=CHECKS)
