"""batches and their member traces

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

`batch_traces.trace_id` is the primary key: the schema itself refuses to put a trace
in two batches, whatever the workers do.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("target", sa.String(16), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("delivered_at", TIMESTAMP, nullable=True),
        sa.Column("receipt", JSON_, nullable=True),
        sa.PrimaryKeyConstraint("batch_id", name="pk_batches"),
    )
    op.create_index("ix_batches_state_created_at", "batches", ["state", "created_at"])
    op.create_index("ix_batches_created_at", "batches", ["created_at"])
    op.create_table(
        "batch_traces",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name="pk_batch_traces"),
        # Deleting traces (retention, the seed's DELETE) takes their membership along.
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.trace_id"],
            name="fk_batch_traces_trace_id_traces", ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.batch_id"],
            name="fk_batch_traces_batch_id_batches", ondelete="CASCADE",
        ),
    )
    op.create_index("ix_batch_traces_batch_id", "batch_traces", ["batch_id"])


def downgrade() -> None:
    op.drop_table("batch_traces")
    op.drop_table("batches")
