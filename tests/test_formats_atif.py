"""The Agent Trajectory Interchange Format (app/formats/atif.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app import formats
from app.domain import Status
from app.errors import Invalid
from tests.support.format_examples import (
    ATIF,
    EXAMPLES,
    NATIVE,
    assert_atif,
    kinds,
)

# --- atif ---------------------------------------------------------------------------


def test_atif_maps_steps() -> None:
    trace = formats.parse(ATIF)
    assert trace.trace_id == ATIF["session_id"]
    assert trace.agent.name == "harbor-agent" and trace.agent.model == "gemini-2.5-flash"
    assert trace.task == "What is GOOGL trading at, and on what volume?"
    assert kinds(trace) == ["thought", "action", "action", "observation", "observation", "final"]
    assert trace.steps[1].content == "I will look up price and volume."
    assert trace.steps[4].error == "Error: rate limited"
    assert trace.steps[-1].content == "GOOGL trades at $185.35; volume is unavailable."
    assert trace.metadata["final_metrics"]["total_steps"] == 3
    assert trace.metadata["agent_version"] == "1.0.0"
    assert formats.parse({**ATIF, "trace_id": "mine"}).trace_id == "mine"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"schema_version": "ATIF-v2.0"}, "schema_version"),
        ({"schema_version": 1.4}, "schema_version"),
        ({"steps": [{"step_id": 1, "source": "bot", "message": "x"}]}, "steps[0].source"),
        (
            {"steps": [{"step_id": 1, "source": "agent", "message": "x", "tool_calls": [{}]}]},
            "steps[0].tool_calls[0].function_name",
        ),
        (
            {"steps": [{"step_id": 1, "source": "agent", "message": "", "observation": {}}]},
            "steps[0].observation.results",
        ),
        ({"session_id": 5}, "session_id"),
    ],
)
def test_atif_errors(change: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as err:
        formats.parse({**ATIF, **change})
    assert err.value.field == field




@pytest.mark.parametrize("name", EXAMPLES)
def test_atif_export_has_required_fields(name: str) -> None:
    doc = formats.export(formats.parse(EXAMPLES[name]), "atif")
    assert_atif(doc)
    json.dumps(doc)


def test_atif_export_keeps_what_atif_has_no_field_for() -> None:
    doc = formats.export(formats.parse(NATIVE), "atif")
    assert doc["session_id"] == "native-0001"
    assert doc["extra"]["atropos_hub"]["outcome"] == {"status": "success", "code_runs_ok": True}
    assert doc["extra"]["run"] == "r-17"
    back = formats.parse(doc)
    assert back.outcome.status is Status.SUCCESS and back.tools == ["bash", "edit_file"]
    assert back.env == "swe-lite" and back.metadata["run"] == "r-17"
