"""Compression at ingest (EntryStage): a trace that key_decision_extract compresses is
compressed by the ingest process that prepares it and written once, exactly as the
compression stage would have stored it; what it cannot compress there goes to the
stage, never refused. The real corpus's traces, compressed both ways, are compared as
stored."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.compression import Skipped, compression_target
from app.config import CompressionConfig, EnvironmentConfig, LimitsConfig
from app.db.models import PAYLOADS, TRACES
from app.domain import Stage, Trace
from app.evaluation.environment import Environment
from app.ingest.ingestor import EntryStage, Preparer
from app.ingest.inserter import PreparedTrace, TraceInserter
from app.stages.compression import CompressionStage
from app.stages.leases import Lease
from app.tokens import count_parts
from tests.support import REAL
from tests.support import compression_quality as quality
from tests.support.builders import native_trace
from tests.support.pipeline import migrated

POLICY, MAX_TRACE_TOKENS = quality.example_policy()
# Every trace is let through (some real runs fail the default filters), and none is
# under the threshold: the comparison is of compression's stage and record.
ENVIRONMENT = Environment.from_config(EnvironmentConfig(invalid_trace_filters=[]))
# What is compared: every column compression writes, and the compressed payload as
# the database holds it (its JSON text).
COMPARED = (TRACES.c.stage, TRACES.c.compressed_tokens, TRACES.c.compression,
            TRACES.c.attempts, TRACES.c.stage_error, TRACES.c.lease_owner,
            TRACES.c.lease_expires_at, sa.cast(PAYLOADS.c.compressed, sa.Text).label("text"))


def one_long() -> dict[str, Any]:
    """A real run that key_decision_extract compresses."""
    return bodies(quality.corpus(REAL / "mini-swe-agent"))[0]


def preparer(policy: CompressionConfig = POLICY, threshold: float = -1e9) -> Preparer:
    return Preparer(ENVIRONMENT, LimitsConfig(), entry=EntryStage(policy, MAX_TRACE_TOKENS,
                                                                 threshold))


def bodies(traces: Iterable[tuple[str, Trace]], per_source: int | None = None
           ) -> list[dict[str, Any]]:
    """The traces compression works on (not kept whole before any work), as native
    bodies sent to the API; `per_source`: at most that many of each source (a folder of
    the corpus)."""
    found = []
    taken: Counter[str] = Counter()
    for n, (location, trace) in enumerate(traces):
        total = count_parts(trace.text_parts())
        source = Path(location).relative_to(REAL).parts[0]
        if isinstance(compression_target(total, POLICY, total > MAX_TRACE_TOKENS), Skipped) \
                or per_source is not None and taken[source] >= per_source:
            continue
        taken[source] += 1
        body = trace.model_dump(mode="json", exclude_none=True, exclude={"source_format"})
        found.append(body | {"trace_id": f"real-{n}", "format": "native"})
    return found


async def store(engine: AsyncEngine, rows: list[PreparedTrace]) -> None:
    inserter = TraceInserter(engine)
    inserter.start()
    try:
        for row in rows:
            await inserter.insert(row)
    finally:
        await inserter.stop()


async def stored(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(TRACES.c.trace_id, *COMPARED).select_from(
            TRACES.join(PAYLOADS, PAYLOADS.c.trace_id == TRACES.c.trace_id)))
        return {row.trace_id: dict(row._mapping) for row in rows}


async def both_ways(
    engine: AsyncEngine, items: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The items stored compressed at ingest, then (the database emptied) stored
    `accepted` and compressed by the stage: what each way stored.

    PostgreSQL's jsonb gives objects back with their keys reordered, and the order of
    a tool schema's keys is part of the text counted (Trace.tools_text): the stage there
    counts a trace in another order than its ingest did, and may decide otherwise
    (docs/decisions.md). So the items come in jsonb's order on PostgreSQL."""
    if engine.dialect.name == "postgresql":
        items = [jsonb_order(item) for item in items]
    prepare = preparer()
    rows = [prepare.prepare(item, None, compressing=True) for item in items]
    assert all(isinstance(row, PreparedTrace) for row in rows)
    await store(engine, rows)  # type: ignore[arg-type]
    at_ingest = await stored(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.delete(TRACES))
    rows = [prepare.prepare(item, None) for item in items]
    assert {row.stage for row in rows} == {Stage.ACCEPTED.value}  # type: ignore[union-attr]
    await store(engine, rows)  # type: ignore[arg-type]
    stage = CompressionStage(engine, POLICY, max_trace_tokens=MAX_TRACE_TOKENS, lease=Lease())
    while await stage.run_once():
        pass
    return at_ingest, await stored(engine)


