"""reviews, review claims, the search text of traces, and the indexes the trace list
sorts and filters by

Revision ID: 0010
Revises: 0008
Create Date: 2026-12-02

- `reviews`: a person's verdict on a trace (label good/bad, note, reward override),
  one row per trace, with who and when.
- `review_claims`: the review queue's leases: a trace served to one reviewer is not
  served to another until its claim expires.
- `trace_search`: the text that the trace list's search reads (task and final answer,
  lowercased, each cut to SEARCH_CHARS), one narrow row per trace, so that a search
  never reads the trace payloads. A trigger fills it on every insert into `traces`,
  whoever writes (ingest, import, a user's own INSERT); this revision fills it for the
  traces already stored. On SQLite an FTS5 trigram index over it
  (`trace_search_index`, kept in step by triggers) finds the rows that contain a
  word without reading them all. (0013 drops the trigger and the index: the hub
  writes the text, and a search reads the narrow table.)
- Indexes that give each sort order of the list as it is ((created_at, trace_id),
  (reward, trace_id), (total_tokens, trace_id)) and the list's common filters in time
  order ((status, created_at), (env, created_at), (model, created_at)), replacing the
  single-column ones: a page then reads about as many rows as it shows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.types import BIG_ID, TIMESTAMP

revision = "0010"
down_revision = "0008"
branch_labels = None
depends_on = None

SEARCH_CHARS = 2000
_INDEXES = {
    "ix_traces_created_at_trace_id": ["created_at", "trace_id"],
    "ix_traces_reward_trace_id": ["reward", "trace_id"],
    "ix_traces_total_tokens_trace_id": ["total_tokens", "trace_id"],
    "ix_traces_status_created_at": ["status", "created_at"],
    "ix_traces_env_created_at": ["env", "created_at"],
    "ix_traces_model_created_at": ["model", "created_at"],
}
_REPLACED = {"ix_traces_created_at": "created_at", "ix_traces_status": "status",
             "ix_traces_env": "env", "ix_traces_model": "model"}

# The text of one trace row (`t`, the canonical trace in t.trace): its task, a newline,
# and its last final answer. SQLite's lower() folds ASCII only (as its LIKE does).
_SQLITE_TEXT = f"""
lower(substr(coalesce(json_extract(t.trace, '$.task'), ''), 1, {SEARCH_CHARS})
      || char(10) ||
      substr(coalesce((SELECT json_extract(s.value, '$.content')
                       FROM json_each(t.trace, '$.steps') AS s
                       WHERE json_extract(s.value, '$.type') = 'final'
                       ORDER BY s.key DESC LIMIT 1), ''), 1, {SEARCH_CHARS}))
"""
_PG_TEXT = f"""
lower(left(coalesce(t.trace->>'task', ''), {SEARCH_CHARS})
      || chr(10) ||
      left(coalesce((SELECT s.step->>'content'
                     FROM jsonb_array_elements(CASE WHEN jsonb_typeof(t.trace->'steps') = 'array'
                                                    THEN t.trace->'steps' ELSE '[]' END)
                          WITH ORDINALITY AS s(step, n)
                     WHERE s.step->>'type' = 'final'
                     ORDER BY s.n DESC LIMIT 1), ''), {SEARCH_CHARS}))
