"""The hub's own OpenAPI document, fuzzed against a live hub with schemathesis: no
request it describes may get a 5xx or an answer the document does not declare
(status, content type, body schema, headers). Bounded to seconds: a few dozen
examples per operation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.formats.otlp import wire
from tests.support.builders import native_trace
from tests.support.databases import make_api_key
from tests.support.hubs import InProcessHub, write_config
from tests.support.otlp import document, trace_id, weather_run

# uvicorn's own answer to bytes that do not parse as HTTP (a header value schemathesis
# made up, e.g. `content-length: y`): the server's, before any route, which no
# operation of the document describes.
_NOT_HTTP = "Invalid HTTP request received."


@schemathesis.check
def documented_status(ctx: Any, response: Any, case: Any) -> bool | None:
    """status_code_conformance, but for the HTTP server's refusal of what is not HTTP."""
    if response.status_code == 400 and response.text == _NOT_HTTP:
        return None
    result: bool | None = status_code_conformance(ctx, response, case)
    return result


CHECKS = [
    not_a_server_error,
    documented_status,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessHub, str]]:
    """A hub with auth on and small limits (so the limit answers are reached too), with
    a few traces stored, and an admin key; served by uvicorn, as schemathesis reads the
    document from a URL."""
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    trace_server = {"storage_backend": "sqlite", "db_path": str(tmp / "traces.db")}
    limits = {"max_body_bytes": 20_000, "max_traces_per_request": 5, "max_json_depth": 10}
    hub = InProcessHub(write_config(tmp, trace_server, auth={"enabled": True}, limits=limits),
                       listen=True)
    hub.start()
    key = make_api_key(trace_server, "admin")
    with hub.client(headers={"Authorization": f"Bearer {key}"}) as client:
        for i in range(3):
            assert client.post("/v1/traces", json=native_trace(trace_id=f"f-{i}")).status_code == 202
    yield hub, key
    hub.stop()


@pytest.fixture(scope="module")
def hub_schema(fuzzed: tuple[InProcessHub, str]) -> Any:
    return schemathesis.openapi.from_url(fuzzed[0].url + "/openapi.json")


def fuzz(hub_schema: Any, mode: GenerationMode, max_examples: int,
         headers: dict[str, str] | None = None) -> list[str]:
    """Every operation of the document, `max_examples` requests each; returns the
    operations run. (schemathesis' pytest plugin is not used: its lazy fixture
    loader does not run under pytest 9.)"""
    labels = []
    for result in hub_schema.get_all_operations():
        operation = result.ok()
        inputs = len(operation.path_parameters) + len(operation.query) + len(operation.body)
        if mode is GenerationMode.NEGATIVE and not inputs:
            continue  # nothing to get wrong
        labels.append(operation.label)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(FUZZ, max_examples=max_examples)
        def run(case: Any) -> None:
            case.call_and_validate(headers=headers, checks=CHECKS)

        run()
    return labels


@pytest.mark.soak
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_with_a_key(hub_schema: Any, fuzzed: tuple[InProcessHub, str], mode: GenerationMode) -> None:
    ran = fuzz(hub_schema, mode, 25, {"Authorization": f"Bearer {fuzzed[1]}"})
    assert {"POST /v1/traces", "GET /v1/traces", "GET /v1/traces/{trace_id}"} <= set(ran)


def test_without_a_key(hub_schema: Any) -> None:
    fuzz(hub_schema, GenerationMode.POSITIVE, 5)


