"""ingest(): detect -> normalise -> count tokens -> score -> filter -> store.

Everything before the insert is pure CPU work on one item (`Preparer`), done in the
ingest processes (app/ingest/processes.py) so that it runs beside the event loop
instead of contending with it for the GIL; the insert is the group commit in
app/ingest/inserter.py. An item is answered only after its row is committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import traceback
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from app import formats
from app.compression import Compressed, Skipped, compress_now, compression_target
from app.config import CompressionConfig, HubConfig, LimitsConfig, PrivacyConfig
from app.db.dialect import OneHop
from app.db.moves import TRACE_STAGES
from app.db.search import search_text
from app.db.types import EncodedJSON, utcnow
from app.domain import MAX_REWARD, Stage, Trace, below_threshold
from app.errors import HubError, Invalid
from app.evaluation.environment import Environment
from app.evaluation.redaction import REDACTED, Redacted, Redactor
from app.ingest.admission import Admission
from app.ingest.inserter import PreparedTrace, Stored, TraceInserter
from app.ingest.limits import check_item, check_trace
from app.ingest.processes import IngestProcesses
from app.metrics import (
    REJECTIONS,
    TRACES_INGESTED,
    Labeled,
    count_compressed,
    count_compression_skipped,
)
from app.outage import Outage
from app.tokens import count_parts

log = logging.getLogger("atropos.ingest")

MAX_TRACE_ID_LENGTH = 200
# env, agent.model, agent.name, policy_version: String(200) columns, which PostgreSQL
# holds to their length and SQLite does not; checked here, so both answer the same.
MAX_LABEL_LENGTH = 200
# The items of a batch go to the ingest processes in chunks of this many: one round
# trip each, and a large batch still spreads over every process.
CHUNK = 32


@dataclass(frozen=True)
class EntryStage:
    """Where an accepted trace enters the pipeline: past the stages that would move it
    with nothing to do. One that compression keeps whole before any work
    (`compression_target` is Skipped: compression off, the trace small or within its
    target) enters `compression_skipped`, its record `{"skipped": reason}` as the
    compression stage writes it; if its reward is also under the distributor's
    threshold, `below_threshold`. Any other enters `accepted`, for the stages.

    A trace that needs compressing by a strategy without model calls
    (key_decision_extract), when its caller asks (`compressing`: the ingest API's
    traces), is compressed here, by the function the stage runs on the trace as the
    stage reads it back (`compressed`), and enters where the stage would move it:
    `compressed` with its compressed payload and record, or `compression_skipped`;
    `below_threshold` under the threshold. If that fails, it enters `accepted`, and
    the stage tries again by its retry rules."""

    compression: CompressionConfig
    max_trace_tokens: int
    min_reward_threshold: float

    def of(self, total_tokens: int, reward: float | None) -> tuple[Stage, Skipped | None]:
        """The stage a new accepted trace enters, and why compression skipped it."""
        forced = total_tokens > self.max_trace_tokens
        skipped = compression_target(total_tokens, self.compression, forced)
        if not isinstance(skipped, Skipped):
            return Stage.ACCEPTED, None
        return self.past(skipped, reward), skipped

    def past(self, result: Compressed | Skipped, reward: float | None) -> Stage:
        """Where a trace compression is done with enters."""
        if below_threshold(reward, self.min_reward_threshold):
            return Stage.BELOW_THRESHOLD
        return Stage.COMPRESSED if isinstance(result, Compressed) else Stage.COMPRESSION_SKIPPED

    def compressed(
        self, trace: bytes, total_tokens: int, reward: float | None,
        breakdown: dict[str, Any] | None,
    ) -> Compressed | Skipped | None:
        """The trace (its stored JSON) compressed as the compression stage would:
        `compress` on what the stage reads back (the stored trace and breakdown, as the
        database's JSON decodes them). None when it is the stage's to do: the strategy
        calls a model, the trace is too long to compress within an item's time
        (_COMPRESSED_AT_ENTRY), or compressing failed."""
        policy = self.compression
        if policy.strategy != "key_decision_extract" or total_tokens > _COMPRESSED_AT_ENTRY:
            return None
        try:
            return compress_now(
                Trace.model_validate(orjson.loads(trace)), total_tokens, policy,
                forced=total_tokens > self.max_trace_tokens, reward=reward,
                breakdown=None if breakdown is None else orjson.loads(orjson.dumps(breakdown)),
            )
        except Exception:  # noqa: BLE001 - the stage compresses it, and says what fails
            log.debug("compressing a trace at ingest failed; the compression stage takes it",
                      exc_info=True)
            return None


# The longest trace compressed in an ingest process: ~1 MB of text, compressed in
# ~0.2 s, far within limits.max_item_seconds. Longer ones go to the compression stage,
# where no time limit applies.
_COMPRESSED_AT_ENTRY = 250_000


@dataclass(frozen=True)
class Preparer:
    """The row for one item: limits, redact, parse, score, filter and count its tokens,
    and the stage it enters (compressed, when `compressing`). Pure CPU work; pickled
    into each ingest process (the environment and the redactor as their config).
    Without `entry`, every accepted trace enters `accepted`."""

    environment: Environment
    limits: LimitsConfig
    redactor: Redactor = field(default_factory=lambda: Redactor(PrivacyConfig()))
    entry: EntryStage | None = None

    def row(
        self, item: Any, fmt: str | None = None, redacted: Mapping[str, int] | None = None,
        metadata: Mapping[str, Any] | None = None, *, compressing: bool = False,
    ) -> dict[str, Any]:
        """`redacted`: the item's secrets went before it came here (OTLP spans are
        redacted as they are stored), and these were replaced, by kind. `metadata`:
        what the trace's metadata says besides what the item holds. `compressing`:
        compress it here if it needs no model for that (EntryStage.compressed)."""
        # The limits are checked first, so that a trace over one costs no parsing.
        check_item(item, self.limits)
        canonical = canonical_json(item)  # refuses what the `original` column cannot hold
        # Secrets go before anything reads the item: the stored original, the
        # canonical trace and the content hash are all of the redacted item.
        found: dict[str, int] = {}
        if redacted is None:
            item, found = self.redactor.redact(item, canonical)
            if found:
                canonical = canonical_json(item)
        redactions = dict(Counter(redacted or {}) + Counter(found)) if redacted or found else {}
        digest = hashlib.sha256(canonical).hexdigest()
        if b"\\u0000" in canonical:  # how orjson writes NUL (or the text \\u0000)
            item = _without_nul(item)
        trace = formats.parse(item, fmt)
        if b"\\\\u0000" in canonical:
            # A string holding the text \u0000: JSON inside a string (an OTLP attribute,
            # a tool call's arguments), whose NUL the parse may have decoded.
            dumped = trace.model_dump(exclude_none=True)
            if b"\\u0000" in _json(dumped):
                trace = Trace.model_validate(_without_nul(dumped))
        trace.metadata.update(metadata or {})
        if redactions:
            trace.metadata["redactions"] = redactions
        else:
            # The hub's count alone, so that /v1/stats counts what it redacted.
            trace.metadata.pop("redactions", None)
        check_trace(trace, self.limits)
        trace.trace_id = _trace_id(trace)  # the stored trace carries the id it is stored under
        if found and REDACTED in trace.trace_id:
            # Two ids holding different secrets would be one id once redacted.
            raise Invalid("trace_id holds what looks like a secret, which is redacted "
                          "wherever it is stored: send another id", field="trace_id")
        _fits_columns(trace)
        evaluation = self.environment.evaluate(trace)
        _bounded_reward(evaluation.reward, trace.outcome.reward)
        total_tokens = count_parts(trace.text_parts())
        stage, skipped = Stage.REJECTED, None
        if not evaluation.reject_reasons:
            stage, skipped = (Stage.ACCEPTED, None) if self.entry is None else (
                self.entry.of(total_tokens, evaluation.reward))
        # model_dump, then orjson: model_dump_json's text in 3/4 of its time (pydantic's
        # writer infers the type of each `Any` value as it goes).
        stored = _json(trace.model_dump(exclude_none=True))
        compression: dict[str, Any] | None = None
        compressed: Compressed | None = None
        attempts = 0
        if skipped is not None:
            compression = {"skipped": skipped.reason}
        elif stage is Stage.ACCEPTED and compressing and self.entry is not None:
            done = self.entry.compressed(stored, total_tokens, evaluation.reward,
                                         evaluation.breakdown)
            if done is not None:
                # Written as the compression stage writes its outcome.
                stage, attempts = self.entry.past(done, evaluation.reward), 1
                if isinstance(done, Skipped):
                    skipped, compression = done, {"skipped": done.reason}
                else:
                    compressed, compression = done, done.record()
        now = utcnow()
        return {
            "trace_id": trace.trace_id,
            "created_at": now,
            "updated_at": now,
            "status": trace.outcome.status.value,
            "stage": TRACE_STAGES.enter(stage),
            "total_tokens": total_tokens,
            "compressed_tokens": None if compressed is None else compressed.tokens_after,
            "compression": compression,
            "reward": evaluation.reward,
            "env_reward": trace.outcome.reward,
            "reward_breakdown": evaluation.breakdown,
            "reject_reasons": evaluation.reject_reasons,
            "scored_with": self.environment.fingerprint,
            "source_format": _source_format(trace),
            "env": trace.env,
            "model": trace.agent.model,
            "agent_name": trace.agent.name,
            "policy_version": trace.policy_version,
            "group_id": group_of(trace),
            "content_hash": digest,
            # Encoded here, in the ingest process, rather than on the event loop.
            "original": EncodedJSON(orjson.dumps(item).decode()),
            "trace": EncodedJSON(stored.decode()),
            "compressed": None if compressed is None else EncodedJSON(_json(
                compressed.trace.model_dump(mode="json", exclude_none=True)).decode()),
            # The compression stage's claim counts an attempt; one made here is one too.
            "attempts": attempts,
            # Not columns of traces: trace_search's (app/db/search.py), and what the
            # metrics count compression at entry under.
            "search_text": search_text(trace),
            "skip_kind": None if skipped is None else skipped.kind,
            "compressed_by": None if compressed is None else (
                compressed.strategy, compressed.tokens_before, compressed.tokens_after),
        }

    def prepare(
        self, item: Any, fmt: str | None, compressing: bool = False
    ) -> PreparedTrace | HubError:
        """The item's row, ready to insert, or the HubError that refuses it. An item may
        come as bytes (`formats.load`: its JSON text, or an OTLP protobuf request),
        which is cheaper to send to a process than the parsed value; or `Redacted`
        (OTLP spans, whose secrets went before they were stored). `compressing`: see
        `row`."""
        earlier: Mapping[str, int] | None = None
        metadata: Mapping[str, Any] | None = None
        if isinstance(item, Redacted):
            item, earlier, metadata = item.item, item.counts, item.metadata
        try:
            return PreparedTrace.of(self.row(
                formats.load(item, fmt) if isinstance(item, bytes) else item, fmt,
                redacted=earlier, metadata=metadata, compressing=compressing,
            ))
        except HubError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - a bug, refusing this item alone
            return _unprepared(exc)


def _unprepared(exc: Exception) -> Invalid:
    """A failure preparing one item that is no refusal of the hub's (a bug, or input
    past what a parser can take: a RecursionError) refuses that item, never the batch
    or the pass it came with. Logged where it was raised, without its message, which
    may quote the item."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
    log.error("preparing a trace failed (%s%s); it is refused", type(exc).__name__, at)
    return Invalid(f"the hub could not read this trace ({type(exc).__name__}); it is "
                   "refused (the hub's log says where)", code="unreadable")


