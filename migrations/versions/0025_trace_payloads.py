"""trace_payloads: a trace's original, canonical and compressed payloads in a table of
their own, so that a stage move updates a narrow row of `traces`

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07

On SQLite an UPDATE rewrites the whole row, its payloads (5-50 KB each) included,
whenever the row's size changes, as a move of `stage` does; the stages moved every
trace two or three times. The payloads are written once, with the trace; `compressed`
by the compression stage. Every row is copied; down again, the columns come back at
the end of `traces`, filled from the copy (nullable on SQLite, which adds a NOT NULL
column only with a default).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import JSON_

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

_COLUMNS = ("original", "trace", "compressed")


def upgrade() -> None:
    op.create_table(
        "trace_payloads",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("original", JSON_, nullable=False),
        sa.Column("trace", JSON_, nullable=False),
        sa.Column("compressed", JSON_, nullable=True),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.trace_id"], ondelete="CASCADE",
                                name="fk_trace_payloads_trace_id_traces"),
        sa.PrimaryKeyConstraint("trace_id", name="pk_trace_payloads"),
    )
    _lz4("trace_payloads")
    op.execute("INSERT INTO trace_payloads (trace_id, original, trace, compressed) "
               "SELECT trace_id, original, trace, compressed FROM traces")
    for column in _COLUMNS:
        # Not batch mode: on SQLite it copies `traces` to a new table and drops the old
        # one, whose rows' cascades would empty every table that refers to it.
        op.execute(f"ALTER TABLE traces DROP COLUMN {column}")


def downgrade() -> None:
    for column in _COLUMNS:
        op.execute(f"ALTER TABLE traces ADD COLUMN {column} "
                   f"{'JSONB' if _postgresql() else 'JSON'}")
    op.execute(
        "UPDATE traces SET original = p.original, trace = p.trace, compressed = p.compressed "
        "FROM trace_payloads AS p WHERE p.trace_id = traces.trace_id")
    if _postgresql():
        op.execute("ALTER TABLE traces ALTER COLUMN original SET NOT NULL, "
                   "ALTER COLUMN trace SET NOT NULL")
    _lz4("traces")
    op.drop_table("trace_payloads")


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _lz4(table: str) -> None:
    """The payload columns TOASTed with lz4 where the server has it, as 0014 made them."""
    if not _postgresql():
        return
    methods = op.get_bind().scalar(sa.text(
        "SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'"))
    if "lz4" in (methods or []):
        for column in _COLUMNS:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION lz4")