def test_the_document_declares_the_error_shape(fuzzed: tuple[InProcessHub, str]) -> None:
    with fuzzed[0].client() as client:
        doc = client.get("/openapi.json").json()
    assert doc["components"]["schemas"]["Error"]["required"] == ["error"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    # /readyz's 503 is the probe's answer (status, reason), not an error.
                    shape = "NotReady" if (method, path) == ("get", "/readyz") else "Error"
                    assert ref == f"#/components/schemas/{shape}", (method, path, status)


def test_the_document_declares_every_success_body(fuzzed: tuple[InProcessHub, str]) -> None:
    with fuzzed[0].client() as client:
        doc = client.get("/openapi.json").json()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            successes = {s: r for s, r in operation["responses"].items() if s.startswith("2")}
            assert successes, (method, path)
            for status, response in successes.items():
                for media, content in response["content"].items():
                    assert content["schema"], (method, path, status, media)
    ingest = doc["paths"]["/v1/traces"]["post"]["responses"]
    assert ingest["202"]["content"]["application/json"]["schema"]["$ref"].endswith("/IngestResult")
    assert ingest["207"]["content"]["application/json"]["schema"]["$ref"].endswith("/IngestResults")


def test_success_bodies_conform_to_the_document(
    hub_schema: Any, fuzzed: tuple[InProcessHub, str]
) -> None:
    """What random requests rarely reach, each answer checked against the document: a
    rejected trace, a batch with a bad item, every view of a trace, and a whole Atropos
    session (a buffered group, a leased batch and its ack). The ingest and Atropos
    routes render their JSON themselves, so only this and the fuzzing check them."""
    hub, key = fuzzed
    answered: list[str] = []

    def conforms(response: httpx.Response) -> None:
        response.read()
        request = response.request
        operation = hub_schema.find_operation_by_path(request.method, request.url.path)
        assert operation is not None, request.url
        operation.validate_response(response)
        answered.append(f"{operation.label} {response.status_code}")

    hooks = {"response": [conforms]}
    with hub.client(headers={"Authorization": f"Bearer {key}"}, event_hooks=hooks) as client:
        assert client.get("/reset_data").status_code == 200
        thought = {"type": "thought", "content": "Look again."}
        rejected = native_trace(trace_id="doc-rejected", steps=[thought] * 3)
        assert client.post("/v1/traces", json=rejected).json()["reject_reasons"]
        batch = {"traces": [native_trace(trace_id="doc-1"), {"steps": "not a list"}]}
        assert client.post("/v1/traces", json=batch).status_code == 207
        spans = document(weather_run(trace_id()))
        assert client.post("/v1/traces", json=spans).status_code == 200  # OTLP/JSON
        protobuf = {"Content-Type": "application/x-protobuf"}
        request = wire.from_json(spans)[0].SerializeToString()
        assert client.post("/v1/traces", content=request, headers=protobuf).status_code == 200
        assert client.post("/v1/traces", content=b"\xff", headers=protobuf).status_code == 400
        assert client.get("/v1/traces", params={"limit": 2}).json()["next_cursor"]
        for view in ("canonical", "original"):
            client.get("/v1/traces/doc-rejected", params={"view": view}).raise_for_status()
        client.get("/v1/stats").raise_for_status()
        client.get("/v1/batches").raise_for_status()

        client.get("/").raise_for_status()
        trainer = {"wandb_group": "g", "wandb_project": "p", "batch_size": 2,
                   "max_token_len": 64, "checkpoint_dir": "/tmp/ckpt",
                   "save_checkpoint_interval": 5, "starting_step": 0, "num_steps": 10}
        client.post("/register", json=trainer).raise_for_status()
        env = {"max_token_length": 64, "desired_name": "doc", "weight": 1.0, "group_size": 2}
        waiting = client.post("/register-env", json=env).json()
        assert waiting == {"status": "wait for trainer to start"}
        assert client.get("/batch").json() == {"batch": None}
        env_id = client.post("/register-env", json=env).json()["env_id"]
        client.get("/latest_example").raise_for_status()  # none yet: every list empty

        def group(size: int) -> dict[str, Any]:
            return {"tokens": [[1, 2]] * size, "masks": [[-100, 2]] * size,
                    "scores": [1.0] * size, "env_id": env_id}

        assert client.post("/scored_data", json=group(1)).json()["status"] == "buffered"
        assert client.post("/scored_data", json=group(2)).json()["status"] == "received"
        client.post("/scored_data_list", json=[group(2), group(1)]).raise_for_status()
        client.get("/status").raise_for_status()
        client.get("/status-env", params={"env_id": env_id}).raise_for_status()
        client.get("/info").raise_for_status()
        client.get("/wandb_info").raise_for_status()
        client.get("/latest_example").raise_for_status()
        leased = client.get("/batch", params={"ack": True}).json()
        assert leased["batch"] and leased["batch_id"]
        client.post("/batch/ack", json={"batch_id": leased["batch_id"]}).raise_for_status()
        assert client.get("/batch").json()["batch"]
        client.post("/disconnect-env", json={"env_id": env_id}).raise_for_status()
        client.post("/disconnect-env", json={"env_id": 10**6}).raise_for_status()
        client.get("/reset_data").raise_for_status()
        assert client.get("/batch").json()["status"] == "error"  # not registered
    assert {"POST /v1/traces 202", "POST /v1/traces 207", "POST /v1/traces 200",
            "POST /v1/traces 400", "GET /batch 200"} <= set(answered)
