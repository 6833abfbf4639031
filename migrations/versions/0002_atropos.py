"""atropos tables: the run, registered envs, queued groups and their payloads, batches

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import BIG_ID, JSON_, TIMESTAMP

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    state = op.create_table(
        "atropos_state",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("registered", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("started", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("trainer_uuid", sa.String(40), nullable=True),
        sa.Column("wandb_group", sa.Text, nullable=True),
        sa.Column("wandb_project", sa.Text, nullable=True),
        sa.Column("batch_size", sa.Integer, nullable=False, server_default="-1"),
        sa.Column("max_token_len", sa.Integer, nullable=False, server_default="-1"),
        sa.Column("checkpoint_dir", sa.Text, nullable=True),
        sa.Column("save_checkpoint_interval", sa.Integer, nullable=True),
        sa.Column("starting_step", sa.Integer, nullable=True),
        sa.Column("num_steps", sa.Integer, nullable=False, server_default="-1"),
        sa.Column("step", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("updated_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_state"),
    )
    # The one row every request reads and locks; it exists from the start.
    op.bulk_insert(state, [{"id": 1}])

    op.create_table(
        "atropos_envs",
        sa.Column("env_id", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("desired_name", sa.Text, nullable=False),
        sa.Column("real_name", sa.Text, nullable=False),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("max_token_length", sa.Integer, nullable=False),
        sa.Column("group_size", sa.Integer, nullable=False),
        sa.Column("min_batch_allocation", sa.Float, nullable=True),
        sa.Column("connected", sa.Boolean, nullable=False),
        sa.Column("registered_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("env_id", name="pk_atropos_envs"),
    )

    op.create_table(
        "atropos_payloads",
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_payloads"),
    )

    op.create_table(
        "atropos_groups",
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("env_id", sa.Integer, nullable=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.Column("fill_logprobs", sa.Boolean, nullable=False),
        sa.Column("payload_id", BIG_ID, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_groups"),
        sa.ForeignKeyConstraint(
            ["payload_id"],
            ["atropos_payloads.id"],
            name="fk_atropos_groups_payload_id_atropos_payloads",
        ),
    )
    op.create_index(
        "ix_atropos_groups_state_id",
        "atropos_groups",
        ["state", "id", "env_id", "size", "bytes"],
    )
    op.create_index("ix_atropos_groups_state_env_id", "atropos_groups", ["state", "env_id"])
    op.create_index("ix_atropos_groups_payload_id", "atropos_groups", ["payload_id"])

    op.create_table(
        "atropos_batches",
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("group_ids", JSON_, nullable=False),
        sa.Column("sequences", sa.Integer, nullable=False),
        sa.Column("lease_id", sa.String(32), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("deliveries", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_batches"),
        sa.UniqueConstraint("lease_id", name="uq_atropos_batches_lease_id"),
    )
    op.create_index("ix_atropos_batches_state_seq", "atropos_batches", ["state", "seq"])


def downgrade() -> None:
    op.drop_table("atropos_batches")
    op.drop_table("atropos_groups")
    op.drop_table("atropos_payloads")
    op.drop_table("atropos_envs")
    op.drop_table("atropos_state")