"""


def upgrade() -> None:
    op.create_table(
        "reviews",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("label", sa.String(8), nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("reviewer", sa.String(200), nullable=False),
        sa.Column("reviewed_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name="pk_reviews"),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.trace_id"],
            name="fk_reviews_trace_id_traces", ondelete="CASCADE",
        ),
    )
    op.create_index("ix_reviews_label", "reviews", ["label"])
    op.create_table(
        "review_claims",
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name="pk_review_claims"),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.trace_id"],
            name="fk_review_claims_trace_id_traces", ondelete="CASCADE",
        ),
    )
    op.create_index("ix_review_claims_holder", "review_claims", ["holder"])
    op.create_table(
        "trace_search",
        # The FTS5 index refers to rows by this integer (SQLite's rowid), which, unlike
        # an implicit rowid, VACUUM never renumbers.
        sa.Column("id", BIG_ID, nullable=False, autoincrement=True),
        sa.Column("trace_id", sa.String(200), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_trace_search"),
        sa.UniqueConstraint("trace_id", name="uq_trace_search_trace_id"),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.trace_id"],
            name="fk_trace_search_trace_id_traces", ondelete="CASCADE",
        ),
    )
    for name, columns in _INDEXES.items():
        op.create_index(name, "traces", columns)
    for name in _REPLACED:
        op.drop_index(name, "traces")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"INSERT INTO trace_search (trace_id, text) "
                   f"SELECT t.trace_id, {_PG_TEXT} FROM traces AS t")
        create_fill_trigger()
    else:
        create_fts_index()
        op.execute(f"INSERT INTO trace_search (trace_id, text) "
                   f"SELECT t.trace_id, {_SQLITE_TEXT} FROM traces AS t")
        create_fill_trigger()


def downgrade() -> None:
    drop_fill_trigger()
    if op.get_bind().dialect.name != "postgresql":
        drop_fts_index()
    for name in _REPLACED:
        op.create_index(name, "traces", [_REPLACED[name]])
    for name in _INDEXES:
        op.drop_index(name, "traces")
    op.drop_table("trace_search")
    op.drop_table("review_claims")
    op.drop_index("ix_reviews_label", "reviews")
    op.drop_table("reviews")


# What 0013 takes away, and puts back on its way down.


def create_fts_index() -> None:
    """SQLite: the FTS5 trigram index over trace_search, kept in step by triggers."""
    op.execute("""
        CREATE VIRTUAL TABLE trace_search_index USING fts5(
            text, content='trace_search', content_rowid='id', tokenize='trigram')
    """)
    op.execute("""
        CREATE TRIGGER trace_search_indexed AFTER INSERT ON trace_search BEGIN
            INSERT INTO trace_search_index (rowid, text) VALUES (NEW.id, NEW.text);
        END
    """)
    op.execute("""
        CREATE TRIGGER trace_search_unindexed AFTER DELETE ON trace_search BEGIN
            INSERT INTO trace_search_index (trace_search_index, rowid, text)
            VALUES ('delete', OLD.id, OLD.text);
        END
    """)


def drop_fts_index() -> None:
    op.execute("DROP TRIGGER IF EXISTS trace_search_indexed")
    op.execute("DROP TRIGGER IF EXISTS trace_search_unindexed")
    op.execute("DROP TABLE IF EXISTS trace_search_index")


def create_fill_trigger() -> None:
    """The trigger that filled trace_search on every insert into traces, until 0013
    (which also calls this, on its way down)."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"""
            CREATE FUNCTION trace_search_fill() RETURNS trigger AS $$
            BEGIN
                INSERT INTO trace_search (trace_id, text)
                SELECT t.trace_id, {_PG_TEXT} FROM (SELECT NEW.trace_id, NEW.trace) AS t
                ON CONFLICT (trace_id) DO UPDATE SET text = EXCLUDED.text;
                RETURN NULL;
            END $$ LANGUAGE plpgsql
        """)
        op.execute("""
            CREATE TRIGGER traces_search_fill AFTER INSERT ON traces
            FOR EACH ROW EXECUTE FUNCTION trace_search_fill()
        """)
    else:
        # A trace_id deleted by hand with foreign keys off (the sqlite3 shell's
        # default) may have left its row: deleted first (through
        # trace_search_unindexed, which REPLACE would skip), so a new trace under that
        # id still stores.
        op.execute(f"""
            CREATE TRIGGER traces_search_fill AFTER INSERT ON traces BEGIN
                DELETE FROM trace_search WHERE trace_id = NEW.trace_id;
                INSERT INTO trace_search (trace_id, text)
                SELECT t.trace_id, {_SQLITE_TEXT}
                FROM (SELECT NEW.trace_id AS trace_id, NEW.trace AS trace) AS t;
            END
        """)


def drop_fill_trigger() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS traces_search_fill ON traces")
        op.execute("DROP FUNCTION IF EXISTS trace_search_fill()")
    else:
        op.execute("DROP TRIGGER IF EXISTS traces_search_fill")
