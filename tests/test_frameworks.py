"""Real agent frameworks, each under its real instrumentation, run against the fake
model server and exporting to a hub process: each run is one trajectory that matches
what the framework sent the model (the fake's request log) and what it answered.

The frameworks' dependencies conflict with the project's, so they live in a venv of
their own (scripts/framework_venv.sh, which .ci/run calls; FRAMEWORK_VENV names it).
Outside CI, a missing venv skips these tests with the command that makes it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.captures import truth
from tests.support.fakes.model_server import FakeModel
from tests.support.otlp import QUIET, trajectory
from tests.support.processes import HubProcess
from tests.test_otlp_frameworks import matches

VENV = Path(os.environ.get("FRAMEWORK_VENV", "/work/venvs/frameworks"))
PYTHON = VENV / "bin" / "python"
AGENT = ROOT / "tests" / "support" / "framework_agent.py"
SETUPS = ["openai-agents-oi", "openai-agents-logfire", "langgraph", "smolagents-toolcalling",
          "smolagents-code", "pydantic-ai"]

pytestmark = [pytest.mark.framework, pytest.mark.process]


@pytest.fixture(scope="session")
def framework_python() -> Path:
    """The venv's python. In CI, scripts/framework_venv.sh makes sure of it (and waits for
    .ci/run's background build when that is still at it); elsewhere a missing venv skips."""
    if os.environ.get("CI"):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "framework_venv.sh")],
                              env={**os.environ, "FRAMEWORK_VENV": str(VENV)},
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"no framework venv at {VENV}:\n{done.stderr[-3000:]}"
    elif not PYTHON.exists():
        pytest.skip(f"no framework venv at {VENV}: bash scripts/framework_venv.sh")
    return PYTHON


def _weather_model(setup: str, answers: list[dict[str, Any]]) -> Any:
    """The scripted model: calls get_weather for Paris, then answers with its result
    (smolagents: through its final_answer tool; a CodeAgent: as code). Each answer is
    also put in `answers`."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        said = _said(body)
        answers.append(said)
        return said

    def _said(body: dict[str, Any]) -> dict[str, Any]:
        calls = len(answers) + 1
        if setup == "smolagents-code":
            return _text('Thought: I will look the weather up.\n<code>\nresult = '
                    'get_weather(city="Paris")\nfinal_answer("FINAL: " + result)\n</code>')
        last = body["messages"][-1]
        text = last.get("content")
        if isinstance(text, list):
            text = "".join(p.get("text", "") for p in text)
        if last["role"] == "tool" or "Observation:" in (text or ""):
            answer = "FINAL: " + (text or "").removeprefix("Observation:\n")
            if setup == "smolagents-toolcalling":
                return _call("final_answer", {"answer": answer}, calls)
            return _text(answer)
        return _call("get_weather", {"city": "Paris"}, calls)

    return reply


def _text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _call(name: str, arguments: dict[str, Any], n: int) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_fake{n:03d}", "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)}}]}


@pytest.fixture
def otlp_process(start_hub_process: Any, trace_server: dict[str, Any]) -> HubProcess:
    hub: HubProcess = start_hub_process(trace_server, otlp=QUIET)
    return hub


# The venv's build, when CI's is still under way, counts in the first test's time.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dialect", ["sqlite"])
@pytest.mark.parametrize("setup", SETUPS)
def test_a_framework_run_is_the_trajectory_its_model_had(
    framework_python: Path, otlp_process: HubProcess, fake_model: FakeModel, model_root: str,
    setup: str,
) -> None:
    answers: list[dict[str, Any]] = []
    fake_model.reply = _weather_model(setup, answers)
    env = {
        "PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"),
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_process.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": f"fw-{setup}",
        "OPENAI_BASE_URL": f"{model_root}/v1",
        "OPENAI_API_KEY": fake_model.key,
        "LOGFIRE_SEND_TO_LOGFIRE": "false",
        "OPENAI_AGENTS_DISABLE_TRACING": "0",
    }
    done = subprocess.run([str(framework_python), str(AGENT), setup], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    tid = done.stdout.strip().splitlines()[-1]
    log = [{"api": "chat", "request": r.body, "response": answer,
            "usage": {"prompt_tokens": 100, "completion_tokens": 20}}
           for r, answer in zip(fake_model.chats(), answers, strict=True)]
    with otlp_process.client() as client:
        try:
            stored = trajectory(client, tid)["trace"]
        except AssertionError as missing:  # say what the hub made of the spans instead
            raise AssertionError(f"{missing}; the hub's OTLP counts: "
                                 f"{client.get('/v1/stats').json()['otlp']}") from None
    matches(stored, truth(log), setup)