def jsonb_order(value: Any) -> Any:
    """`value` with its objects' keys in the order jsonb keeps them: shorter first,
    then by their bytes."""
    if isinstance(value, dict):
        return {key: jsonb_order(value[key])
                for key in sorted(value, key=lambda k: (len(k.encode()), k.encode()))}
    if isinstance(value, list):
        return [jsonb_order(child) for child in value]
    return value


async def test_real_traces_compressed_at_ingest_are_stored_as_the_stage_stores_them(
    trace_server: dict[str, Any],
) -> None:
    items = bodies(quality.corpus(), per_source=4)
    assert len(items) >= 20
    async with migrated(trace_server) as engine:
        at_ingest, via_stage = await both_ways(engine, items)
    assert at_ingest == via_stage
    stages = [row["stage"] for row in at_ingest.values()]
    # Most are compressed; some are kept whole (the saving too small), both with their record.
    assert stages.count(Stage.COMPRESSED.value) >= 15
    assert set(stages) <= {Stage.COMPRESSED.value, Stage.COMPRESSION_SKIPPED.value}


@pytest.mark.corpus
async def test_the_whole_corpus_compressed_at_ingest_is_stored_as_the_stage_stores_it(
    trace_server: dict[str, Any],
) -> None:
    items = bodies(quality.corpus())
    assert len(items) > 200
    async with migrated(trace_server) as engine:
        at_ingest, via_stage = await both_ways(engine, items)
    assert at_ingest == via_stage


def test_a_compressed_trace_under_the_threshold_enters_below_threshold() -> None:
    item = one_long()
    row = preparer(threshold=1e9).prepare(item, None, compressing=True)
    assert isinstance(row, PreparedTrace)
    assert row.stage == Stage.BELOW_THRESHOLD.value
    assert row["compressed"] is not None and row["attempts"] == 1


def test_what_needs_the_model_or_was_not_asked_for_is_left_to_the_stage() -> None:
    item = one_long()
    summarizing = POLICY.model_copy(update={"strategy": "summarize_middle"})
    for row in (preparer().prepare(item, None),
                preparer(summarizing).prepare(item, None, compressing=True)):
        assert isinstance(row, PreparedTrace)
        assert (row.stage, row["compressed"], row["compression"]) == (
            Stage.ACCEPTED.value, None, None)


def test_a_compression_that_fails_at_ingest_leaves_the_trace_to_the_stage() -> None:
    """A strategy that raises (here: a policy whose drop_fields the strategy cannot
    read) does not refuse the trace: it enters `accepted`, for the stage and its
    retries."""
    item = one_long()
    broken = POLICY.model_copy(update={"drop_fields": None})
    row = preparer(broken).prepare(item, None, compressing=True)
    assert isinstance(row, PreparedTrace)
    assert (row.stage, row["compressed"], row["attempts"]) == (Stage.ACCEPTED.value, None, 0)


def test_a_short_trace_still_enters_compression_skipped_without_compressing() -> None:
    row = preparer().prepare(native_trace(trace_id="short"), None, compressing=True)
    assert isinstance(row, PreparedTrace)
    assert (row.stage, row["attempts"], row.compressed_by) == (
        Stage.COMPRESSION_SKIPPED.value, 0, None)
