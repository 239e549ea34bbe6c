"""The web dashboard: server-rendered pages under /ui, served by the API process itself.

Jinja2 templates, htmx (vendored under static/vendor, checked against SHA256SUMS) and
server-rendered SVG charts; no Node toolchain, nothing from a CDN.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "install_dashboard"]

STATIC_DIR = Path(__file__).parent / "static"


def install_dashboard(app: FastAPI, *, open_docs: bool) -> None:
    """Mount the dashboard's pages and static files on ``app``; `/` redirects to it."""
    from api.ui import actions, compare, pages, service_pages, stream, tune_page
    from api.ui.docs import install_docs

    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    for module in (pages, compare, service_pages, actions, stream, tune_page):
        app.include_router(module.router)
    if open_docs:
        install_docs(app)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=307)
