"""Evaluation uploads: a job's labelled data (spec.evaluation) stored like its calibration file.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("evaluation_key", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("evaluation_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("evaluation_filename", sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("evaluation_filename")
        batch.drop_column("evaluation_sha256")
        batch.drop_column("evaluation_key")
