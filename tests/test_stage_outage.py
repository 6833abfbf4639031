"""The background stages failing to write while ingest still works: /readyz says 503
until the stages write again, as a full disk does to the rows the stages move."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.builders import native_trace
from tests.support.databases import db_execute
from tests.support.hubs import InProcessHub
from tests.support.waiting import wait_until

# The stages move rows (UPDATE of traces.stage); ingest inserts them. A trigger that
# fails exactly those updates with PostgreSQL's own disk-full code leaves ingest and
# small writes elsewhere (the write probe's) working: the stages alone cannot write.
_FULL = """
CREATE FUNCTION stage_moves_fail() RETURNS trigger AS $$
BEGIN RAISE EXCEPTION 'could not extend file: No space left on device'
      USING ERRCODE = 'disk_full'; END $$ LANGUAGE plpgsql;
CREATE TRIGGER stage_moves_fail BEFORE UPDATE OF stage ON traces
    FOR EACH ROW EXECUTE FUNCTION stage_moves_fail();
"""
_ROOM = "DROP TRIGGER stage_moves_fail ON traces"


def test_readyz_is_503_while_only_the_stages_fail_to_write(
    start_hub: Any, trace_server: dict[str, Any], dialect: str
) -> None:
    if dialect != "postgresql":
        pytest.skip("failing the stages' writes alone: a PostgreSQL trigger")
    # A batch of one: the distribution stage moves each trace to `batched` (ingest
    # enters it past compression).
    hub: InProcessHub = start_hub(
        {**trace_server, "flush_interval_seconds": 0.2}, workers={"lease_seconds": 1},
        distributor={"batch_size": 1})
    with hub.client() as client:
        assert client.get("/readyz").status_code == 200
        for statement in _FULL.strip().split(";\n"):
            db_execute(trace_server, statement)
        assert client.post("/v1/traces", json=native_trace(trace_id="stuck")).status_code == 202
        wait_until(lambda: client.get("/readyz").status_code == 503, timeout=10,
                   what="/readyz 503 once a stage failed to write")
        # Ingest works meanwhile, and so does the write probe: neither proves the
        # stages can write. Readiness holds at 503 through many stage retries.
        assert client.post("/v1/traces", json=native_trace(trace_id="taken")).status_code == 202
        # Over many of the stage's passes, with /readyz asked continuously (each 503
        # starts a probe write, which succeeds).
        answers = []
        until = time.monotonic() + 3
        while time.monotonic() < until:
            answers.append(client.get("/readyz"))
        assert client.get("/v1/traces/stuck").json()["stage"] == "compression_skipped"
        codes = [a.status_code for a in answers]
        assert set(codes) == {503}, codes
        assert "No space left" in answers[-1].json()["reason"], answers[-1].json()
        db_execute(trace_server, _ROOM)
        wait_until(lambda: client.get("/v1/traces/stuck").json()["stage"] == "batched",
                   what="the stage moves the trace once it can write")
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10,
                   what="/readyz 200 once the stages write again")
    assert any("DiskFullError, while running the distribution stage" in line
               for line in hub.lines), hub.log
