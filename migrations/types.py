"""Column types frozen for migrations: a migration must create the same schema
forever, even when app/db/types.py changes later."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

JSON_ = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)
# An autoincrementing key: INTEGER PRIMARY KEY (the rowid) on SQLite, BIGSERIAL on
# PostgreSQL.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
