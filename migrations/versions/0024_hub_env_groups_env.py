"""atropos_rollouts.env_id and .env: the env a formed group was queued under, so that
the export serves it as GET /batch did and the dashboard lists it by env

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("atropos_rollouts") as batch:
        batch.add_column(sa.Column("env_id", sa.Integer, nullable=True))
        batch.add_column(sa.Column("env", sa.String(200), nullable=True))
    op.create_index("ix_atropos_rollouts_env_grouped_at", "atropos_rollouts",
                    ["env", "grouped_at"])


def downgrade() -> None:
    op.drop_index("ix_atropos_rollouts_env_grouped_at", "atropos_rollouts")
    with op.batch_alter_table("atropos_rollouts") as batch:
        batch.drop_column("env")
        batch.drop_column("env_id")
