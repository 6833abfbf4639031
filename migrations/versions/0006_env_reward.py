"""traces.env_reward: the scalar reward the environment sent with the trace

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

Nullable, and NULL for the rows already stored: `atropos rescore` fills it for traces
whose original (or metadata) carries the value, and scores them again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch_alter_table: SQLite adds the column in place; PostgreSQL runs plain ALTERs.
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("env_reward", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("env_reward")
