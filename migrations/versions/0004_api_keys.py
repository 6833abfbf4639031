"""api keys; scheduled tasks (retention)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("scopes", JSON_, nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_api_keys"),
    )
    op.create_table(
        "scheduled_tasks",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("last_started_at", TIMESTAMP, nullable=False),
        sa.Column("last_finished_at", TIMESTAMP, nullable=True),
        sa.Column("last_result", JSON_, nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_scheduled_tasks"),
    )


def downgrade() -> None:
    op.drop_table("scheduled_tasks")
    op.drop_table("api_keys")
