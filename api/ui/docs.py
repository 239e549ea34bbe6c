"""/docs (Swagger UI) and /redoc from the vendored files: they work offline, nothing from a CDN."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

__all__ = ["install_docs"]

VENDOR = "/ui/static/vendor"
FAVICON = "/ui/static/favicon.svg"


def install_docs(app: FastAPI) -> None:
    """Serve the interactive API pages (only when the API description is open: auth off)."""

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{VENDOR}/swagger-ui-bundle-5.35.0.js",
            swagger_css_url=f"{VENDOR}/swagger-ui-5.35.0.css",
            swagger_favicon_url=FAVICON,
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - API",
            redoc_js_url=f"{VENDOR}/redoc-2.5.4.standalone.js",
            redoc_favicon_url=FAVICON,
            with_google_fonts=False,
        )
