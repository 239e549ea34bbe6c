"""Index jobs by (status, created_at) and (source_sha256, created_at): the dashboard's filtered lists.

A filtered, newest-first page reads the index in order and stops after one page instead of
sorting every matching row (10,000 jobs: docs/benchmarks.md).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.create_index("ix_jobs_status_created_at", ["status", "created_at"])
        batch.create_index("ix_jobs_source_sha256_created_at", ["source_sha256", "created_at"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_source_sha256_created_at")
        batch.drop_index("ix_jobs_status_created_at")
