"""PostgreSQL compresses the large JSON values of traces with lz4

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04

PostgreSQL compresses (TOASTs) every value over ~2 KB, and a trace's `original` and
`trace` are 5-50 KB of JSON each. pglz, its default, took ~30 µs of the server's ~120
µs per stored 5 KB trace; lz4 compresses and reads back several times faster, for ~15%
more space (bench/ingest.py --db postgresql, docs/ingest.md). Values stored before keep
their compression; PostgreSQL reads both. A server built without lz4 keeps pglz.
SQLite compresses nothing: nothing to do there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_COLUMNS = ("original", "trace", "compressed")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql" and _has_lz4():
        _compress_with("lz4")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _compress_with("default")


def _has_lz4() -> bool:
    methods = op.get_bind().scalar(sa.text(
        "SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'"))
    return "lz4" in (methods or [])


def _compress_with(method: str) -> None:
    for column in _COLUMNS:
        op.execute(f"ALTER TABLE traces ALTER COLUMN {column} SET COMPRESSION {method}")
