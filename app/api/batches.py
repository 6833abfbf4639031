"""/v1/batches: the batches formed for training, and re-queueing a failed one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.access.keys import Scope
from app.api.auth import requires
from app.api.deps import ConnDep, HubDep
from app.api.openapi import errors
from app.api.schemas import BatchDetail, BatchPage
from app.db.batch_queries import get_batch, list_batches, retry_batch
from app.domain import BatchState

router = APIRouter(tags=["batches"])


@router.get("/v1/batches", dependencies=[requires(Scope.READ)], responses=errors(400))
async def list_(
    conn: ConnDep,
    state: BatchState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: str | None = None,
) -> BatchPage:
    records, next_cursor = await list_batches(conn, state, limit, cursor)
    return BatchPage(batches=records, next_cursor=next_cursor)


@router.get("/v1/batches/{batch_id}", dependencies=[requires(Scope.READ)],
            responses=errors(404))
async def get(batch_id: str, conn: ConnDep) -> BatchDetail:
    return BatchDetail.model_validate(await get_batch(conn, batch_id))


@router.post("/v1/batches/{batch_id}/retry", dependencies=[requires(Scope.ADMIN)],
             responses=errors(404, 409))
async def retry(batch_id: str, hub: HubDep) -> BatchDetail:
    batch = await retry_batch(hub.engine, batch_id)
    hub.stages.wake()  # this process's delivery stage takes it now, not at the next flush
    return BatchDetail.model_validate(batch)