def ingest_processes(
    config: HubConfig,
    environment: Environment,
    outage: Outage | None = None,
    *,
    start_wait: float | None = None,
    entry: EntryStage | None = None,
) -> IngestProcesses:
    """The ingest processes of one hub (default: one per CPU, at most 8), not started:
    every part that prepares work off the event loop shares them. `start_wait`: how
    long a call waits for them to start (app/ingest/processes.py); `entry`: where
    accepted traces enter (without it, `accepted`)."""
    preparer = Preparer(environment, config.limits, Redactor(config.privacy), entry)
    return IngestProcesses(preparer, config.trace_server.ingest_processes or min(_cpus(), 8),
                           outage=outage, start_wait=start_wait)


class Ingestor:
    def __init__(
        self,
        inserter: TraceInserter,
        processes: IngestProcesses,
        *,
        admission: Admission | None = None,
    ) -> None:
        """`processes`: where items are prepared (the hub's); `admission` bounds the
        work in flight (the HTTP API); without it (`atropos import`), callers wait for
        each chunk and are their own back-pressure."""
        self._inserter = inserter
        self._admission = admission
        self._processes = processes

    @property
    def processes(self) -> IngestProcesses:
        return self._processes

    async def ingest(self, item: Any, fmt: str | None = None) -> Stored:
        """Store one trace (any accepted format) and answer its stored result."""
        with self._admit(1):
            (row,) = await self._processes.rows([item], fmt, compressing=True)
            if isinstance(row, HubError):
                _counted(row, row, fmt)
                raise row
            try:
                stored = await self._inserter.insert(row)
            except HubError as exc:
                _counted(row, exc, fmt)
                raise
            _counted(row, stored, fmt)
            return stored

    async def ingest_many(
        self, items: list[Any], fmt: str | None = None
    ) -> list[Stored | HubError]:
        """Per-item results, in order; a bad item does not stop the good ones. Rows are
        queued in request order, so the first of two items with one trace_id is the
        one stored. An item may already be a HubError (a bad NDJSON line): it stays."""
        with self._admit(len(items)):
            todo = [item for item in items if not isinstance(item, HubError)]
            done = iter(await self.prepare(todo, fmt, compressing=True))
            rows = [item if isinstance(item, HubError) else next(done) for item in items]
            results = await self.store(rows)
            for row, result in zip(rows, results):
                _counted(row, result, fmt)
            return results

    async def prepare(
        self, items: list[Any], fmt: str | None = None, *, compressing: bool = False
    ) -> list[PreparedTrace | HubError]:
        """Each item's row (parsed, scored, filtered, its tokens counted) or the
        HubError that refuses it, in order, without storing it: for callers that store
        rows themselves (the OTLP assembly stage). `compressing`: compressed where the
        policy needs no model (EntryStage); the traces the stages make are left to the
        compression stage."""
        chunks = [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
        prepared = await asyncio.gather(
            *(self._processes.rows(c, fmt, compressing=compressing) for c in chunks))
        return [row for rows in prepared for row in rows]

    async def store(
        self, rows: list[PreparedTrace | HubError]
    ) -> list[Stored | HubError]:
        """Commit prepared rows through the traces' group commit, queued in order; each
        one's result (a row that is already a HubError stays one)."""
        waiting = [row if isinstance(row, HubError) else self._submit(row) for row in rows]
        return [w if isinstance(w, HubError) else await _result(w) for w in waiting]

    def _admit(self, traces: int) -> AbstractContextManager[None]:
        return self._admission.admit(traces) if self._admission else nullcontext()

    def _submit(self, row: PreparedTrace) -> asyncio.Future[Stored] | HubError:
        try:
            return self._inserter.submit(row)
        except HubError as exc:
            return exc


@dataclass(frozen=True)
class IngestPath:
    inserter: TraceInserter
    ingestor: Ingestor
    admission: Admission | None  # the HTTP API's: other writers (OTLP spans) share it


@asynccontextmanager
async def running_ingest(
    engine: AsyncEngine,
    config: HubConfig,
    environment: Environment,
    *,
    admitted: bool,
    on_commit: Callable[[list[PreparedTrace]], None] | None = None,
    processes: IngestProcesses | None = None,
    writer: OneHop | None = None,
    outage: Outage | None = None,
    entry: EntryStage | None = None,
    start_wait: float | None = None,
) -> AsyncIterator[IngestPath]:
    """The ingest path of one process, running: the ingest processes that prepare rows
    and the inserter that commits them (`atropos serve` and `atropos import` alike).

    `admitted`: the work in flight is bounded by config.limits, past which new traces
    get 503 (the HTTP API), as is a trace not committed within
    limits.max_write_wait_seconds; without it (`atropos import`) the callers wait for
    each chunk and are their own back-pressure. `processes`, `writer`, `outage`: the
    hub's, which starts and ends them; without them the path has its own, started now
    (`entry`: where its accepted traces enter; `start_wait`: see IngestProcesses). On
    exit what is queued is committed first."""
    limits = config.limits
    inserter = TraceInserter(
        engine,
        writer=writer,
        outage=outage,
        max_queue=limits.max_queued_traces if admitted else 10_000,
        max_wait=limits.max_write_wait_seconds if admitted else None,
        retry_after=limits.retry_after_seconds,
        on_commit=on_commit,
    )
    admission = Admission(limits, inserter.write_wait) if admitted else None
    own = processes is None
    if processes is None:
        processes = ingest_processes(config, environment, entry=entry, start_wait=start_wait)
        processes.start()
    ingestor = Ingestor(inserter, processes, admission=admission)
    inserter.start()
    try:
        yield IngestPath(inserter, ingestor, admission)
    finally:
        await inserter.stop()  # answers what is queued before the engine goes
        if own:
            await processes.close()


_ingested = Labeled(TRACES_INGESTED)
_rejected_by = Labeled(REJECTIONS)


def _counted(row: PreparedTrace | HubError, result: Stored | HubError, fmt: str | None) -> None:
    """The trace's outcome in the metrics (app/metrics.py)."""
    source = row.source_format if isinstance(row, PreparedTrace) else fmt or "unknown"
    if isinstance(result, HubError):
        count_outcome(source, "unavailable" if result.status == 503 else "refused")
    elif result.duplicate:
        count_outcome(source, "duplicate")
    else:
        assert isinstance(row, PreparedTrace)
        count_stored(row, source)


def count_stored(row: PreparedTrace, source: str) -> None:
    """A trace stored new, in the metrics: its outcome, and what compression did at
    entry as the compression stage counts its own."""
    count_outcome(source, "rejected" if row.stage == Stage.REJECTED else "accepted",
                  row.reject_reasons)
    if row.skip_kind is not None:
        count_compression_skipped(row.skip_kind)
    if row.compressed_by is not None:
        count_compressed(*row.compressed_by)


def count_outcome(
    source: str, outcome: str, reject_reasons: list[dict[str, Any]] | None = None
) -> None:
    """A trace received, in the metrics: here, and where OTLP trajectories are made
    (app/stages/assembly.py). A rejected one counts for each filter it failed."""
    if outcome == "rejected":
        for reason in reject_reasons or ():
            _rejected_by(str(reason.get("filter"))).inc()
    _ingested(source, outcome).inc()


def _cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


async def _result(waiting: asyncio.Future[Stored]) -> Stored | HubError:
    try:
        return await waiting
    except HubError as exc:
        return exc


def canonical_json(item: Any) -> bytes:
    """The JSON whose sha256 is the `content_hash` column: the same content encodes the
    same whatever the key order or whitespace (the item as received, NUL included).
    Raises Invalid for what cannot be stored as JSON: lone surrogates and integers past
    64 bits, which JSON read by the standard library (`atropos import`) can hold."""
    return _json(item, orjson.OPT_SORT_KEYS)


def _json(value: Any, option: int = 0) -> bytes:
    """`value` as JSON text, or Invalid: orjson refuses lone surrogates, integers past 64
    bits and nesting past 254 levels, which a tool call's arguments sent as a string
    can reach once parsed (limits.max_json_depth bounds the item as sent)."""
    try:
        return orjson.dumps(value, option=option)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise Invalid(f"the trace cannot be stored as JSON: {exc}") from None


# What a NUL character is stored as: PostgreSQL's text and jsonb cannot hold one
# (SQLite can), and agents do write them (a tool that printed a binary file), so the
# same trace is stored the same on both, with U+FFFD, Unicode's "replacement character".
NUL_STORED_AS = "\ufffd"


def _without_nul(value: Any) -> Any:
    """`value` with every NUL in its strings and keys replaced by NUL_STORED_AS (its
    nesting is bounded by limits.max_json_depth, checked before)."""
    if isinstance(value, str):
        return value.replace("\x00", NUL_STORED_AS)
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(child) for key, child in value.items()}
    if isinstance(value, list):
        return [_without_nul(child) for child in value]
    return value


