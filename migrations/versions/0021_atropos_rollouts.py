"""atropos_rollouts: trajectories formed into the hub's own Atropos groups; the hub's
env marked in atropos_envs; atropos_env_groups: groups envs sent, waiting to become
trajectories; traces.group_id

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "atropos_rollouts",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("group_key", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("detail", sa.Text, nullable=True),
        sa.Column("score", sa.Float, nullable=True),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("policy_step", sa.BigInteger, nullable=True),
        sa.Column("rollout", JSON_, nullable=False),
        sa.Column("group_id", sa.String(64), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("grouped_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("trace_id", name="pk_atropos_rollouts"),
    )
    op.create_index("ix_atropos_rollouts_state_group_key", "atropos_rollouts",
                    ["state", "group_key"])
    op.create_index("ix_atropos_rollouts_group_id", "atropos_rollouts", ["group_id"])
    with op.batch_alter_table("atropos_envs") as batch:
        batch.add_column(sa.Column("hub_owned", sa.Boolean, nullable=False,
                                   server_default=sa.false()))
    op.create_table(
        "atropos_env_groups",
        sa.Column("segment_id", sa.BigInteger, nullable=False),
        sa.Column("env_id", sa.Integer, nullable=True),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("received_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("segment_id", name="pk_atropos_env_groups"),
    )
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("group_id", sa.String(200), nullable=True))
    op.create_index("ix_traces_group_id_created_at", "traces", ["group_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_traces_group_id_created_at", table_name="traces")
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("group_id")
    op.drop_table("atropos_env_groups")
    with op.batch_alter_table("atropos_envs") as batch:
        batch.drop_column("hub_owned")
    op.drop_index("ix_atropos_rollouts_group_id", table_name="atropos_rollouts")
    op.drop_index("ix_atropos_rollouts_state_group_key", table_name="atropos_rollouts")
    op.drop_table("atropos_rollouts")
