"""Column types that serve both SQLite and PostgreSQL with one set of models."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

# JSONB on PostgreSQL (indexable, compact); JSON text on SQLite. Python None is SQL
# NULL (not the JSON text 'null'), so `IS NULL` means "not set" in both.
JSON_ = sa.JSON(none_as_null=True).with_variant(
    postgresql.JSONB(none_as_null=True), "postgresql"
)


@dataclass(frozen=True, slots=True)
class EncodedJSON:
    """JSON text encoded already (by an ingest process, off the event loop): a JSON_
    column stores it as it is instead of encoding it again."""

    text: str


def json_text(value: Any) -> str:
    """The engines' JSON serializer."""
    return value.text if isinstance(value, EncodedJSON) else orjson.dumps(value).decode()


class UtcTimeStamp(sa.TypeDecorator[datetime]):
    """An aware UTC datetime in Python.

    SQLite keeps it as naive UTC text 'YYYY-MM-DD HH:MM:SS.ffffff', so the seed's
    `created_at < datetime('now', '-30 days')` compares correctly as text; PostgreSQL
    keeps a timestamptz.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if not isinstance(value, datetime):
            return None
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        utc: datetime = aware.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if not isinstance(value, datetime):
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utc_text(value: datetime) -> str:
    """`value` as UtcTimeStamp keeps it on SQLite (naive UTC, always with microseconds:
    SQLAlchemy's format), for inserts that pass values as they are (dialect.BulkInsert);
    PostgreSQL reads it back as UTC."""
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    # isoformat, not strftime: under half the time, and years before 1000 padded to
    # four digits as SQLAlchemy writes them.
    return aware.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def utcnow() -> datetime:
    return datetime.now(UTC)
