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

from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import GatewayConfig
from app.db.dialect import writing
from app.db.types import utcnow
from app.evaluation.redaction import Redacted
from app.formats.gateway import NAME, document
from app.gateway import store
from app.gateway.store import ROLLOUT_ASSEMBLY
from app.stages.assembly import (
    Prepare,
    TakeOn,
    stored_trajectories,
    to_make,
    write_trajectories,
)

log = logging.getLogger("atropos.gateway")


class RolloutStage:
    name = "rollouts"

    def __init__(self, engine: AsyncEngine, config: GatewayConfig, prepare: Prepare, *,
                 batch: int = 256, on_advance: TakeOn | None = None) -> None:
        self._engine = engine
        self._config = config
        self._prepare = prepare  # Ingestor.prepare: the ingest pipeline but the insert
        self.batch = batch  # (ComesDue) rollouts a pass makes at most
        self._on_advance = on_advance

    @property
    def poll_seconds(self) -> float:
        """How often to look for rollouts come due (finished ones too)."""
        return min(0.5, self._config.quiet_seconds / 4)

    async def run_once(self) -> int:
        async with self._engine.connect() as conn:
            due = await store.due(conn, utcnow(), self._config.quiet_seconds, self.batch)
            if not due:
                return 0
            ids = [d.id for d in due]
            stored = await stored_trajectories(conn, ids)
            todo = to_make(ids, stored, NAME)
            found = await store.rollouts(conn, todo)
        made = await self._prepare([_item(found[i]) for i in todo], NAME)
        async with writing(self._engine) as conn:
            written = await write_trajectories(conn, ids, todo, made, stored, NAME)
            settled = ROLLOUT_ASSEMBLY.settled(due, dict(zip(ids, written.outcomes)))
            for s in settled:
                if s.error is not None:
                    log.warning("gateway rollout %s makes no trajectory: %s", s.id, s.error)
            await ROLLOUT_ASSEMBLY.settle(conn, settled)
        written.report(log, f"gateway: {len(due)} rollouts", NAME, self._on_advance)
        return len(due)


def _item(rollout: store.CapturedRollout) -> Redacted:
    """The rollout's document; its secrets went as each call was captured."""
    redactions: Counter[str] = Counter()
    for call in rollout.calls:
        redactions.update(call.get("redactions") or {})
    return Redacted(document(rollout.rollout_id, rollout.calls, rollout.finish),
                    dict(redactions))
