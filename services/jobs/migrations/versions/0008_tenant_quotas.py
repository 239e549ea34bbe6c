"""Tenant quotas: a token's own limits on running and queued jobs, and the running limit a job was submitted under.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("max_running_jobs", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_queued_jobs", sa.Integer(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("max_running", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("max_running")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("max_queued_jobs")
        batch.drop_column("max_running_jobs")
