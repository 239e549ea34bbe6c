"""The job page's live part as Server-Sent Events of rendered HTML (htmx's SSE extension swaps it in).

An `update` event carries the whole live part whenever the job's version moves; its id is
the version, so a reconnecting EventSource (Last-Event-ID) gets nothing it already shows.
When the job is final a `finished` event follows and the stream ends; the page closes its
EventSource on it (`sse-close`), so the browser does not reconnect.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from api.routes.jobs import SSE_KEEPALIVE
from api.ui.pages import job_context
from api.ui.session import base_context, error_page, templates, viewer
from api.ui.watch import job_watch
from services.errors import KilnError

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _event(name: str, event_id: int, html: str) -> str:
    data = "\n".join(f"data: {line}" for line in html.splitlines() or [""])
    return f"id: {event_id}\nevent: {name}\n{data}\n\n"


async def _html_stream(request: Request, who: Any, job_id: str, after: int) -> Any:
    # No is_disconnected() polling: StreamingResponse ends this generator when the client goes.
    watch = job_watch(request.app.state)
    template = templates.get_template("_job_live.html")
    shown = after
    still_open = False  # the newest render showed steps still being stopped after the job ended
    yield "retry: 2000\n\n"
    while True:
        try:
            seen = await watch.wait(job_id, shown, SSE_KEEPALIVE)
        except TimeoutError:
            yield ": keep-alive\n\n"
            continue
        if seen is None:
            return  # the job was deleted
        if seen.version > shown:
            ctx = await run_in_threadpool(job_context, request, who, job_id)
            html = template.render({**base_context(request, who), **ctx})
            shown = seen.version
            yield _event("update", shown, html)
            still_open = not ctx["final"]
            if ctx["final"]:
                yield _event("finished", shown, "")
                return
            continue
        # A client resuming after the last update of a finished job: only `finished` is left.
        if seen.status in ("succeeded", "failed", "cancelled") and not still_open:
            yield _event("finished", shown, "")
            return


@router.get("/jobs/{job_id}/stream")
async def job_stream(request: Request, job_id: str) -> Response:
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        await run_in_threadpool(request.app.state.jobs.job_status, job_id, who.tenant_filter)
    except KilnError as exc:
        return error_page(request, who, exc)
    last = request.headers.get("last-event-id", "")
    return StreamingResponse(
        _html_stream(request, who, job_id, int(last) if last.isdigit() else 0),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
