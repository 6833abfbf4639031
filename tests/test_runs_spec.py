"""The run spec's rules and the environment each process starts with."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.config import TinkerConfig
from app.runs.channel import REDACTED, ModelChannel, process_env
from app.runs.spec import RunSpec


def test_a_minimal_spec_gets_the_documented_defaults() -> None:
    spec = RunSpec.model_validate({"trainer": {"command": ["python", "train.py"]}})
    assert (spec.poll_interval, spec.stop_timeout, spec.trainer.start_timeout) == (30, 10, 120)
    assert spec.environments == [] and spec.trainer.health is None
    both = RunSpec.model_validate(
        {"trainer": {"command": ["t"]}, "environments": [{"command": ["a"]}, {"command": ["b"]}]}
    )
    assert [role for role, _ in both.processes()] == ["trainer", "env_0", "env_1"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"trainer": {"command": ["t"], "health": {}}}, "exactly one of"),
        ({"trainer": {"command": ["t"], "health": {"http": "localhost:80"}}}, "should match"),
        ({"trainer": {"command": ["t"], "health": {"tcp": 80}}}, "Extra inputs"),
        ({"trainer": {"command": ["t"], "health": {"alive_seconds": 200}}},
         "alive_seconds (200) must be shorter than start_timeout (120)"),
        ({"trainer": {"command": ["t"]}, "env": {"TINKER_API_KEY": "x"}},
         "TINKER_API_KEY is set by the hub"),
        ({"trainer": {"command": [""]}}, "at least 1 character"),
        ({"trainer": {"command": ["t"]}, "stop_timeout": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_specs_say_what_is_wrong(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunSpec.model_validate(body)


def _channel(**environ: str) -> ModelChannel:
    tinker = TinkerConfig(base_url="https://taotoken.net/api/", api_key_env="MY_KEY")
    return ModelChannel.from_tinker(tinker, environ)


def test_the_trainer_alone_gets_the_model_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "  sk-from-env-123  ")
    channel = _channel(TINKER_API_KEY="tk-123456")
    assert channel.base_url == "https://taotoken.net/api/v1"
    inherited = {
        "PATH": "/bin", "MY_KEY": "sk-from-env-123", "TINKER_API_KEY": "tk-123456",
        "ATROPOS_TRACE_SERVER__DATABASE_URL": "postgresql://u:pw@db/x", "ATROPOS_HOME": "/a",
    }
    common: dict[str, Any] = {
        "spec_env": {"SEED": "1"}, "channel": channel, "hub_url": "http://10.0.0.5:8000",
        "inherited": inherited,
    }
    trainer = process_env("trainer", **common)
    assert trainer == {
        "PATH": "/bin", "ATROPOS_HOME": "/a", "PYTHONUNBUFFERED": "1", "SEED": "1",
        "ATROPOS_HUB_URL": "http://10.0.0.5:8000",
        "OPENAI_BASE_URL": "https://taotoken.net/api/v1", "OPENAI_API_KEY": "sk-from-env-123",
        "TINKER_API_KEY": "tk-123456",
    }
    env = process_env("env_0", **common)
    assert env == {"PATH": "/bin", "ATROPOS_HOME": "/a", "PYTHONUNBUFFERED": "1", "SEED": "1",
                   "ATROPOS_HUB_URL": "http://10.0.0.5:8000"}


def test_without_keys_the_trainer_gets_only_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MY_KEY", raising=False)
    trainer = process_env("trainer", spec_env={}, channel=_channel(), hub_url="http://h",
                          inherited={})
    assert "OPENAI_API_KEY" not in trainer and "TINKER_API_KEY" not in trainer
    assert trainer["OPENAI_BASE_URL"] == "https://taotoken.net/api/v1"


def test_redact_blacks_out_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "sk-from-env-123")
    channel = _channel(TINKER_API_KEY="x")  # too short to redact without ruining the text
    assert channel.redact("key sk-from-env-123 and x") == f"key {REDACTED} and x"
