"""`atropos serve` answers before all of it is built (app/api/app.py, app/hub.py): the
Atropos API, ingest and health first; the dashboard, batches, runs, the gateway's routes,
/docs, the OpenAPI document and the background stages once the server answers. A
request for a part built later waits for it and gets the finished hub's answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from app.api.app import create_app
from app.config import Settings, load_compression, load_config, load_tinker
from app.hub import Hub
from tests.support.hubs import ASGI_URL, write_config
from tests.support.processes import HubProcess
from tests.support.waiting import wait_until_async

# A part of each of those built once the server answers, and what it answers.
LATER = {
    "/ui/traces": 200,
    "/v1/batches": 200,
    "/v1/runs": 403,  # runs are off: the runs routes' own answer, not a 404
    "/v1/models": 403,  # the gateway's: off too
    "/docs": 200,
}


@pytest.mark.process
def test_the_first_requests_to_each_part_get_the_finished_hubs_answers(tmp_path: Path) -> None:
    """Sent as soon as the hub says it listens, while the rest is being built."""
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")},
                          auth={"docs_enabled": True})
    hub = HubProcess(config).start(timeout=120)
    try:
        with hub.client() as client, ThreadPoolExecutor(len(LATER) + 2) as pool:
            answers = dict(zip(
                [*LATER, "/status", "/openapi.json"],
                pool.map(client.get, [*LATER, "/status", "/openapi.json"]),
            ))
        assert {path: answers[path].status_code for path in LATER} == LATER
        assert answers["/status"].status_code == 200
        assert {"/v1/batches", "/v1/runs", "/v1/traces", "/status"} <= set(
            answers["/openapi.json"].json()["paths"])
        hub.wait_for_log("Compression pipeline ready", timeout=60)
    finally:
        assert hub.stop() == 0


@asynccontextmanager
async def _hub_not_yet_answering(
    tmp_path: Path,
) -> AsyncIterator[tuple[Hub, httpx.AsyncClient, asyncio.Event]]:
    """A hub as `serve` starts it, before its server says it answers (`answering`)."""
    path = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")})
    settings = Settings(load_config(str(path)), load_compression(None), load_tinker(None))
    answering = asyncio.Event()
    app = create_app(settings, workers=False, answering=answering)
    state: dict[str, Any] = {}

    async def keeping_state(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            state.update(hub=scope["state"])  # the lifespan puts the Hub there
        await app(scope, receive, send)

    async with (
        LifespanManager(keeping_state, startup_timeout=60) as manager,
        httpx.AsyncClient(transport=httpx.ASGITransport(manager.app), base_url=ASGI_URL,
                          timeout=60) as client,
    ):
        yield state["hub"]["hub"], client, answering


async def test_the_atropos_api_answers_before_the_rest_is_built(tmp_path: Path) -> None:
    """Until the server says it answers (`answering`), no stage is built and the routes
    beyond the first requests' are not in; /status and /healthz answer meanwhile."""
    async with _hub_not_yet_answering(tmp_path) as (hub, client, answering):
        assert (await client.get("/status")).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        assert hub.stages.stages == []
        page = asyncio.create_task(client.get("/v1/batches"))
        answering.set()
        assert (await page).status_code == 200
        await wait_until_async(lambda: len(hub.stages.stages) > 0, 60, what="the stages")
        assert {stage.name for stage in hub.stages.stages} >= {
            "compression", "distribution", "delivery"}


async def test_stages_that_cannot_be_built_are_said_at_readyz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built after the server answers, a failure can no longer stop `serve`: traces are
    still taken, and /readyz lists the stages as failing."""
    import app.stages.pipeline

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("the target could not be built")

    monkeypatch.setattr(app.stages.pipeline, "running_stages", broken)
    async with _hub_not_yet_answering(tmp_path) as (hub, client, answering):
        answering.set()
        await wait_until_async(lambda: hub.outages.stages.failing is not None, 60,
                               what="the failed build")
        ready = await client.get("/readyz")
        assert ready.status_code == 200  # traces are taken
        assert ready.json()["failing"] == {
            "the background stages": "the target could not be built"}
        assert hub.stages.stages == []
