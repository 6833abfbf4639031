"""Alembic environment. Migrations run through `atropos db upgrade` (app/db/migrate.py),
which hands over an open connection; there is no alembic.ini to keep in sync."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise SystemExit("Run migrations with `atropos db upgrade --config config.json`.")

context.configure(
    connection=connection,
    target_metadata=None,
    # SQLite alters tables by copy-and-move; batch mode does that for us.
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
