"""Kiln's HTTP API (FastAPI): submit models, follow jobs, download artifacts, inspect the service.

Build it with :func:`api.app.create_app`; it never imports an engine SDK.
"""

__all__ = ["create_app"]


def create_app(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Return the FastAPI app (see :func:`api.app.create_app`)."""
    from api.app import create_app as _create

    return _create(*args, **kwargs)
