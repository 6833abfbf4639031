"""traces table

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "traces",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(32), nullable=False),
        sa.Column("total_tokens", sa.Integer, nullable=False),
        sa.Column("compressed_tokens", sa.Integer, nullable=True),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("reward_breakdown", JSON_, nullable=True),
        sa.Column("reject_reasons", JSON_, nullable=True),
        sa.Column("scored_with", sa.String(16), nullable=True),
        sa.Column("source_format", sa.String(32), nullable=False),
        sa.Column("env", sa.String(200), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("agent_name", sa.String(200), nullable=True),
        sa.Column("policy_version", sa.String(200), nullable=True),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("original", JSON_, nullable=False),
        sa.Column("trace", JSON_, nullable=False),
        sa.Column("compressed", JSON_, nullable=True),
        sa.Column("compression", JSON_, nullable=True),
        sa.Column("stage_error", sa.Text, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("trace_id", name="pk_traces"),
    )
    op.create_index("ix_traces_created_at", "traces", ["created_at"])
    op.create_index("ix_traces_status", "traces", ["status"])
    op.create_index("ix_traces_env", "traces", ["env"])
    op.create_index("ix_traces_model", "traces", ["model"])
    op.create_index("ix_traces_stage_created_at", "traces", ["stage", "created_at"])


def downgrade() -> None:
    op.drop_table("traces")
