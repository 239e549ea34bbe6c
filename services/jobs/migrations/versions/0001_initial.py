"""Initial job store: jobs, job_steps, job_events, api_tokens, workers.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Column types are spelled out here (not imported from services.jobs.models) so this
revision keeps creating the same schema whatever the models become later.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("name", sa.String(128), nullable=False, index=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("source_key", sa.String(255), nullable=False),
        sa.Column("source_sha256", sa.String(64), nullable=False, index=True),
        sa.Column("source_filename", sa.String(255), nullable=False),
        sa.Column("source_format", sa.String(32), nullable=False),
        sa.Column("source_seen", sa.Text(), nullable=False),
        sa.Column("source_size", sa.BigInteger(), nullable=False),
        sa.Column("calibration_key", sa.String(255), nullable=True),
        sa.Column("calibration_sha256", sa.String(64), nullable=True),
        sa.Column("calibration_filename", sa.String(255), nullable=True),
        sa.Column("use_cache", sa.Boolean(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("cached", sa.Boolean(), nullable=True),
        sa.Column("created_at", TS, nullable=False, index=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
    )
    op.create_table(
        "job_steps",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step_id", sa.String(255), primary_key=True),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("engine", sa.String(32), nullable=False),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("target", sa.String(32), nullable=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("queued_at", TS, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True, index=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("cached", sa.Boolean(), nullable=False),
        sa.Column("input_keys", sa.JSON(), nullable=True),
        sa.Column("artifact_key", sa.String(255), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("log", sa.Text(), nullable=True),
    )
    op.create_table(
        "job_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("step", sa.String(255), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
    )
    op.create_table(
        "workers",
        sa.Column("hostname", sa.String(255), primary_key=True),
        sa.Column("engines", sa.JSON(), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("stopped_at", TS, nullable=True),
    )


def downgrade() -> None:
    for table in ("workers", "api_tokens", "job_events", "job_steps", "jobs"):
        op.drop_table(table)
