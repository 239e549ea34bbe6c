"""The job page's live part as Server-Sent Events of rendered HTML (htmx's SSE extension swaps it in).

An `update` event carries the whole live part whenever the job's version moves; its id is
the version, so a reconnecting EventSource (Last-Event-ID) gets nothing it already shows.
When the job is final a `finished` event follows and the stream ends; the page closes its
EventSource on it (`sse-close`), so the browser does not reconnect.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from api.routes.jobs import SSE_KEEPALIVE, SSE_POLL
from api.ui.pages import job_context
from api.ui.session import base_context, error_page, templates, viewer
from services.errors import KilnError

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _event(name: str, event_id: int, html: str) -> str:
    data = "\n".join(f"data: {line}" for line in html.splitlines() or [""])
    return f"id: {event_id}\nevent: {name}\n{data}\n\n"


async def _html_stream(request: Request, who: Any, job_id: str, after: int) -> Any:
    versions = request.app.state.job_versions
    template = templates.get_template("_job_live.html")
    shown = after
    still_open = False  # the newest render showed steps still being stopped after the job ended
    idle = 0.0
    yield "retry: 2000\n\n"
    while True:
        seen = await versions.get(job_id)
        if seen is None:
            return
        if seen.version > shown:
            ctx = await run_in_threadpool(job_context, request, job_id)
            html = template.render({**base_context(request, who), **ctx})
            shown = seen.version
            yield _event("update", shown, html)
            idle = 0.0
            still_open = not ctx["final"]
            if ctx["final"]:
                yield _event("finished", shown, "")
                return
            continue
        # A client resuming after the last update of a finished job: only `finished` is left.
        if seen.status in ("succeeded", "failed", "cancelled") and not still_open:
            yield _event("finished", shown, "")
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(SSE_POLL * 4 - asyncio.get_running_loop().time() % (SSE_POLL * 4))
        idle += SSE_POLL * 4
        if idle >= SSE_KEEPALIVE:
            idle = 0.0
            yield ": keep-alive\n\n"


@router.get("/jobs/{job_id}/stream")
async def job_stream(request: Request, job_id: str) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        await run_in_threadpool(request.app.state.jobs.job_status, job_id)
    except KilnError as exc:
        return error_page(request, who, exc)
    last = request.headers.get("last-event-id", "")
    return StreamingResponse(
        _html_stream(request, who, job_id, int(last) if last.isdigit() else 0),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
