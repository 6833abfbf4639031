"""the search text of a new trace is written by the hub, with the trace; no trigger on
traces, no FTS5 index

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03

Inside every insert of a trace, on SQLite, the trigger of 0010 extracted the task and
the last final answer from the trace's JSON (~45 µs of a ~100 µs insert of a 5 KB
trace) and the FTS5 trigram index took the text (~27 µs), all under SQLite's one write
lock; PostgreSQL's server did the same extraction. The hub has the parsed trace
already: it makes the text in the ingest process (app/db/search.py) and inserts it in
the trace's transaction. A search reads the narrow table on both databases, as it
always did on PostgreSQL (~60 ms for 100,000 traces). A trace inserted by other means
than the hub (a hand-written INSERT) gets no search text from now on.
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_0010 = importlib.import_module("migrations.versions.0010_reviews")


def upgrade() -> None:
    _0010.drop_fill_trigger()
    if op.get_bind().dialect.name == "sqlite":
        _0010.drop_fts_index()


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _0010.create_fts_index()
        op.execute("INSERT INTO trace_search_index (trace_search_index) VALUES ('rebuild')")
    _0010.create_fill_trigger()
