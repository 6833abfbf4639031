"""atropos: when each env was last heard from; group JSON stored deflated

atropos_envs gains last_seen_at (registered_at for the envs already there).
atropos_payloads (JSON text) becomes atropos_segments (raw deflate + CRC-32, see
app/atropos/segments.py), and atropos_groups.payload_id becomes segment_id. The rows
are converted in both directions.

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from alembic import op

from migrations.types import BIG_ID, TIMESTAMP

revision = "0008"
down_revision = "0006"
branch_labels = None
depends_on = None

_CHUNK = 200  # rows converted per round trip: a few MB of JSON at most


def upgrade() -> None:
    op.add_column("atropos_envs", sa.Column("last_seen_at", TIMESTAMP, nullable=True))
    op.execute("UPDATE atropos_envs SET last_seen_at = registered_at")
    with op.batch_alter_table("atropos_envs") as batch:
        batch.alter_column("last_seen_at", existing_type=TIMESTAMP, nullable=False)

    segments = op.create_table(
        "atropos_segments",
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("deflated", sa.LargeBinary, nullable=False),
        sa.Column("crc32", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_segments"),
    )
    payloads = sa.table("atropos_payloads", sa.column("id"), sa.column("payload", sa.Text))
    _copy(payloads.c.id, payloads.c.payload, segments, _deflated)
    _sync_sequence("atropos_segments")
    with op.batch_alter_table("atropos_groups") as batch:
        batch.drop_constraint("fk_atropos_groups_payload_id_atropos_payloads", type_="foreignkey")
        batch.drop_index("ix_atropos_groups_payload_id")
        batch.alter_column("payload_id", new_column_name="segment_id", existing_type=BIG_ID)
    with op.batch_alter_table("atropos_groups") as batch:  # the column by its new name
        batch.create_foreign_key(
            "fk_atropos_groups_segment_id_atropos_segments",
            "atropos_segments",
            ["segment_id"],
            ["id"],
        )
    op.create_index("ix_atropos_groups_segment_id", "atropos_groups", ["segment_id"])
    op.drop_table("atropos_payloads")


def downgrade() -> None:
    payloads = op.create_table(
        "atropos_payloads",
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_atropos_payloads"),
    )
    segments = sa.table("atropos_segments", sa.column("id"), sa.column("deflated"))
    _copy(segments.c.id, segments.c.deflated, payloads, _inflated)
    _sync_sequence("atropos_payloads")
    with op.batch_alter_table("atropos_groups") as batch:
        batch.drop_constraint("fk_atropos_groups_segment_id_atropos_segments", type_="foreignkey")
        batch.drop_index("ix_atropos_groups_segment_id")
        batch.alter_column("segment_id", new_column_name="payload_id", existing_type=BIG_ID)
    with op.batch_alter_table("atropos_groups") as batch:  # the column by its new name
        batch.create_foreign_key(
            "fk_atropos_groups_payload_id_atropos_payloads",
            "atropos_payloads",
            ["payload_id"],
            ["id"],
        )
    op.create_index("ix_atropos_groups_payload_id", "atropos_groups", ["payload_id"])
    op.drop_table("atropos_segments")
    with op.batch_alter_table("atropos_envs") as batch:
        batch.drop_column("last_seen_at")


def _deflated(text: str) -> dict[str, Any]:
    # zlib here rather than the app's ISA-L: a migration keeps working as the app
    # changes, and both write the same format.
    raw = text.encode()
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    return {
        "deflated": compressor.compress(raw) + compressor.flush(zlib.Z_FULL_FLUSH),
        "crc32": zlib.crc32(raw),
    }


def _inflated(deflated: bytes) -> dict[str, Any]:
    return {"payload": zlib.decompressobj(-15).decompress(deflated).decode()}


def _copy(
    key: sa.ColumnElement[Any],
    value: sa.ColumnElement[Any],
    target: sa.Table,
    convert: Callable[[Any], dict[str, Any]],
) -> None:
    conn = op.get_bind()
    for rows in _chunks(conn, key, value):
        conn.execute(sa.insert(target), [{"id": id_, **convert(v)} for id_, v in rows])


def _chunks(
    conn: sa.Connection, key: sa.ColumnElement[Any], value: sa.ColumnElement[Any]
) -> Iterator[list[tuple[Any, Any]]]:
    last = -1
    while True:
        query = sa.select(key, value).where(key > last).order_by(key).limit(_CHUNK)
        rows = [tuple(row) for row in conn.execute(query)]
        if not rows:
            return
        yield rows
        last = rows[-1][0]


def _sync_sequence(table: str) -> None:
    """Ids were copied: PostgreSQL's sequence must continue after them."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
            f"COALESCE((SELECT MAX(id) FROM {table}), 0) + 1, false)"
        )
