"""ingest(): detect -> normalise -> count tokens -> score -> filter -> store.

Everything before the insert is pure CPU work on one item; the insert is the group
commit in app/inserter.py. An item is answered only after its row is committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from app import formats
from app.db.types import utcnow
from app.domain import Stage, Trace
from app.environment import Environment
from app.errors import HubError, Invalid
from app.inserter import Stored, TraceInserter
from app.tokens import count_parts

MAX_TRACE_ID_LENGTH = 200


class Ingestor:
    def __init__(self, inserter: TraceInserter, environment: Environment) -> None:
        self._inserter = inserter
        self._environment = environment
        # Parsing and tokenizing are CPU work. Two threads let tiktoken (which releases
        # the GIL) use the second core; more threads only contend for the GIL.
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ingest")

    def close(self) -> None:
        self._cpu.shutdown(wait=True)

    async def _in_thread(self, item: Any, fmt: str | None) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(
            self._cpu, self.prepare, item, fmt
        )

    async def ingest(self, item: Any, fmt: str | None = None) -> Stored:
        """Store one trace (any accepted format) and answer its stored result."""
        row = await self._in_thread(item, fmt)
        return await self._inserter.insert(row)

    async def ingest_many(
        self, items: list[Any], fmt: str | None = None
    ) -> list[Stored | HubError]:
        """Per-item results, in order; a bad item does not stop the good ones. Rows are
        queued in request order, so the first of two items with one trace_id is the
        one stored."""
        rows = await asyncio.gather(*(self._prepare_or_error(item, fmt) for item in items))
        waiting = [row if isinstance(row, HubError) else self._submit(row) for row in rows]
        return [w if isinstance(w, HubError) else await _result(w) for w in waiting]

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
        """The row for one item: parse, count tokens, score and filter. Runs in a worker
        thread (tiktoken releases the GIL), so the event loop keeps answering."""
        trace = formats.parse(item, fmt)
        trace_id = _trace_id(trace)
        evaluation = self._environment.evaluate(trace)
        now = utcnow()
        return {
            "trace_id": trace_id,
            "created_at": now,
            "updated_at": now,
            "status": trace.outcome.status.value,
            "stage": (Stage.REJECTED if evaluation.reject_reasons else Stage.ACCEPTED).value,
            "total_tokens": count_parts(trace.text_parts()),
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
            "content_hash": content_hash(item),
            "original": item,
            "trace": trace.model_copy(update={"trace_id": trace_id}).model_dump(
                mode="json", exclude_none=True
            ),
            "attempts": 0,
        }


async def _result(waiting: asyncio.Future[Stored]) -> Stored | HubError:
    try:
        return await waiting
    except HubError as exc:
        return exc


def content_hash(item: Any) -> str:
    """The same content hashes the same whatever the key order or whitespace."""
    return hashlib.sha256(orjson.dumps(item, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _trace_id(trace: Trace) -> str:
    if trace.trace_id is None:
        return uuid.uuid4().hex
    if not trace.trace_id or len(trace.trace_id) > MAX_TRACE_ID_LENGTH:
        raise Invalid(
            f"trace_id must be 1 to {MAX_TRACE_ID_LENGTH} characters", field="trace_id"
        )
    return trace.trace_id
