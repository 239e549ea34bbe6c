"""Which tenant owns a model name: the first to publish under it, for good.

A job's published names (one per target: the spec's ``name``, or ``<name>-<target>``) are
claimed in the transaction that records the job. A name owned by another tenant refuses the
job with FORBIDDEN before anything runs, so a tenant can never publish a version under a
name another tenant's pipelines and servers read. Admins may publish under any name; the
name stays its owner's.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from services.errors import Forbidden
from services.graph.planner import Plan
from services.jobs.database import JobDatabase, job_database
from services.jobs.models import ModelName, utcnow

__all__ = ["ModelNames", "claim_names", "published_names"]


def published_names(plan: Plan) -> list[str]:
    """Return the names ``plan`` publishes under (its publish steps', fallback routes' included)."""
    return sorted({str(s.options["name"]) for s in plan.steps if s.kind == "publish" and s.options.get("name")})


def claim_names(s: Session, tenant: str, names: Collection[str], *, any_owner: bool = False) -> None:
    """Make ``tenant`` the owner of each unowned name in ``names``; FORBIDDEN when another tenant owns one.

    ``INSERT ... ON CONFLICT DO NOTHING`` then a read: of two transactions claiming one new
    name, the second waits for the first (PostgreSQL) or for the write lock (SQLite) and then
    reads the first one's owner, so exactly one tenant gets it.
    """
    if not names:
        return
    insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
    now = utcnow()
    s.execute(
        insert(ModelName)
        .values([{"name": n, "tenant": tenant, "created_at": now} for n in sorted(names)])
        .on_conflict_do_nothing(index_elements=["name"])
    )
    owners = dict(s.execute(select(ModelName.name, ModelName.tenant).where(ModelName.name.in_(list(names)))).all())
    taken = sorted(n for n in names if owners.get(n) != tenant)
    if taken and not any_owner:
        raise Forbidden(
            f"model name{'s' if len(taken) > 1 else ''} {', '.join(repr(n) for n in taken)} "
            f"belong{'' if len(taken) > 1 else 's'} to another tenant",
            hint="Publish under a name of your own tenant: set `name` in the spec.",
            names=taken,
        )


class ModelNames:
    """Model name ownership on one database."""

    def __init__(self, db: JobDatabase | str) -> None:
        self.db = job_database(db)

    def owner(self, name: str) -> str | None:
        """Return the tenant owning ``name``, or None when no job of this service published under it."""
        with self.db.read() as s:
            return s.scalar(select(ModelName.tenant).where(ModelName.name == name))

    def owned_by(self, tenant: str) -> set[str]:
        """Return every name ``tenant`` owns."""
        with self.db.read() as s:
            return set(s.scalars(select(ModelName.name).where(ModelName.tenant == tenant)).all())
