"""trace_search keeps the task and the final answer as written, for the trace list

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07

The trace list shows each trace's task and final answer, shortened, and a search the
words around its match: both read trace_search's narrow row, never the payloads.
`text` stays what a search matches (lowercased); `task` and `final_answer` are the
same two texts in their own case, each cut to SEARCH_CHARS as `text` is. This revision
fills them for the traces already stored, from their canonical trace; a trace with no
final step keeps a NULL final_answer.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

SEARCH_CHARS = 2000

# From a trace row `t` (its canonical trace in t.trace): the task, and the content of
# its last final step, as app/db/search.py makes them.
_SQLITE = {
    "task": f"substr(coalesce(json_extract(t.trace, '$.task'), ''), 1, {SEARCH_CHARS})",
    "final_answer": f"""substr((SELECT json_extract(s.value, '$.content')
                               FROM json_each(t.trace, '$.steps') AS s
                               WHERE json_extract(s.value, '$.type') = 'final'
                               ORDER BY s.key DESC LIMIT 1), 1, {SEARCH_CHARS})""",
}
_POSTGRESQL = {
    "task": f"left(coalesce(t.trace->>'task', ''), {SEARCH_CHARS})",
    "final_answer": f"""left((SELECT s.step->>'content'
                             FROM jsonb_array_elements(
                                 CASE WHEN jsonb_typeof(t.trace->'steps') = 'array'
                                      THEN t.trace->'steps' ELSE '[]' END)
                                  WITH ORDINALITY AS s(step, n)
                             WHERE s.step->>'type' = 'final'
                             ORDER BY s.n DESC LIMIT 1), {SEARCH_CHARS})""",
}


def upgrade() -> None:
    # batch_alter_table: SQLite adds the columns in place; PostgreSQL runs plain ALTERs.
    with op.batch_alter_table("trace_search") as batch:
        batch.add_column(sa.Column("task", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("final_answer", sa.Text, nullable=True))
    made = _POSTGRESQL if op.get_bind().dialect.name == "postgresql" else _SQLITE
    op.execute(f"""
        UPDATE trace_search SET task = {made['task']}, final_answer = {made['final_answer']}
        FROM traces AS t WHERE t.trace_id = trace_search.trace_id
    """)


def downgrade() -> None:
    with op.batch_alter_table("trace_search") as batch:
        batch.drop_column("final_answer")
        batch.drop_column("task")
