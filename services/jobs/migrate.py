"""Apply the job store's Alembic migrations (what `kiln migrate` runs)."""

from __future__ import annotations

from pathlib import Path

from services.jobs.db import normalize_url

__all__ = ["alembic_config", "upgrade"]

_INI = Path(__file__).with_name("alembic.ini")


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    """Return the Alembic Config of the job store bound to ``url``."""
    from alembic.config import Config

    cfg = Config(str(_INI))
    # ConfigParser treats % as interpolation; URLs may carry %-escaped passwords.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` up to ``revision`` (idempotent)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
