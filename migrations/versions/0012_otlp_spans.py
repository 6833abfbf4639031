"""otlp_spans and otlp_traces: OTLP spans waiting to become trajectories

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "otlp_spans",
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("span_id", sa.String(16), nullable=False),
        sa.Column("start_ns", sa.BigInteger, nullable=False),
        sa.Column("resource", sa.LargeBinary, nullable=False),
        sa.Column("scope", sa.LargeBinary, nullable=False),
        sa.Column("span", sa.LargeBinary, nullable=False),
        sa.Column("redactions", JSON_, nullable=True),
        sa.PrimaryKeyConstraint("trace_id", "span_id", name="pk_otlp_spans"),
    )
    op.create_table(
        "otlp_traces",
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spans", sa.Integer, nullable=False),
        sa.Column("seen_spans", sa.Integer, nullable=False),
        sa.Column("late_spans", sa.Integer, nullable=False),
        sa.Column("root_ended", sa.Boolean, nullable=False),
        sa.Column("first_span_at", TIMESTAMP, nullable=False),
        sa.Column("last_span_at", TIMESTAMP, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("trace_id", name="pk_otlp_traces"),
    )
    op.create_index("ix_otlp_traces_state", "otlp_traces", ["state"])


def downgrade() -> None:
    op.drop_index("ix_otlp_traces_state", table_name="otlp_traces")
    op.drop_table("otlp_traces")
    op.drop_table("otlp_spans")
