"""otlp_traces.continues and .joined: a bare client's model calls, each a trace of its
own, joined into the trajectory of their conversation

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("otlp_traces") as batch:
        batch.add_column(sa.Column("continues", sa.String(64), nullable=True))
        batch.add_column(sa.Column("joined", sa.String(32), nullable=True))
    op.create_index("ix_otlp_traces_continues", "otlp_traces", ["continues"])
    op.create_index("ix_otlp_traces_joined", "otlp_traces", ["joined"])


def downgrade() -> None:
    op.drop_index("ix_otlp_traces_joined", "otlp_traces")
    op.drop_index("ix_otlp_traces_continues", "otlp_traces")
    with op.batch_alter_table("otlp_traces") as batch:
        batch.drop_column("joined")
        batch.drop_column("continues")
