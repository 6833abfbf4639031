"""`Atropos`: the one object the API's Atropos routes call; the hub's lifespan
starts and stops it."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from app.atropos import hub_env, lease, queue, registration, status, trainer_batches
from app.atropos.models import GroupReceived, GroupsReceived, RegisterEnv, Registration
from app.atropos.presence import Presence
from app.atropos.queue import GroupWriter, Placed, prepare
from app.atropos.segments import Segment, literal
from app.atropos.tables import AtroposDb, Contention
from app.config import AtroposConfig, PrivacyConfig
from app.db.dialect import OneHop
from app.db.errors import outage_of
from app.db.group_commit import GroupCommit
from app.errors import Unavailable
from app.ingest.processes import IngestProcesses
from app.outage import Outage

# What atroposlib's /latest_example answers before any group has arrived.
NO_EXAMPLE: dict[str, list[Any]] = {
    "tokens": [],
    "masks": [],
    "scores": [],
    "advantages": [],
    "ref_logprobs": [],
    "generation_params": [],
    "inference_logprobs": [],
    "messages": [],
    "images": [],
}


class Atropos:
    def __init__(
        self,
        engine: AsyncEngine,
        config: AtroposConfig,
        processes: IngestProcesses,
        privacy: PrivacyConfig | None = None,
        *,
        writer: OneHop | None = None,
        outage: Outage | None = None,
        max_wait: float | None = None,
    ) -> None:
        """`processes`: where groups are validated, redacted and deflated, off the event
        loop; `privacy`: what is redacted from them (docs/privacy.md); `writer`,
        `outage`: the hub's; `max_wait`: a submission's deadline for its commit
        (limits.max_write_wait_seconds)."""
        self.config = config
        self._processes = processes
        self.db = AtroposDb(engine, writer)
        self._presence = Presence(config.env_timeout_seconds)
        self._writer = GroupWriter(self.db, config, self._presence,
                                   outage or outage_of(engine), max_wait=max_wait)
        # Sent to the processes as its JSON, compiled there once (queue.prepare).
        self._privacy = (privacy or PrivacyConfig()).model_dump_json()

    @property
    def commits(self) -> GroupCommit[Any, list[Placed]]:
        """The group commit of submitted groups."""
        return self._writer.commits

    def start(self) -> None:
        self._writer.start()

    async def stop(self) -> None:
        await self._writer.stop()
        await self.db.close()

    # --- the handshake -------------------------------------------------------------

    async def register(self, body: Registration) -> dict[str, Any]:
        return await registration.register(self.db, body)

    async def register_env(self, body: RegisterEnv) -> dict[str, Any]:
        return await registration.register_env(self.db, body)

    async def disconnect_env(self, env_id: int) -> dict[str, Any]:
        return await registration.disconnect_env(self.db, env_id)

    async def info(self) -> dict[str, Any]:
        return await registration.info(self.db)

    async def wandb_info(self) -> dict[str, Any]:
        return await registration.wandb_info(self.db)

    async def status(self) -> dict[str, Any]:
        return await status.status(self.db)

    async def status_env(self, env_id: int) -> dict[str, Any]:
        return await status.status_env(self.db, self._presence, env_id)

    async def env_stats(self) -> list[dict[str, Any]]:
        """The registered envs, for /v1/stats."""
        return await status.env_stats(self.db, self.config.env_timeout_seconds)

    async def queue_figures(self) -> dict[str, Any]:
        """The step and the queue, for /v1/stats and /metrics."""
        return await status.queue_figures(self.db)

    async def hub_env_figures(self) -> dict[str, Any]:
        """The rollouts of the hub's own env (app/atropos/hub_env.py), for /v1/stats."""
        return await self.db.read(hub_env.figures)

    async def overview(self) -> dict[str, Any]:
        """The state the dashboard shows (app/api/ui)."""
        return await status.overview(self.db)

    async def reset(self) -> None:
        await registration.reset(self.db)

    # --- data in -------------------------------------------------------------------

    async def scored_data(self, body: bytes) -> GroupReceived:
        """POST /scored_data: one group, as JSON."""
        (placed,) = await self._submit(body, many=False)
        if placed.buffered:
            return {"status": "buffered", "buffer_size": placed.buffer_size}
        return {"status": "received"}

    async def scored_data_list(self, body: bytes) -> GroupsReceived:
        """POST /scored_data_list: a JSON list of groups."""
        placed = await self._submit(body, many=True)
        reply: GroupsReceived = {"status": "received", "groups_processed": len(placed)}
        buffered = [p for p in placed if p.buffered]
        if buffered:
            reply["buffered"] = len(buffered)
            reply["last_buffer_size"] = buffered[-1].buffer_size
        return reply

    async def _submit(self, body: bytes, *, many: bool) -> list[Placed]:
        groups = await self._processes.call(
            prepare, body, many, self.config.max_groups_per_request, self._privacy
        )
        if not groups:
            return []
        return await self._writer.submit(groups)

    # --- data out ------------------------------------------------------------------

    async def next_batch(self, *, ack: bool = False) -> list[Segment]:
        """JSON body of GET /batch, in segments (see trainer_batches.next_batch)."""
        try:
            return await trainer_batches.next_batch(
                self.db,
                ack=ack,
                lease_seconds=self.config.ack_timeout_seconds,
                env_timeout=self.config.env_timeout_seconds,
                fill_logprobs=self.config.fill_missing_logprobs,
            )
        except Contention:
            raise Unavailable(
                "another hub is serving the same batch; retry", retry_after=1
            ) from None

    async def acknowledge(self, batch_id: str) -> dict[str, Any]:
        try:
            return await lease.acknowledge(self.db, batch_id)
        except Contention:
            raise Unavailable(
                "another hub is acknowledging this batch; retry", retry_after=1
            ) from None

    async def latest_example(self) -> list[Segment]:
        """The newest group that entered the queue, as it was sent, in segments."""
        group = await queue.latest_group(self.db)
        return [group if group is not None else literal(orjson.dumps(NO_EXAMPLE))]
