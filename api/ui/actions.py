"""The dashboard's form posts: sign in and out, cancel a job, resubmit it.

Each post is CSRF-checked when auth is on (api.ui.session.check_csrf) and answers with a
redirect, so the browser's back button and reload do the expected thing.
"""

from __future__ import annotations

import json
from math import ceil
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response

from api.auth import Principal, forget_session
from api.sessions import SESSION_COOKIE, request_session, set_session_cookie
from api.submission import resubmit
from api.ui.pages import load_job
from api.ui.session import check_csrf, dashboard_form, error_page, render, viewer
from services.errors import InvalidSpec, KilnError
from services.jobs.quotas import TenantQuota

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _safe_next(target: str | None) -> str:
    # Only a path of this dashboard: an open redirect would make the login page a phishing aid.
    if target and target.startswith("/ui/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui/"


#: Who is looking at the login page: nobody yet, so the page offers no actions.
NOBODY = Principal(name=None, scopes=frozenset())


@router.get("/login")
async def login_page(request: Request) -> Response:
    return render(request, "login.html", NOBODY, next=_safe_next(request.query_params.get("next")), failed=False)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await dashboard_form(request)
    token = str(form.get("token", "")).strip()
    target = _safe_next(str(form.get("next", "")))
    state = request.app.state
    if not state.settings.auth_enabled:
        return RedirectResponse(target, status_code=303)
    client = request.client.host if request.client else "unknown"
    wait = state.login_throttle.retry_after(client)
    if wait > 0:  # too many wrong tokens from this address lately: not even looked up (api/login_throttle.py)
        page = render(request, "login.html", NOBODY, status_code=429, next=target, failed=False, wait=ceil(wait))
        page.headers["Retry-After"] = str(ceil(wait))
        return page
    rec = await run_in_threadpool(state.tokens.verify_token, token) if token else None
    if rec is None:
        state.login_throttle.failed(client)
        return render(request, "login.html", NOBODY, status_code=401, next=target, failed=True)
    state.login_throttle.succeeded(client)
    # The browser gets a signed session id; the token itself stays on this side.
    lifetime = state.settings.session_lifetime
    session_id = await run_in_threadpool(state.sessions.open_session, rec.id, lifetime)
    response = RedirectResponse(target, status_code=303)
    set_session_cookie(response, request, state.session_keys.sign(session_id), lifetime)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    form = await dashboard_form(request)
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        check_csrf(request, form)
        session_id = request_session(request)
    except KilnError as exc:
        return error_page(request, who, exc)
    if session_id is not None:
        await run_in_threadpool(request.app.state.sessions.close_session, session_id)
        forget_session(request.app.state, session_id)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: str) -> Response:
    form = await dashboard_form(request)
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    try:
        check_csrf(request, form)
        await run_in_threadpool(request.app.state.jobs.cancel_job, job_id, who.tenant_filter)
    except KilnError as exc:
        return error_page(request, who, exc)
    return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)


@router.get("/jobs/{job_id}/resubmit")
async def resubmit_page(request: Request, job_id: str) -> Response:
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    try:
        job = await run_in_threadpool(load_job, request, who, job_id)
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(
        request, "resubmit.html", who, nav="jobs", job=job, spec_text=json.dumps(job.spec, indent=2), error=None
    )


@router.post("/jobs/{job_id}/resubmit")
async def resubmit_post(request: Request, job_id: str) -> Response:
    form = await dashboard_form(request)
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    spec_text = str(form.get("spec", ""))
    state = request.app.state
    try:
        check_csrf(request, form)
        spec: Any = None
        if spec_text.strip():
            try:
                spec = json.loads(spec_text)
            except json.JSONDecodeError as exc:
                raise InvalidSpec(f"the spec is not JSON: {exc}", hint="Fix the JSON and resubmit.") from exc
        new_id = await run_in_threadpool(
            resubmit,
            state.jobs,
            state.store,
            state.registry,
            state.celery,
            job_id,
            spec,
            principal=who,
            use_cache=True,
            repository=state.repository,
            quota=TenantQuota.of(state.settings, who.max_running_jobs, who.max_queued_jobs),
        )
    except KilnError as exc:
        try:
            job = await run_in_threadpool(load_job, request, who, job_id)
        except KilnError:
            return error_page(request, who, exc)
        return render(
            request, "resubmit.html", who, status_code=422, nav="jobs", job=job, spec_text=spec_text, error=exc
        )
    return RedirectResponse(f"/ui/jobs/{new_id}", status_code=303)
