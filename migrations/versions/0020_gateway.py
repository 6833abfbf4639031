"""gateway_calls and gateway_rollouts: model calls captured by the gateway, waiting to
become trajectories

Revision ID: 0020
Revises: 0017
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0020"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_calls",
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("call_id", sa.String(32), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("continues", sa.String(64), nullable=True),
        sa.Column("call", JSON_, nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", "call_id", name="pk_gateway_calls"),
    )
    op.create_index("ix_gateway_calls_continues", "gateway_calls", ["continues"])
    op.create_table(
        "gateway_rollouts",
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("calls", sa.Integer, nullable=False),
        sa.Column("changes", sa.Integer, nullable=False),
        sa.Column("seen_changes", sa.Integer, nullable=False),
        sa.Column("late_changes", sa.Integer, nullable=False),
        sa.Column("finished", sa.Boolean, nullable=False),
        sa.Column("finish", JSON_, nullable=True),
        sa.Column("first_call_at", TIMESTAMP, nullable=False),
        sa.Column("last_change_at", TIMESTAMP, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("rollout_id", name="pk_gateway_rollouts"),
    )
    op.create_index("ix_gateway_rollouts_state", "gateway_rollouts", ["state"])


def downgrade() -> None:
    op.drop_index("ix_gateway_rollouts_state", table_name="gateway_rollouts")
    op.drop_table("gateway_rollouts")
    op.drop_index("ix_gateway_calls_continues", table_name="gateway_calls")
    op.drop_table("gateway_calls")
