"""The Atropos trajectory API on a live hub, over both databases: the handshake,
batching (weights, minimum allocations, mixed group sizes), the ack lease, the
queue bound, and kill -9 at each step (those tests start hub processes)."""

from __future__ import annotations

import gzip
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from app.atropos.tables import ATROPOS_BATCHES, GROUPS, WAITING, AtroposBatchState
from app.db.types import utcnow
from tests.support.databases import (
    PG_ADMIN_URL,
    create_pg_database,
    db_execute,
    drop_pg_database,
    make_api_key,
)
from tests.support.hubs import InProcessHub, write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.waiting import wait_until

TRAINER = {
    "wandb_group": "group",
    "wandb_project": "project",
    "batch_size": 8,
    "max_token_len": 512,
    "checkpoint_dir": "/tmp/checkpoints",
    "save_checkpoint_interval": 10,
    "starting_step": 0,
    "num_steps": 100,
}
_markers = itertools.count(1)
_NO_PG = pytest.mark.skipif(not PG_ADMIN_URL, reason="no PostgreSQL: set ATROPOS_TEST_DATABASE_URL")


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=_NO_PG)])
def shared_hub(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessHub]:
    """One hub per database for the tests that need no restart or special config."""
    directory = tmp_path_factory.mktemp("atropos")
    if request.param == "sqlite":
        trace_server = {"storage_backend": "sqlite", "db_path": str(directory / "hub.db")}
    else:
        trace_server = {"storage_backend": "postgresql", "database_url": create_pg_database()}
    hub = InProcessHub(write_config(directory, trace_server)).start()
    yield hub
    hub.stop()
    if request.param == "postgresql":
        drop_pg_database(trace_server["database_url"])


@pytest.fixture
def api(shared_hub: InProcessHub) -> Iterator[httpx.Client]:
    """A client of the shared hub, reset to no registered trainer."""
    with shared_hub.client() as client:
        assert client.get("/reset_data").text == "Reset successful"
        yield client


def register(client: httpx.Client, **overrides: Any) -> None:
    r = client.post("/register", json={**TRAINER, **overrides})
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["uuid"], int)


def start(client: httpx.Client) -> None:
    """The trainer's first GET /batch starts the run."""
    r = client.get("/batch")
    assert r.status_code == 200 and "batch" in r.json(), r.text


def register_env(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"max_token_length": 512, "desired_name": "env", "weight": 1.0, "group_size": 2}
    r = client.post("/register-env", json={**body, **fields})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def group(size: int, env_id: int | None = None, **fields: Any) -> dict[str, Any]:
    """A group whose first token is a marker unique in the test run."""
    marker = next(_markers)
    tokens = [[marker, 11, 12, 13 + i] for i in range(size)]
    return {
        "tokens": tokens,
        "masks": [[-100, -100, 12, 13 + i] for i in range(size)],
        "scores": [float(i % 2) for i in range(size)],
        "env_id": env_id,
        **fields,
    }


def marker(g: dict[str, Any]) -> int:
    return int(g["tokens"][0][0])