def _bounded_reward(reward: float, env_reward: float | None) -> None:
    """The reward the rules and the weighted environment reward add up to is bounded as
    the environment's own is (app/formats/_common.reward_value): a finite env reward
    times a weight may be neither."""
    if math.isfinite(reward) and abs(reward) <= MAX_REWARD:
        return
    cause = ("the environment's reward times environment.env_reward.weight"
             if env_reward is not None else "the reward rules' points")
    raise Invalid(f"reward: {reward:g} ({cause}) is out of range: a reward is at most "
                  f"{MAX_REWARD:g} in magnitude", field="reward")


def group_of(trace: Trace) -> str | None:
    """The group of rollouts a trace belongs to (its metadata's `group`), when it is a
    label the traces list can filter by."""
    group = trace.metadata.get("group")
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        return None
    text = str(group)
    return text if 0 < len(text) <= MAX_LABEL_LENGTH else None


def _fits_columns(trace: Trace) -> None:
    labels = (
        ("env", trace.env),
        ("agent.model", trace.agent.model),
        ("agent.name", trace.agent.name),
        ("policy_version", trace.policy_version),
    )
    for name, value in labels:
        if value is not None and len(value) > MAX_LABEL_LENGTH:
            raise Invalid(f"{name} must be at most {MAX_LABEL_LENGTH} characters", field=name)


def _trace_id(trace: Trace) -> str:
    """The id the trace gave, or a new one. Any printable text up to the length bound,
    "/" included (GET /v1/traces/{trace_id} takes it, raw or as %2F); no control, line
    separator or invisible format characters, which ids carry into log lines."""
    if trace.trace_id is None:
        return uuid.uuid4().hex
    if not trace.trace_id or len(trace.trace_id) > MAX_TRACE_ID_LENGTH:
        raise Invalid(
            f"trace_id must be 1 to {MAX_TRACE_ID_LENGTH} characters", field="trace_id"
        )
    if not trace.trace_id.isprintable():
        raise Invalid(
            "trace_id must be printable text: no control characters, line separators or "
            "invisible format characters",
            field="trace_id",
        )
    return trace.trace_id


def _source_format(trace: Trace) -> str:
    """The format the trace was written in: for an import (which arrives as native),
    the source's, which the importer notes in metadata.imported_from."""
    imported = trace.metadata.get("imported_from")
    source = imported.get("format") if isinstance(imported, dict) else None
    if trace.source_format == "native" and isinstance(source, str):
        return source
    return trace.source_format
