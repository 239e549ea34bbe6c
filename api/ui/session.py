"""Who looks at a dashboard page, and the context every template gets.

With auth on, a page needs the session cookie (set by the login page) or a bearer token;
without one the browser is sent to the login page. Form posts carry the session's CSRF
token (api.auth.csrf_token).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from api.auth import ANONYMOUS, CSRF_HEADER, SESSION_COOKIE, Principal, authenticate, csrf_token
from api.ui import charts
from api.ui.views import STATUS_ICONS, STEP_COLUMNS
from services.errors import HTTP_STATUS, Forbidden, KilnError, Unauthorized

__all__ = ["base_context", "check_csrf", "error_page", "render", "templates", "viewer"]

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
    token = _bearer(request) or request.cookies.get(SESSION_COOKIE)
    try:
        return await authenticate(state, token, scope)
    except Unauthorized:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)


def check_csrf(request: Request, form: dict[str, Any]) -> None:
    """Refuse a dashboard form post without the session's CSRF token (auth on only)."""
    if not request.app.state.settings.auth_enabled:
        return
    session = request.cookies.get(SESSION_COOKIE)
    if _bearer(request):
        return  # not a browser session: nothing a cross-site page could forge
    sent = request.headers.get(CSRF_HEADER) or str(form.get("csrf_token", ""))
    if not session or not hmac.compare_digest(sent.encode(), csrf_token(session).encode()):
        raise Forbidden("the form's CSRF token is missing or wrong", hint="Reload the page and try again.")


def base_context(request: Request, who: Principal) -> dict[str, Any]:
    """Return what every template needs: who is looking, whether they may write, the CSRF token."""
    session = request.cookies.get(SESSION_COOKIE)
    auth = request.app.state.settings.auth_enabled
    return {
        "request": request,
        "who": who,
        "can_write": who.allows("write"),
        "auth_enabled": auth,
        "csrf": csrf_token(session) if auth and session else "",
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
    """Render ``template`` for the viewer with the context ``build(request, *args)`` returns.

    ``build`` reads the job store, so it runs off the event loop; a KilnError it raises
    (an unknown job, say) becomes the error page, and nobody signed in gets the login page.
    """
    who = await viewer(request)
    if isinstance(who, Response):
        return who
    try:
        ctx = await run_in_threadpool(build, request, *args)
    except KilnError as exc:
        return error_page(request, who, exc)
    return render(request, template, who, **extra, **ctx)
