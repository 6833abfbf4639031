"""ingest(): detect -> normalise -> count tokens -> score -> filter -> store.

Everything before the insert is pure CPU work on one item; the insert is the group
commit in app/inserter.py. An item is answered only after its row is committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import orjson

from app import formats
from app.admission import Admission
from app.config import LimitsConfig
from app.db.types import utcnow
from app.domain import Stage, Trace
from app.environment import Environment
from app.errors import HubError, Invalid
from app.inserter import Stored, TraceInserter
from app.limits import check_item, check_trace
from app.tokens import count_parts

MAX_TRACE_ID_LENGTH = 200


class Ingestor:
    def __init__(
        self,
        inserter: TraceInserter,
        environment: Environment,
        limits: LimitsConfig | None = None,
        *,
        admission: Admission | None = None,
    ) -> None:
        """`admission` bounds the work in flight (the HTTP API); without it (`atropos
        import`), callers wait for each chunk and are their own back-pressure."""
        self._inserter = inserter
        self._environment = environment
        self._limits = limits or LimitsConfig()
        self._admission = admission
        # CPU work is kept off the event loop. Parsing and scoring hold the GIL: one
        # thread, since a second only contends with the loop for it. Tokenizing
        # releases the GIL, so it gets threads of its own and uses the second core
        # (bench/ingest.py: one thread for everything ~550/s, two ~410/s).
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest")
        self._tokenizer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokens")

    def close(self) -> None:
        self._cpu.shutdown(wait=True)
        self._tokenizer.shutdown(wait=True)

    async def _in_thread(self, item: Any, fmt: str | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        row, parts = await loop.run_in_executor(self._cpu, self._row, item, fmt)
        row["total_tokens"] = await loop.run_in_executor(self._tokenizer, count_parts, parts)
        return row

    async def ingest(self, item: Any, fmt: str | None = None) -> Stored:
        """Store one trace (any accepted format) and answer its stored result."""
        with self._admit(1):
            row = await self._in_thread(item, fmt)
            return await self._inserter.insert(row)

    async def ingest_many(
        self, items: list[Any], fmt: str | None = None
    ) -> list[Stored | HubError]:
        """Per-item results, in order; a bad item does not stop the good ones. Rows are
        queued in request order, so the first of two items with one trace_id is the
        one stored."""
        with self._admit(len(items)):
            rows = await asyncio.gather(*(self._prepare_or_error(item, fmt) for item in items))
            waiting = [row if isinstance(row, HubError) else self._submit(row) for row in rows]
            return [w if isinstance(w, HubError) else await _result(w) for w in waiting]

    def _admit(self, traces: int) -> AbstractContextManager[None]:
        return self._admission.admit(traces) if self._admission else nullcontext()

    async def _prepare_or_error(self, item: Any, fmt: str | None) -> dict[str, Any] | HubError:
        if isinstance(item, HubError):  # refused while reading the body (a bad NDJSON line)
            return item
        try:
            return await self._in_thread(item, fmt)
        except HubError as exc:
            return exc

    def _submit(self, row: dict[str, Any]) -> asyncio.Future[Stored] | HubError:
        try:
            return self._inserter.submit(row)
        except HubError as exc:
            return exc

    def prepare(self, item: Any, fmt: str | None = None) -> dict[str, Any]:
        """The row for one item: parse, count tokens, score and filter."""
        row, parts = self._row(item, fmt)
        return row | {"total_tokens": count_parts(parts)}

    def _row(self, item: Any, fmt: str | None) -> tuple[dict[str, Any], list[str]]:
        """The row without its token count, and the text parts to count. The limits are
        checked first, so that a trace over one costs no parsing or tokenizing."""
        check_item(item, self._limits)
        digest = content_hash(item)  # also: refuses what the `original` column cannot hold
        trace = formats.parse(item, fmt)
        check_trace(trace, self._limits)
        trace_id = _trace_id(trace)
        evaluation = self._environment.evaluate(trace)
        now = utcnow()
        row = {
            "trace_id": trace_id,
            "created_at": now,
            "updated_at": now,
            "status": trace.outcome.status.value,
            "stage": (Stage.REJECTED if evaluation.reject_reasons else Stage.ACCEPTED).value,
            "compressed_tokens": None,
            "reward": evaluation.reward,
            "reward_breakdown": evaluation.breakdown,
            "reject_reasons": evaluation.reject_reasons,
            "scored_with": self._environment.fingerprint,
            "source_format": trace.source_format,
            "env": trace.env,
            "model": trace.agent.model,
            "agent_name": trace.agent.name,
            "policy_version": trace.policy_version,
            "content_hash": digest,
            "original": item,
            "trace": trace.model_copy(update={"trace_id": trace_id}).model_dump(
                mode="json", exclude_none=True
            ),
            "attempts": 0,
        }
        return row, trace.text_parts()


async def _result(waiting: asyncio.Future[Stored]) -> Stored | HubError:
    try:
        return await waiting
    except HubError as exc:
        return exc


def content_hash(item: Any) -> str:
    """The same content hashes the same whatever the key order or whitespace. Raises
    Invalid for what cannot be stored as JSON: lone surrogates and integers past 64
    bits, which JSON read by the standard library (`atropos import`) can hold."""
    try:
        encoded = orjson.dumps(item, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise Invalid(f"the trace cannot be stored as JSON: {exc}") from None
    return hashlib.sha256(encoded).hexdigest()


def _trace_id(trace: Trace) -> str:
    if trace.trace_id is None:
        return uuid.uuid4().hex
    if not trace.trace_id or len(trace.trace_id) > MAX_TRACE_ID_LENGTH:
        raise Invalid(
            f"trace_id must be 1 to {MAX_TRACE_ID_LENGTH} characters", field="trace_id"
        )
    return trace.trace_id
