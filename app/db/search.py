"""The search text of a trace (`trace_search`, which the trace list's search reads):
its task and its last final answer, each cut to SEARCH_CHARS, lowercased; and the same
two as written, which the list shows shortened (`preview`) and a search shows around
its match (`snippet`).

It is made where the trace is parsed (Preparer.row, in an ingest process) and written
by the code that stores the trace, in the same transaction (insert_traces in
app/ingest/inserter.py, and the OTLP assembly when it replaces a trajectory). Until
migration 0013 a trigger on `traces` made it in the database; extracting it from the
trace's JSON there lengthened each insert under SQLite's one write lock, and SQLite's
FTS5 trigram index over it more (docs/ingest.md). A search
reads the narrow table (`matching`), on both databases.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa

from app.db.dialect import BulkInsert
from app.db.models import TRACE_SEARCH
from app.domain import StepType, Trace

SEARCH_CHARS = 2000
# How much of the task and of the final answer a listing shows, and how much text a
# search shows on each side of its match.
PREVIEW_CHARS = 120
SNIPPET_CHARS = 60
# A trace assembled again replaces its text, in the same statement: a DELETE of the
# trace_ids first cost PostgreSQL a round of work a trace (bench/ingest.py --db postgresql).
_ROWS = BulkInsert(TRACE_SEARCH, "trace_id", ("trace_id", "text", "task", "final_answer"),
                   replace=True)


class SearchText(NamedTuple):
    """A trace's row of trace_search, made where the trace is parsed."""

    text: str  # what a search matches: task and final answer, lowercased
    task: str
    final_answer: str | None  # None: the trace has no final step


def search_text(trace: Trace) -> SearchText:
    """The text `trace` is found by. Python's lower() folds all of Unicode, as the words
    searched for are folded (app/db/trace_queries.py TraceFilter.words)."""
    final = next((s.content for s in reversed(trace.steps) if s.type is StepType.FINAL), None)
    task = trace.task[:SEARCH_CHARS]
    answer = None if final is None else final[:SEARCH_CHARS]
    return SearchText(f"{task}\n{answer or ''}".lower(), task, answer)


def index(conn: sa.Connection, texts: Sequence[tuple[str, SearchText]]) -> None:
    """Store these (trace_id, search text), replacing any the trace_ids had: a trace
    assembled again, or a row left behind by a trace deleted with foreign keys off
    (the sqlite3 shell's default)."""
    _ROWS.run(conn, [(trace_id, *text) for trace_id, text in texts])


_SPACE = re.compile(r"\s+")


def preview(text: str | None, chars: int = PREVIEW_CHARS) -> str | None:
    """`text` on one line (every run of white space one space), cut to `chars` with an
    ellipsis where it was cut."""
    if text is None:
        return None
    line = _SPACE.sub(" ", text[:chars * 4]).strip()
    return line if len(line) <= chars and len(text) <= chars * 4 else line[:chars - 1] + "…"


def snippet(words: str, *texts: str | None) -> str | None:
    """The first of `texts` that contains `words` (lowercased), on one line, cut to the
    words and SNIPPET_CHARS on each side, with an ellipsis where it was cut; None when
    none contains them."""
    wanted = _SPACE.sub(" ", words).strip()
    for text in texts:
        line = _SPACE.sub(" ", text or "").strip()
        folded = line.lower()
        at = folded.find(wanted) if len(folded) == len(line) else -1
        if at < 0:
            continue
        start, end = max(0, at - SNIPPET_CHARS), min(len(line), at + len(wanted) + SNIPPET_CHARS)
        return f"{'…' if start else ''}{line[start:end]}{'…' if end < len(line) else ''}"
    return None


def has_words(words: str) -> sa.ColumnElement[bool]:
    """trace_search rows whose text contains `words` (lowercased, as the text is)."""
    return TRACE_SEARCH.c.text.contains(words, autoescape=True)


def matching(words: str) -> sa.Select[Any]:
    """The trace_ids whose search text contains `words`: a read of the narrow table.
    The trace list first looks among the next
    traces in its own order (app/db/trace_queries.py), where common words are found."""
    return sa.select(TRACE_SEARCH.c.trace_id).where(has_words(words))
