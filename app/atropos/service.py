"""`Atropos`: the one object the API's Atropos routes call; the hub's lifespan
starts and stops it."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from app.atropos import lease, queue, registration, status, trainer_batches
from app.atropos.models import RegisterEnv, Registration, ScoredData
from app.atropos.queue import GroupWriter, NewGroup, Placed
from app.atropos.tables import AtroposDb, Contention
from app.config import AtroposConfig, PrivacyConfig
from app.errors import Unavailable
from app.evaluation.redaction import Redactor

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
        self, engine: AsyncEngine, config: AtroposConfig, privacy: PrivacyConfig | None = None
    ) -> None:
        self.config = config
        self.db = AtroposDb(engine)
        self._redactor = Redactor(privacy or PrivacyConfig())
        self._writer = GroupWriter(self.db, config)

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
        return await status.status_env(self.db, env_id)

    async def reset(self) -> None:
        await registration.reset(self.db)

    # --- data in -------------------------------------------------------------------

    async def scored_data(self, group: ScoredData) -> dict[str, Any]:
        (placed,) = await self._submit([group])
        if placed.buffered:
            return {"status": "buffered", "buffer_size": placed.buffer_size}
        return {"status": "received"}

    async def scored_data_list(self, groups: list[ScoredData]) -> dict[str, Any]:
        placed = await self._submit(groups)
        reply: dict[str, Any] = {"status": "received", "groups_processed": len(groups)}
        buffered = [p for p in placed if p.buffered]
        if buffered:
            reply["buffered"] = len(buffered)
            reply["last_buffer_size"] = buffered[-1].buffer_size
        return reply

    async def _submit(self, groups: list[ScoredData]) -> list[Placed]:
        if not groups:
            return []
        return await self._writer.submit([NewGroup.from_scored(g, self._redactor) for g in groups])

    # --- data out ------------------------------------------------------------------

    async def next_batch(self, *, ack: bool = False) -> bytes:
        """JSON body of GET /batch (see trainer_batches.next_batch)."""
        try:
            return await trainer_batches.next_batch(
                self.db, ack=ack, lease_seconds=self.config.ack_timeout_seconds
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

    async def latest_example(self) -> bytes:
        """The newest group that entered the queue, as it was sent."""
        payload = await queue.latest_payload(self.db)
        return payload.encode() if payload is not None else orjson.dumps(NO_EXAMPLE)
