"""Tenants, model name ownership and dashboard sessions.

- ``jobs.tenant`` and ``api_tokens.tenant``: every job and token recorded before tenants
  existed belongs to the ``default`` tenant;
- ``model_names``: which tenant owns a published name, filled from the names the existing
  jobs' plans publish under (all ``default``'s);
- ``dashboard_sessions``: the dashboard's cookie holds a signed session id instead of the
  API token itself.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

DEFAULT_TENANT = "default"  # services.jobs.models.DEFAULT_TENANT, frozen as of this revision


def _published_names(plan: object) -> set[str]:
    if isinstance(plan, str):  # SQLite hands JSON back as text here
        plan = json.loads(plan)
    steps = plan.get("steps", []) if isinstance(plan, dict) else []
    return {
        str(s["options"]["name"])
        for s in steps
        if isinstance(s, dict) and s.get("kind") == "publish" and (s.get("options") or {}).get("name")
    }


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default=DEFAULT_TENANT))
        batch.create_index("ix_jobs_tenant", ["tenant"])
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("tenant", server_default=None)
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default=DEFAULT_TENANT))
    with op.batch_alter_table("api_tokens") as batch:
        batch.alter_column("tenant", server_default=None)
    names = op.create_table(
        "model_names",
        sa.Column("name", sa.String(length=160), primary_key=True),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_model_names_tenant", "model_names", ["tenant"])
    op.create_table(
        "dashboard_sessions",
        sa.Column("id_sha256", sa.String(length=64), primary_key=True),
        sa.Column("token_id", sa.String(length=16), sa.ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_dashboard_sessions_token_id", "dashboard_sessions", ["token_id"])
    op.create_index("ix_dashboard_sessions_expires_at", "dashboard_sessions", ["expires_at"])
    # The names existing jobs publish under are the default tenant's: nobody else may take them.
    bind = op.get_bind()
    owned: set[str] = set()
    for (plan,) in bind.execute(sa.text("SELECT plan FROM jobs")):
        owned |= _published_names(plan)
    now = datetime.now(UTC)
    if bind.dialect.name == "sqlite":
        now = now.replace(tzinfo=None)  # services.jobs.models.UTCDateTime stores naive UTC there
    if owned:
        op.bulk_insert(names, [{"name": n, "tenant": DEFAULT_TENANT, "created_at": now} for n in sorted(owned)])


def downgrade() -> None:
    op.drop_index("ix_dashboard_sessions_expires_at", table_name="dashboard_sessions")
    op.drop_index("ix_dashboard_sessions_token_id", table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    op.drop_index("ix_model_names_tenant", table_name="model_names")
    op.drop_table("model_names")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("tenant")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_tenant")
        batch.drop_column("tenant")
