"""The dashboard's job list filters: jobs.precision as a column, job steps by target and engine.

Filtering on the precision inside the spec JSON parses every job's spec; a column with an
index does not. "Jobs with a step for this target (on this engine)" reads the new step
indexes instead of every job's steps (10,000 jobs: docs/benchmarks.md, "Web dashboard").

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("precision", sa.String(length=8), nullable=True))
        batch.create_index("ix_jobs_precision", ["precision"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE jobs SET precision = coalesce(spec->>'precision', 'fp32')")
    else:
        op.execute("UPDATE jobs SET precision = coalesce(json_extract(spec, '$.precision'), 'fp32')")
    with op.batch_alter_table("job_steps") as batch:
        batch.create_index("ix_job_steps_target_job_id", ["target", "job_id"])
        batch.create_index("ix_job_steps_engine_job_id", ["engine", "job_id"])


def downgrade() -> None:
    with op.batch_alter_table("job_steps") as batch:
        batch.drop_index("ix_job_steps_engine_job_id")
        batch.drop_index("ix_job_steps_target_job_id")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_precision")
        batch.drop_column("precision")
