"""runs and run_processes tables (training runs)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_, TIMESTAMP

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("spec", JSON_, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("supervisor", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("run_id", name="pk_runs"),
    )
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
    op.create_table(
        "run_processes",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("command", JSON_, nullable=False),
        sa.Column("log_path", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("start_ticks", sa.BigInteger, nullable=True),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("healthy_at", TIMESTAMP, nullable=True),
        sa.Column("exited_at", TIMESTAMP, nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.PrimaryKeyConstraint("run_id", "position", name="pk_run_processes"),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.run_id"],
            name="fk_run_processes_run_id_runs",
            ondelete="CASCADE",
        ),
    )


def downgrade() -> None:
    op.drop_table("run_processes")
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.drop_index("ix_runs_status", table_name="runs")
    op.drop_table("runs")
