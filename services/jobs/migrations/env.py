"""Alembic environment of the job store: runs migrations on the URL set by services.jobs.migrate."""

from __future__ import annotations

from alembic import context

from services.jobs.db import get_engine
from services.jobs.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = get_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as connection:
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables instead.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
