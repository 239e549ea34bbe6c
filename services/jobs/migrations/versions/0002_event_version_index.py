"""Index job events by (job_id, id): a job's newest event id is read on every GET of the job.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.create_index("ix_job_events_job_id_id", ["job_id", "id"])
        batch.drop_index("ix_job_events_job_id")


def downgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.create_index("ix_job_events_job_id", ["job_id"])
        batch.drop_index("ix_job_events_job_id_id")
