"""The search text of a trace (`trace_search`, which the trace list's search reads):
its task and its last final answer, each cut to SEARCH_CHARS, lowercased.

It is made where the trace is parsed (Preparer.row, in an ingest process) and written
by the code that stores the trace, in the same transaction (insert_traces in
app/ingest/inserter.py, and the OTLP assembly when it replaces a trajectory). Until
migration 0013 a trigger on `traces` made it in the database; extracting it from the
trace's JSON there lengthened each insert under SQLite's one write lock, and SQLite's
FTS5 trigram index over it more (docs/ingest.md). A search
reads the narrow table (`matching`), on both databases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from app.db.dialect import BulkInsert
from app.db.models import TRACE_SEARCH
from app.domain import StepType, Trace

SEARCH_CHARS = 2000
# A trace assembled again replaces its text, in the same statement: a DELETE of the
# trace_ids first cost PostgreSQL a round of work a trace (bench/ingest.py --db postgresql).
_ROWS = BulkInsert(TRACE_SEARCH, "trace_id", ("trace_id", "text"), replace=True)


def search_text(trace: Trace) -> str:
    """The text `trace` is found by. Python's lower() folds all of Unicode, as the words
    searched for are folded (app/db/trace_queries.py TraceFilter.words)."""
    final = next((s.content for s in reversed(trace.steps) if s.type is StepType.FINAL), None)
    return f"{trace.task[:SEARCH_CHARS]}\n{(final or '')[:SEARCH_CHARS]}".lower()


def index(conn: sa.Connection, texts: Sequence[tuple[str, str]]) -> None:
    """Store these (trace_id, search text), replacing any the trace_ids had: a trace
    assembled again, or a row left behind by a trace deleted with foreign keys off
    (the sqlite3 shell's default)."""
    _ROWS.run(conn, list(texts))


def has_words(words: str) -> sa.ColumnElement[bool]:
    """trace_search rows whose text contains `words` (lowercased, as the text is)."""
    return TRACE_SEARCH.c.text.contains(words, autoescape=True)


def matching(words: str) -> sa.Select[Any]:
    """The trace_ids whose search text contains `words`: a read of the narrow table.
    The trace list first looks among the next
    traces in its own order (app/db/trace_queries.py), where common words are found."""
    return sa.select(TRACE_SEARCH.c.trace_id).where(has_words(words))
