"""The hub's own OpenAPI document, fuzzed against a live hub with schemathesis: no
request it describes may get a 5xx or an answer the document does not declare
(status, content type, body schema, headers). Bounded to seconds: a few dozen
examples per operation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

from tests.support.builders import native_trace
from tests.support.databases import make_api_key
from tests.support.hubs import InProcessHub, write_config

CHECKS = [
    not_a_server_error,
    status_code_conformance,
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
                    assert ref == "#/components/schemas/Error", (method, path, status)
