"""The rollouts stage: the captured calls of each gateway rollout that has come due
become one trajectory, the trace `rollout_id` in format `gateway`, which goes through
the ingest pipeline as any trace does (scored, filtered, its tokens counted, in the
ingest processes).

A rollout is due once it is finished (POST /v1/rollouts/{id}/finish) or no call has
come for gateway.quiet_seconds. Every step is in the database (app/gateway/store.py):
calls acknowledged before a crash are assembled after the restart, and the trajectory
and the rollout's state are written in one transaction. A rollout that receives calls
or a finish again is assembled again: its trajectory is replaced and scored again
unless it was batched already (then the change is counted late), as OTLP traces are
(app/stages/assembly.py, whose outcome rules this stage shares).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import GatewayConfig
from app.db.dialect import writing
from app.db.types import utcnow
from app.errors import HubError
from app.evaluation.redaction import Redacted
from app.formats.gateway import NAME, document
from app.gateway import store
from app.gateway.store import FINAL_STAGES, RolloutState, Settled
from app.ingest.inserter import PreparedTrace
from app.stages.assembly import stored_trajectories, write_trajectories

log = logging.getLogger("atropos.gateway")

Prepare = Callable[[list[Any], str | None], Awaitable[list[PreparedTrace | HubError]]]


class RolloutStage:
    name = "rollouts"

    def __init__(self, engine: AsyncEngine, config: GatewayConfig, prepare: Prepare, *,
                 batch: int = 256, on_advance: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self._config = config
        self._prepare = prepare  # Ingestor.prepare: the ingest pipeline but the insert
        self._batch = batch
        self._on_advance = on_advance

    @property
    def poll_seconds(self) -> float:
        """How often to look for rollouts come due (finished ones too)."""
        return min(0.5, self._config.quiet_seconds / 4)

    async def run_once(self) -> int:
        async with self._engine.connect() as conn:
            due = await store.due(conn, utcnow(), self._config.quiet_seconds, self._batch)
            if not due:
                return 0
            ids = [d.rollout_id for d in due]
            stored = await stored_trajectories(conn, ids)
            todo = [i for i in ids if i not in stored
                    or (stored[i].source_format == NAME and stored[i].stage not in FINAL_STAGES)]
            found = await store.rollouts(conn, todo)
        made = await self._prepare([_item(found[i]) for i in todo], NAME)
        settled: list[Settled] = []
        async with writing(self._engine) as conn:
            written = await write_trajectories(conn, ids, todo, made, stored, NAME)
            for d, (what, error) in zip(due, written.outcomes):
                if what == "again":
                    continue  # it moved meanwhile, and stays due: the next round takes it
                if error is not None:
                    log.warning("gateway rollout %s makes no trajectory: %s", d.rollout_id,
                                error)
                state = RolloutState.REFUSED if what == "refused" else RolloutState.ASSEMBLED
                settled.append(Settled(d.rollout_id, d.changes, state, late=what == "late",
                                       error=error))
            await store.settle(conn, settled)
        outcomes = written.counted(NAME)
        log.info("gateway: %d rollouts assembled (%s)", len(due),
                 ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())))
        if (outcomes["new"] or outcomes["replaced"]) and self._on_advance is not None:
            self._on_advance()
        return len(due)


def _item(rollout: store.Rollout) -> Redacted:
    """The rollout's document; its secrets went as each call was captured."""
    redactions: Counter[str] = Counter()
    for call in rollout.calls:
        redactions.update(call.get("redactions") or {})
    return Redacted(document(rollout.rollout_id, rollout.calls, rollout.finish),
                    dict(redactions))