def post(client: httpx.Client, g: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/scored_data", json=g)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def batch_markers(client: httpx.Client, **params: Any) -> list[int] | None:
    batch = client.get("/batch", params=params).json()["batch"]
    return None if batch is None else [marker(g) for g in batch]


def restart(hub: HubProcess, client: httpx.Client) -> httpx.Client:
    """kill -9, start again, and a client for the new address."""
    client.close()
    hub.kill()
    hub.start()
    return hub.client()


# --- handshake ------------------------------------------------------------------------


@pytest.mark.process
def test_handshake_killed_at_each_step(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub_process(trace_server)
    client = hub.client()
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert client.get("/wandb_info").json() == {"group": None, "project": None}
    assert client.get("/status").json() == {"current_step": 0, "queue_size": 0}
    assert client.get("/latest_example").json()["tokens"] == []
    assert client.get("/batch").json() == {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }
    register(client, starting_step=7)
    client = restart(hub, client)
    assert client.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
    assert client.get("/wandb_info").json() == {"group": "group", "project": "project"}
    # A second /register (another trainer rank) gets its own uuid, changes nothing.
    register(client, batch_size=64)
    assert client.get("/info").json()["batch_size"] == 8
    assert register_env(client) == {"status": "wait for trainer to start"}
    assert client.get("/batch").json() == {"batch": None}
    client = restart(hub, client)
    assert register_env(client, desired_name="math", weight=3.0, max_token_length=1024) == {
        "status": "success",
        "env_id": 0,
        "wandb_name": "math_0",
        "checkpoint_dir": "/tmp/checkpoints",
        "starting_step": 7,
        "checkpoint_interval": 10,
        "num_steps": 100,
    }
    assert (
        register_env(client, desired_name="math", max_token_length=1024)["wandb_name"] == "math_1"
    )
    client = restart(hub, client)
    # The next env gets the next id; the ids and weights before it are kept.
    assert register_env(client, desired_name="code")["env_id"] == 2
    assert client.post("/disconnect-env", json={"env_id": 2}).json() == {"status": "success"}
    assert client.post("/disconnect-env", json={"env_id": 9}).json()["status"] == "failure"
    status = client.request("GET", "/status-env", json={"env_id": 0}).json()
    assert status["env_weight"] == 0.75  # 3 of the 4 connected weight units
    assert client.get("/status-env", params={"env_id": 1}).json()["env_weight"] == 0.25
    assert client.get("/status").json() == {"current_step": 7, "queue_size": 0}
    client.close()


def test_status_env_needs_a_registered_env(api: httpx.Client) -> None:
    register(api)
    start(api)
    r = api.request("GET", "/status-env", json={"env_id": 3})
    assert r.status_code == 404 and r.json()["error"]["field"] == "env_id"
    assert api.request("GET", "/status-env", json={"id": 0}).status_code == 422


# --- batching -------------------------------------------------------------------------


@pytest.mark.process
def test_first_batch_forms_every_batch_then_serves_one_per_call(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub_process(trace_server)
    client = hub.client()
    register(client, batch_size=4)
    start(client)
    env = register_env(client)["env_id"]
    posted = [marker(g) for g in (group(2, env) for _ in range(9)) if post(client, g)]
    assert client.get("/status").json() == {"current_step": 0, "queue_size": 9}
    served = [batch_markers(client)]
    # Four batches formed at once: the step jumps by 4, one group stays queued.
    assert client.get("/status").json() == {"current_step": 4, "queue_size": 1}
    client = restart(hub, client)
    assert client.get("/status").json() == {"current_step": 4, "queue_size": 1}
    served += [batch_markers(client) for _ in range(3)]
    assert batch_markers(client) is None
    # Served last-formed first, as atroposlib pops its list; each group once.
    assert served == [posted[6:8], posted[4:6], posted[2:4], posted[0:2]]
    post(client, group(2, env))
    assert client.get("/batch").json()["batch"] is not None
    assert client.get("/status").json() == {"current_step": 5, "queue_size": 0}
    client.close()


def test_weights_and_minimum_allocation(api: httpx.Client) -> None:
    register(api, batch_size=8)
    start(api)
    a = register_env(api, group_size=2, weight=1.0, min_batch_allocation=0.5)["env_id"]
    b = register_env(api, group_size=2, weight=3.0)["env_id"]
    status_a = api.request("GET", "/status-env", json={"env_id": a}).json()
    assert status_a["env_weight"] == 0.25
    assert status_a["unallocated_fraction"] == 0.5
    from_b = [marker(g) for g in (group(2, b) for _ in range(6)) if post(api, g)]
    # env a is owed half of every batch and has nothing queued: no batch.
    assert batch_markers(api) is None
    from_a = [marker(g) for g in (group(2, a) for _ in range(2)) if post(api, g)]
    status_b = api.request("GET", "/status-env", json={"env_id": b}).json()
    assert status_b["self_queue_size"] == 6
    assert status_b["queue_size"] == 6  # b's own groups; a's are a's minimum
    # a's two groups first (its half), then b's oldest two.
    assert batch_markers(api) == from_a + from_b[:2]
    assert batch_markers(api) is None  # a has nothing left for its minimum
    assert api.get("/status").json() == {"current_step": 1, "queue_size": 4}


@pytest.mark.process
def test_a_dead_env_stops_holding_batches_back(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    """atroposlib's envs never call /disconnect-env. An env that was killed while
    owed half of every batch stops counting once silent for env_timeout_seconds: the
    env that replaced it gets its batches; heard from again, it counts again."""
    timeout = 1.5
    hub: HubProcess = start_hub_process(trace_server, atropos={"env_timeout_seconds": timeout})
    client = hub.client()
    register(client, batch_size=4)
    start(client)
    dead = register_env(client, group_size=2, min_batch_allocation=0.5)["env_id"]
    last_words = group(2, dead)
    post(client, last_words)
    # The env dies; the hub restarts too (the ghost is in the database); a new env
    # registers and sends.
    killed_at = time.monotonic()
    client = restart(hub, client)
    new = register_env(client, group_size=2, desired_name="again")["env_id"]
    sent = [marker(g) for g in (group(2, new) for _ in range(2)) if post(client, g)]
    status = client.get("/status-env", params={"env_id": new}).json()
    if time.monotonic() - killed_at < timeout:
        assert status["env_weight"] == 0.5  # the dead env still counts: no batch yet
        assert batch_markers(client) is None
    got = wait_until(lambda: batch_markers(client), timeout + 10,
                     what="a batch after the dead env's timeout")
    assert time.monotonic() - killed_at >= timeout
    # Without the minimum, the queue order: the dead env's group, then the new one's.
    assert got == [marker(last_words), sent[0]]
    status = client.get("/status-env", params={"env_id": new}).json()
    assert status["env_weight"] == 1.0 and status["unallocated_fraction"] == 1.0
    envs = {e["env_id"]: e for e in client.get("/v1/stats").json()["atropos"]["envs"]}
    assert envs[dead]["counting"] is False and envs[new]["counting"] is True
    assert envs[dead]["last_seen"] < envs[new]["last_seen"] <= status["last_seen"]
    # Heard from again (its /status-env), the env counts again under its id: owed
    # half of the batch, with nothing queued, it holds the batch until it sends.
    assert client.get("/status-env", params={"env_id": dead}).json()["env_weight"] == 0.5
    assert client.get("/v1/stats").json()["atropos"]["envs"][dead]["counting"] is True
    assert batch_markers(client) is None
    back = group(2, dead)
    post(client, back)
    assert batch_markers(client) == [marker(back), sent[1]]
    client.close()


def test_mixed_group_sizes_are_buffered_per_env(api: httpx.Client) -> None:
    register(api, batch_size=8)
    start(api)
    env = register_env(api, group_size=2)["env_id"]
    other = register_env(api, group_size=4)["env_id"]
    g1, o1, g2 = group(1, env), group(2, other), group(1, env)
    assert post(api, g1) == {"status": "buffered", "buffer_size": 1}
    assert post(api, o1) == {"status": "buffered", "buffer_size": 2}  # its own buffer
    assert api.get("/status").json()["queue_size"] == 0
    # 1 + 1 = 2: both enter the queue, in arrival order.
    assert post(api, g2) == {"status": "buffered", "buffer_size": 0}
    assert api.get("/status").json()["queue_size"] == 2
    assert api.get("/latest_example").json()["tokens"] == g2["tokens"]
    whole, o2 = group(2, env), group(2, other)
    r = api.post("/scored_data_list", json=[whole, o2])
    assert r.json() == {
        "status": "received",
        "groups_processed": 2,
        "buffered": 1,
        "last_buffer_size": 0,
    }
    assert api.get("/status").json()["queue_size"] == 5
    assert batch_markers(api) == [marker(g) for g in (g1, g2, whole, o1, o2)]


def test_groups_posted_appear_in_stats(api: httpx.Client) -> None:
    def stats() -> dict[str, Any]:
        figures: dict[str, Any] = api.get("/v1/stats").json()["atropos"]
        return figures

    before = stats()["groups_received"]  # /reset_data keeps the count: a lifetime total
    register(api, batch_size=4)
    start(api)
    env = register_env(api, group_size=2)["env_id"]
    for g in (group(2, env), group(2, env), group(1, env)):
        post(api, g)
    now = stats()
    assert now["groups_received"] == before + 3
    assert now["groups_waiting"] == {"buffered": 1, "queued": 2, "batched": 0}
    assert now["queue_bytes"] > 0
    assert now["step"] == api.get("/status").json()["current_step"]
    assert len(batch_markers(api) or []) == 2  # served, then deleted: still received
    served = stats()
    assert served["groups_received"] == before + 3
    assert served["groups_waiting"] == {"buffered": 1, "queued": 0, "batched": 0}
    assert served["step"] == api.get("/status").json()["current_step"] == now["step"] + 1
    assert api.get("/reset_data").status_code == 200
    assert stats()["groups_received"] == before + 3
    assert stats()["groups_waiting"] == {"buffered": 0, "queued": 0, "batched": 0}


def test_inference_logprobs_are_served_as_sent(api: httpx.Client) -> None:
    """None invented: atroposlib's GRPO trainer must see that an env sent none."""
    register(api, batch_size=2)
    start(api)
    without = group(1)
    post(api, without)
    with_logprobs = group(1, inference_logprobs=[[1.0, 1.0, -0.5, -0.25]])
    post(api, with_logprobs)
    served = api.get("/batch").json()["batch"]
    assert served == [_as_served(without), _as_served(with_logprobs)]
    assert served[0]["inference_logprobs"] is None


@pytest.mark.process
def test_missing_logprobs_are_filled_when_asked(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub: HubProcess = start_hub(trace_server, atropos={"fill_missing_logprobs": True})
    with hub.client() as client:
        register(client, batch_size=2)
        start(client)
        sent = group(1, masks=[[-100, -100, 12]], tokens=[[1, 11, 12, 13]])
        post(client, sent)
        with_logprobs = group(1, inference_logprobs=[[1.0, 1.0, -0.5, -0.25]])
        post(client, with_logprobs)
        assert client.get("/latest_example").json()["inference_logprobs"] == [
            [1.0, 1.0, -0.5, -0.25]
        ]
        served = client.get("/batch", headers={"accept-encoding": "identity"}).json()["batch"]
    # Prompt positions (mask -100) get 1.0, the others 0.0, beyond the mask too.
    assert served[0] == _as_served(sent) | {"inference_logprobs": [[1.0, 1.0, 0.0, 0.0]]}
    assert served[1] == _as_served(with_logprobs)


def _as_served(g: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "tokens masks scores advantages ref_logprobs messages generation_params "
        "inference_logprobs overrides group_overrides images env_id distill_token_ids "
        "distill_logprobs"
    ).split()
    return {k: g.get(k) for k in keys} | {"scores": [float(s) for s in g["scores"]]}


def test_latest_example_is_the_group_as_sent(api: httpx.Client) -> None:
    register(api)
    sent = group(2, messages=[[{"role": "user", "content": "hi", "extra": 1}]] * 2, scores=[1, 0])
    post(api, sent)
    assert api.get("/latest_example").json() == _as_served(sent)
    # Like atroposlib, /reset_data keeps the latest example.
    assert api.get("/reset_data").text == "Reset successful"
    assert api.get("/latest_example").json() == _as_served(sent)


# --- the ack lease --------------------------------------------------------------------


def set_lease_deadlines(trace_server: dict[str, Any], deadline: datetime) -> None:
    """The stored deadline of every lease held now, as if the hub's clock had moved:
    a lease runs out (a deadline in the past) without the test waiting for it."""
    db_execute(trace_server, sa.update(ATROPOS_BATCHES)
               .where(ATROPOS_BATCHES.c.state == AtroposBatchState.LEASED)
               .values(lease_expires_at=deadline))


@pytest.mark.process
def test_ack_lease_and_redelivery(start_hub_process: Any, trace_server: dict[str, Any]) -> None:
    hub: HubProcess = start_hub_process(trace_server, atropos={"ack_timeout_seconds": 600})
    client = hub.client()
    register(client, batch_size=2)
    start(client)
    first, second, third = (group(2) for _ in range(3))
    for g in (first, second, third):
        post(client, g)
    leased = client.get("/batch", params={"ack": 1}).json()
    batch_id = leased["batch_id"]
    assert [marker(g) for g in leased["batch"]] == [marker(third)]
    assert client.post("/batch/ack", json={"batch_id": batch_id}).json() == {
        "status": "acked",
        "batch_id": batch_id,
        "duplicate": False,
    }
    assert client.post("/batch/ack", json={"batch_id": batch_id}).json()["duplicate"] is True
    # Lease the next batch, never acknowledge it, and die.
    lost = client.get("/batch", params={"ack": "true"}).json()
    assert [marker(g) for g in lost["batch"]] == [marker(second)]
    client = restart(hub, client)
    set_lease_deadlines(trace_server, utcnow() - timedelta(seconds=1))  # run out
    # Back at the front of the queue: served again before anything else.
    assert batch_markers(client) == [marker(second)]
    r = client.post("/batch/ack", json={"batch_id": lost["batch_id"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_batch"
    late = client.get("/batch", params={"ack": 1}).json()
    set_lease_deadlines(trace_server, utcnow() - timedelta(seconds=1))  # run out
    # Acknowledged after its lease ran out, but before anyone else got it: taken.
    assert client.post("/batch/ack", json={"batch_id": late["batch_id"]}).status_code == 200
    assert batch_markers(client) is None
    assert client.get("/status").json() == {"current_step": 3, "queue_size": 0}
    client.close()


def test_a_backward_clock_step_holds_a_leased_batch_no_longer_than_its_lease(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """A batch leased, then the clock stepped back ten minutes (its stored deadline is ten
    minutes further off than the lease lasts): served again after the lease, not after
    the step."""
    hub = start_hub(trace_server, atropos={"ack_timeout_seconds": 1})
    with hub.client() as client:
        register(client, batch_size=2)
        start(client)
        sent = group(2)
        post(client, sent)
        leased = client.get("/batch", params={"ack": 1}).json()
        assert [marker(g) for g in leased["batch"]] == [marker(sent)]
        set_lease_deadlines(trace_server, utcnow() + timedelta(minutes=10))
        assert batch_markers(client) is None  # still leased
        assert wait_until(lambda: batch_markers(client), timeout=15,
                          what="the batch served again") == [marker(sent)]


# --- limits ---------------------------------------------------------------------------


def test_queue_bound_answers_503_with_retry_after(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    limits = {"queue_max_groups": 3, "queue_max_bytes": 5000, "retry_after_seconds": 7}
    hub: InProcessHub = start_hub(trace_server, atropos=limits)
    client = hub.client()
    register(client, batch_size=2)
    start(client)
    for _ in range(3):
        post(client, group(1))
    r = client.post("/scored_data", json=group(1))
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "queue_full"
    assert "queue_max_groups is 3" in r.json()["error"]["message"]
    client.get("/batch")  # takes two groups
    # A list that does not fit is refused whole.
    r = client.post("/scored_data_list", json=[group(1), group(1), group(1)])
    assert r.status_code == 503
    assert client.get("/status").json()["queue_size"] == 1
    # Fits an empty queue, not beside the group waiting: retry later.
    big = group(1, messages=[[{"role": "user", "content": "x" * 4600}]])
    r = client.post("/scored_data", json=big)
    assert r.status_code == 503 and "queue_max_bytes is 5000" in r.json()["error"]["message"]
    # Would not fit an empty queue: no retry can help (it was a 503 forever).
    bigger = group(1, messages=[[{"role": "user", "content": "x" * 5000}]])
    r = client.post("/scored_data", json=bigger)
    assert r.status_code == 413 and "retry-after" not in r.headers
    assert r.json()["error"]["field"] == "atropos.queue_max_bytes"
    r = client.post("/scored_data_list", json=[group(1)] * 4)
    assert r.status_code == 413 and r.json()["error"]["field"] == "atropos.queue_max_groups"
    assert client.post("/scored_data_list", json=[group(1)]).status_code == 200
    client.close()


def test_gzip_in_and_out(api: httpx.Client) -> None:
    register(api, batch_size=2)
    big = group(1, messages=[[{"role": "user", "content": "y" * 3000}]])
    r = api.post(
        "/scored_data",
        content=gzip.compress(json.dumps(big).encode()),
        headers={"content-encoding": "gzip", "content-type": "application/json"},
    )
    assert r.json() == {"status": "received"}
    r = api.post("/scored_data", content=b"not gzip",
                 headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_gzip"
    r = api.get("/latest_example", headers={"accept-encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip" and r.json()["tokens"] == big["tokens"]
    assert "accept-encoding" in r.headers["vary"].lower()
    r = api.get("/latest_example", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in r.headers
    r = api.get("/info", headers={"accept-encoding": "gzip"})  # under 1000 bytes
    assert "content-encoding" not in r.headers
    # A batch is spliced from the stored groups into one gzip stream: the same JSON.
    start(api)
    small = group(1)
    post(api, small)
    with api.stream("GET", "/batch", params={"ack": 1}, headers={"accept-encoding": "gzip"}) as r:
        assert r.headers["content-encoding"] == "gzip"
        leased = json.loads(gzip.decompress(b"".join(r.iter_raw())))
    assert leased["batch"] == [_as_served(big), _as_served(small)]
    assert len(leased["batch_id"]) == 32
    r = api.get("/latest_example", headers={"accept-encoding": "identity"})
    assert r.json() == _as_served(small)


def test_bad_input_gets_4xx(api: httpx.Client) -> None:
    r = api.post("/scored_data", json={"tokens": [[1]], "masks": [[1]]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "scores"
    r = api.post("/scored_data", json={**group(1), "messages": [[{"role": "user"}]]})
    assert r.status_code == 422
    assert api.post("/register", json={**TRAINER, "batch_size": 0}).status_code == 422
    assert api.post("/register", json={**TRAINER, "num_steps": 2**40}).status_code == 422
    r = api.post(
        "/register-env",
        json={"max_token_length": 1, "desired_name": "a\x00", "weight": 1, "group_size": 1},
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "desired_name"
    assert api.post("/scored_data", content=b"{",
                    headers={"content-type": "application/json"}).status_code == 422


def test_nan_and_infinity_are_refused(api: httpx.Client) -> None:
    """They are not JSON; stored, they were served back as null."""
    register(api, batch_size=1)
    json_body = {"content-type": "application/json"}
    for number in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        body = b'{"tokens": [[1]], "masks": [[1]], "scores": [' + number + b"]}"
        r = api.post("/scored_data", content=body, headers=json_body)
        assert r.status_code == 422 and r.json()["error"]["field"] == "scores.0", number
        r = api.post("/scored_data_list", content=b"[" + body + b"]", headers=json_body)
        assert r.status_code == 422 and r.json()["error"]["field"] == "0.scores.0", number
        advantages = body[:-1] + b', "advantages": [[' + number + b"]]}"
        r = api.post("/scored_data", content=advantages.replace(number + b"]", b"1]", 1),
                     headers=json_body)
        assert r.status_code == 422 and r.json()["error"]["field"] == "advantages.0.0", number
    # Where a group takes any JSON (messages, overrides), too.
    for field in (b'"messages": [[{"role": "user", "content": NaN}]]',
                  b'"overrides": [{"weights": [1.0, {"x": -Infinity}]}]',
                  b'"group_overrides": {"temperature": 1e400}'):
        body = b'{"tokens": [[1]], "masks": [[1]], "scores": [1], ' + field + b"}"
        r = api.post("/scored_data", content=body, headers=json_body)
        assert r.status_code == 422 and "NaN" in r.json()["error"]["message"], field
    assert api.get("/latest_example").json()["scores"] != [None]


def test_with_auth_on_reset_takes_an_admin_key_and_the_rest_stays_open(
    tmp_path: Path,
) -> None:
    """atroposlib clients send no key: with auth.enabled and atropos.require_key turned
    off, only /reset_data, the one path that destroys, asks for one, an API key with the
    admin scope like /v1/runs."""
    trace_server = {"db_path": str(tmp_path / "hub.db")}
    hub = InProcessHub(write_config(tmp_path, trace_server, auth={"enabled": True},
                                    atropos={"require_key": False})).start()
    ingest_key = make_api_key(trace_server, "ingest")
    admin_key = make_api_key(trace_server, "admin")
    try:
        with hub.client() as client:
            register(client)
            assert client.get("/info").json()["batch_size"] == 8
            assert client.get("/reset_data").status_code == 401
            r = client.get("/reset_data", headers={"Authorization": f"Bearer {ingest_key}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
            assert client.get("/info").json()["batch_size"] == 8
            r = client.get("/reset_data", headers={"Authorization": f"Bearer {admin_key}"})
            assert r.status_code == 200 and r.text == "Reset successful"
            assert client.get("/info").json()["batch_size"] == -1
            reset = client.get("/openapi.json").json()["paths"]["/reset_data"]["get"]
            assert {"401", "403"} <= set(reset["responses"])
        # Open by choice, and said so once at start-up.
        assert "atropos.require_key is off" in hub.log
    finally:
        hub.stop()


@pytest.mark.process
def test_with_require_key_envs_need_ingest_and_trainers_train(tmp_path: Path) -> None:
    """With auth on, anyone who reached the port could inject groups, take batches
    (which removes them) or read /latest_example. atropos.require_key
    closes every path but / to requests without a key of the right scope."""
    trace_server = {"db_path": str(tmp_path / "hub.db")}
    config = write_config(tmp_path, trace_server, auth={"enabled": True},
                          atropos={"require_key": True})
    hub = HubProcess(config).start()
    keys = {scope: make_api_key(trace_server, scope, name=scope)
            for scope in ("ingest", "train", "read", "admin")}
    env, trainer, reader, admin = ({"Authorization": f"Bearer {keys[s]}"}
                                   for s in ("ingest", "train", "read", "admin"))
    try:
        with hub.client() as client:
            # No key: 401 everywhere, before anything is read or changed.
            for method, path in [("POST", "/register"), ("GET", "/batch"),
                                 ("GET", "/latest_example"), ("POST", "/register-env"),
                                 ("POST", "/scored_data"), ("POST", "/scored_data_list"),
                                 ("GET", "/status"), ("GET", "/info"), ("GET", "/wandb_info"),
                                 ("GET", "/status-env"), ("POST", "/disconnect-env"),
                                 ("POST", "/batch/ack"), ("GET", "/reset_data")]:
                r = client.request(method, path, json={})
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["field"] == "Authorization"
            assert client.get("/").status_code == 200

            # The trainer's paths take a train key, not an environment's.
            r = client.post("/register", json=TRAINER, headers=env)
            assert r.status_code == 403 and "needs train" in r.json()["error"]["message"]
            assert client.post("/register", json=TRAINER, headers=trainer).status_code == 200
            assert client.get("/batch", headers=env).status_code == 403
            assert client.get("/batch", headers=trainer).status_code == 200

            # The environments' paths take an ingest key, not a trainer's.
            body = {"max_token_length": 512, "desired_name": "env", "weight": 1.0,
                    "group_size": 2}
            assert client.post("/register-env", json=body, headers=trainer).status_code == 403
            env_id = client.post("/register-env", json=body, headers=env).json()["env_id"]
            g = group(2, env_id)
            assert client.post("/scored_data", json=g, headers=trainer).status_code == 403
            assert client.post("/scored_data", json=g, headers=env).status_code == 200
            assert client.get("/latest_example", headers=env).status_code == 403
            latest = client.get("/latest_example", headers=trainer).json()
            assert marker(latest) == marker(g)

            # What both sides read: any key, a read key too.
            for headers in (env, trainer, reader):
                assert client.get("/status", headers=headers).json()["queue_size"] == 1
                assert client.get("/info", headers=headers).json()["batch_size"] == 8

            # Destroying stays admin's.
            assert client.get("/reset_data", headers=trainer).status_code == 403
            assert client.get("/reset_data", headers=admin).text == "Reset successful"
            doc = client.get("/openapi.json").json()["paths"]
            assert doc["/scored_data"]["post"]["security"] == [{"bearerAuth": ["ingest"]}]
        assert "atropos.require_key is off" not in hub.log
    finally:
        hub.kill()


@pytest.mark.process
def test_require_key_without_auth_stops_start_up(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "hub.db")},
                          atropos={"require_key": True})
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "atropos.require_key: needs auth.enabled: true" in result.stderr


def test_the_queue_is_bounded_in_bytes_by_default() -> None:
    """0.3 MB of gzip became 320 MB on disk with the byte bound off by default."""
    from app.config import AtroposConfig

    assert AtroposConfig().queue_max_bytes == 2 * 1024**3


# --- durability and concurrency under load ---------------------------------------------


@pytest.mark.process
@pytest.mark.soak
def test_kill_9_under_load_loses_no_group_and_acks_each_once(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    """Envs post and a trainer takes leased batches while the hub is killed -9 and
    restarted: every group the hub acknowledged is delivered, each is acknowledged
    exactly once, and a group is delivered again only if its ack never arrived."""
    hub: HubProcess = start_hub_process(trace_server, atropos={"ack_timeout_seconds": 1})
    with hub.client() as client:
        register(client, batch_size=2)  # any group stored, acknowledged or not, is a batch
        start(client)
        env = register_env(client, group_size=2)["env_id"]
    posted: list[int] = []
    # (groups, ack answer): True = 200, False = refused, None = no answer (the hub died
    # while acknowledging: the ack may or may not have been committed).
    deliveries: list[tuple[list[int], bool | None]] = []
    stop_posting = threading.Event()
    stop_training = threading.Event()

    def call(c: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        try:
            return c.request(method, hub.url + path, **kwargs)  # the url changes on restart
        except httpx.TransportError:
            time.sleep(0.05)  # the hub is down or restarting
            return None

    def env_worker() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop_posting.is_set():
                g = group(2, env)
                r = call(c, "POST", "/scored_data", json=g)
                if r is not None and r.status_code == 200:
                    posted.append(marker(g))

    def trainer() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop_training.is_set():
                r = call(c, "GET", "/batch", params={"ack": 1})
                if r is None or r.json()["batch"] is None:
                    stop_training.wait(0.02)  # a trainer polling an empty queue
                    continue
                leased = r.json()
                got = [marker(g) for g in leased["batch"]]
                ack = call(c, "POST", "/batch/ack", json={"batch_id": leased["batch_id"]})
                deliveries.append((got, None if ack is None else ack.status_code == 200))

    workers = [threading.Thread(target=env_worker) for _ in range(3)]
    trainers = [threading.Thread(target=trainer) for _ in range(2)]
    for t in workers + trainers:
        t.start()
    wait_until(lambda: len(posted) >= 60, 60, what="60 groups posted", poll=0.01)
    hub.kill()
    hub.start()
    wait_until(lambda: len(posted) >= 120, 60, what="120 groups posted", poll=0.01)
    stop_posting.set()
    for t in workers:
        t.join()

    def settled() -> bool:
        """Every posted group acknowledged; or else, with none waiting to be served
        (nothing more will be), each in a batch whose ack got no answer."""
        if set(posted) <= {m for got, ok in deliveries if ok for m in got}:
            return True
        waiting = db_execute(trace_server, sa.select(sa.func.count()).select_from(GROUPS)
                             .where(GROUPS.c.state.in_(WAITING)))[0]
        delivered = {m for got, ok in deliveries if ok is not False for m in got}
        return not next(iter(waiting.values())) and set(posted) <= delivered

    wait_until(settled, 20, what="every posted group delivered", poll=0.2)
    stop_training.set()
    for t in trainers:
        t.join()
    acked = Counter(m for got, ok in deliveries if ok for m in got)
    maybe_acked = {m for got, ok in deliveries if ok is None for m in got}
    assert set(posted) - set(acked) - maybe_acked == set(), "acknowledged groups never delivered"
    assert [m for m, n in acked.items() if n > 1] == [], "groups acknowledged twice"
    delivered = Counter(m for got, _ in deliveries for m in got)
    unacked = {m for got, ok in deliveries if ok is not True for m in got}
    assert all(n == 1 or m in unacked for m, n in delivered.items())


@pytest.mark.process
@pytest.mark.soak
def test_two_hubs_on_one_database_serve_each_group_once(
    start_hub_process: Any, trace_server: dict[str, Any]
) -> None:
    hubs: list[HubProcess] = [start_hub_process(trace_server), start_hub_process(trace_server)]
    with hubs[0].client() as client:
        register(client, batch_size=4)
        start(client)
    with hubs[1].client() as client:
        env = register_env(client, group_size=2)["env_id"]
    posted: list[int] = []
    served: list[int] = []
    done = threading.Event()

    def env_worker(hub: HubProcess) -> None:
        with hub.client() as c:
            for _ in range(40):
                g = group(2, env)
                assert c.post("/scored_data", json=g).status_code == 200
                posted.append(marker(g))

    def trainer(hub: HubProcess) -> None:
        deadline = time.monotonic() + 120
        with hub.client() as c:
            while not done.is_set() or c.get("/status").json()["queue_size"]:
                assert time.monotonic() < deadline, "the queue never drained"
                r = c.get("/batch")
                assert r.status_code == 200, r.text
                batch = r.json()["batch"]
                if batch is None:
                    time.sleep(0.01)
                else:
                    served.extend(marker(g) for g in batch)

    workers = [threading.Thread(target=env_worker, args=(h,)) for h in hubs]
    trainers = [threading.Thread(target=trainer, args=(h,)) for h in hubs * 2]
    for t in workers + trainers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    for t in trainers:
        t.join()
    with hubs[0].client() as client:
        while (batch := batch_markers(client)) is not None:
            served.extend(batch)
        assert client.get("/status").json()["current_step"] == 40
    assert sorted(served) == sorted(posted)


def test_a_web_page_cannot_drive_the_atropos_api(start_hub: Any, trace_server: dict[str, Any]
                                                 ) -> None:
    """Any web page can make its visitor's browser POST text/plain or a form to any
    port, with no CORS preflight: a cross-site page queued a group so. The POSTs take
    application/json only (what atroposlib sends), 415 otherwise, nothing stored."""
    hub = start_hub(trace_server, listen=True)
    with hub.client() as client:
        register(client)
        start(client)
        env_id = register_env(client)["env_id"]
        g = group(2, env_id)
        # What <form method=post enctype=...> and fetch(..., {mode: "no-cors"}) send.
        for media in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": media} if media else {}
            for path, body in (("/scored_data", g), ("/scored_data_list", [g]),
                               ("/register", TRAINER), ("/batch/ack", {"batch_id": "b"}),
                               ("/disconnect-env", {"env_id": env_id})):
                r = client.post(path, content=json.dumps(body).encode(), headers=headers)
                assert r.status_code == 415, (path, media, r.text)
                assert r.json()["error"]["field"] == "Content-Type"
        assert client.get("/status").json()["queue_size"] == 0
        # atroposlib's own way (application/json, gzip from 1 KB) is taken.
        r = client.post("/scored_data", content=gzip.compress(json.dumps(g).encode()),
                        headers={"Content-Type": "application/json; charset=utf-8",
                                 "Content-Encoding": "gzip"})
        assert r.status_code == 200, r.text
        assert client.get("/status").json()["queue_size"] == 1


def test_with_auth_on_the_atropos_api_takes_keys_by_default(
    start_hub: Any, trace_server: dict[str, Any]
) -> None:
    """GET /batch changes state (upstream's design): an <img src=.../batch> on any page
    consumed two batches. With auth.enabled, atropos.require_key is on unless turned
    off, so a request without a key takes nothing."""
    hub = start_hub(trace_server, listen=True, auth={"enabled": True})
    trainer = {"Authorization": f"Bearer {make_api_key(trace_server, 'train')}"}
    with hub.client() as client:
        assert client.post("/register", json=TRAINER).status_code == 401
        assert client.post("/register", json=TRAINER, headers=trainer).status_code == 200
        # What a browser sends for an <img>: no key.
        r = client.get("/batch", headers={"Accept": "image/avif,image/webp,*/*"})
        assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization"
        assert client.get("/batch", headers=trainer).status_code == 200
    assert "atropos.require_key is off" not in hub.log
