"""Who looks at a dashboard page, and the context every template gets.

With auth on, a page needs the session cookie (set by the login page) or a bearer token;
without one the browser is sent to the login page. Form posts carry the session's CSRF
token (api.sessions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from api.auth import ANONYMOUS, Principal, authenticate, authenticate_session
from api.sessions import CSRF_FIELD, request_session, require_csrf
from api.ui import charts
from api.ui.views import STATUS_ICONS, STEP_COLUMNS
from services.errors import HTTP_STATUS, KilnError, NotFound, Unauthorized

__all__ = ["base_context", "check_csrf", "dashboard_form", "error_page", "render", "templates", "viewer", "writer"]

#: The dashboard's forms (sign in, cancel, resubmit) have a few small fields: a form with
#: more, larger ones, or any file is refused (400) before it fills memory. The resubmit
#: form's spec may be as large as POST /compile's spec part (api.upload.MAX_FIELD_BYTES).
FORM_MAX_FIELDS = 8
FORM_MAX_FIELD_BYTES = 1 << 20

templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
templates.env.globals.update(STATUS_ICONS=STATUS_ICONS, STEP_COLUMNS=STEP_COLUMNS, charts=charts)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def viewer(request: Request, scope: str = "read") -> Principal | Response:
    """Return who is looking, or the redirect to the login page when nobody is signed in."""
    state = request.app.state
    if not state.settings.auth_enabled:
        return ANONYMOUS
    try:
        token = _bearer(request)
        if token is not None:
            return await authenticate(state, token, scope)
        session_id = request_session(request)
        if session_id is None:
            raise Unauthorized("nobody is signed in")
        return await authenticate_session(state, session_id, scope)
    except Unauthorized:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)


async def writer(request: Request, doing: str) -> Principal | Response:
    """Return who is looking when they may write; else the login redirect, or a page saying ``doing`` needs it."""
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    if not who.allows("write"):
        return error_page(request, who, NotFound(f"{doing} needs a token with the write scope"))
    return who


async def dashboard_form(request: Request) -> dict[str, Any]:
    """Return a dashboard form post's fields, bounded in number and size (no files)."""
    form = await request.form(max_files=0, max_fields=FORM_MAX_FIELDS, max_part_size=FORM_MAX_FIELD_BYTES)
    return dict(form)


def check_csrf(request: Request, form: dict[str, Any]) -> None:
    """Refuse a dashboard form post of a session without its CSRF token, in the header or the form (auth on only)."""
    if not request.app.state.settings.auth_enabled or _bearer(request):
        return  # no session, or not a browser's: nothing a cross-site page could forge
    session_id = request_session(request)
    if session_id is None:
        raise Unauthorized("nobody is signed in", hint="Sign in at /ui/login.")
    require_csrf(request, session_id, str(form.get(CSRF_FIELD, "")))


def _session_csrf(request: Request) -> str:
    try:
        session_id = request_session(request)
    except Unauthorized:
        return ""
    return request.app.state.session_keys.csrf_token(session_id) if session_id else ""


def base_context(request: Request, who: Principal) -> dict[str, Any]:
    """Return what every template needs: who is looking, whether they may write, the CSRF token."""
    auth = request.app.state.settings.auth_enabled
    return {
        "request": request,
        "who": who,
        "can_write": who.allows("write"),
        "auth_enabled": auth,
        "csrf": _session_csrf(request) if auth else "",
        "nav": None,
    }


def render(request: Request, template: str, who: Principal, /, status_code: int = 200, **context: Any) -> Response:
    """Render ``template`` with the base context and ``context`` (which may use any key, e.g. "name")."""
    return templates.TemplateResponse(
        request, template, {**base_context(request, who), **context}, status_code=status_code
    )


def error_page(request: Request, who: Principal, exc: KilnError) -> Response:
    """Render a KilnError as a page with its code, message and hint (never a traceback)."""
    return render(request, "error.html", who, status_code=HTTP_STATUS.get(exc.code, 500), error=exc)


async def render_page(request: Request, template: str, build: Any, *args: Any, **extra: Any) -> Response:
    """Render ``template`` for the viewer with the context ``build(request, viewer, *args)`` returns.

    ``build`` reads the job store, so it runs off the event loop; a KilnError it raises
    (an unknown job, say) becomes the error page, and nobody signed in gets the login page.
    """
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        ctx = await run_in_threadpool(build, request, who, *args)
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(request, template, who, **extra, **ctx)
