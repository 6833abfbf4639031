"""atropos: a count of the groups deleted, so that the groups ever received are known

atropos_state gains groups_dropped: groups deleted after being served, or by
/reset_data. The groups still stored plus these are every group received (/v1/stats).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "atropos_state",
        sa.Column("groups_dropped", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("atropos_state") as batch:
        batch.drop_column("groups_dropped")
