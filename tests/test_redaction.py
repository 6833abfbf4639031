"""Secrets never at rest: what agents print into trajectories (env dumps, config files,
curl commands) is replaced with [REDACTED:<kind>] before anything is stored, on every
ingest path; the database file, its WAL, exports and batch files are searched for the
secrets byte by byte."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from app.config import PrivacyConfig
from app.evaluation.redaction import Redactor
from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.otlp import (
    PROTOBUF,
    attributes,
    document,
    protobuf,
    trace_id,
    weather_run,
)
from tests.support.processes import run_cli
from tests.support.waiting import wait_until

# Fakes shaped like the real thing; each is searched for in every file the hub writes.
PRIVATE_KEY_BODY = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun"
SECRETS = {
    "openai_api_key": "sk-proj-Fake0penAIkey1234567890abcdefGHIJ",
    "anthropic_api_key": "sk-ant-api03-FakeAnthropic1234567890abcdefXYZ",
    "google_api_key": "AIzaSyFake1234567890abcdefghijklmnopqrs",
    "aws_access_key_id": "AKIAFAKE0123456789AB",
    "aws_secret_access_key": "wJalrXUtnFEMIfakeK7MDENGbPxRfiCY01234567",
    "github_token": "ghp_Fake0123456789abcdefghijklmnopqrstuv",
    "slack_token": "xoxb-123456789012-FakeSlackToken0123",
    "huggingface_token": "hf_FakeHuggingFace0123456789abcdefghij",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJmYWtlLXVzZXItMTIzIn0.FakeSignature0123456789abcdef",
    "bearer_token": "FakeBearerOpaque0123456789xyz",
    "url_password": "FakeUrlPassw0rd42",
    "private_key": PRIVATE_KEY_BODY,
}
ENV_DUMP = (
    "$ env\n"
    f"OPENAI_API_KEY={SECRETS['openai_api_key']}\n"
    f"ANTHROPIC_API_KEY={SECRETS['anthropic_api_key']}\n"
    f"GOOGLE_API_KEY={SECRETS['google_api_key']}\n"
    f"AWS_ACCESS_KEY_ID={SECRETS['aws_access_key_id']}\n"
    f"AWS_SECRET_ACCESS_KEY={SECRETS['aws_secret_access_key']}\n"
    f"GITHUB_TOKEN={SECRETS['github_token']}\n"
    f"SLACK_BOT_TOKEN={SECRETS['slack_token']}\n"
    f"HF_TOKEN={SECRETS['huggingface_token']}\n"
    f"SESSION={SECRETS['jwt']}\n"
    f"$ curl -H 'Authorization: Bearer {SECRETS['bearer_token']}' "
    f"https://admin:{SECRETS['url_password']}@db.internal.example/q\n"
    "$ cat ~/.ssh/id_rsa\n-----BEGIN RSA PRIVATE KEY-----\n"
    f"{PRIVATE_KEY_BODY}\nVTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n"
    "-----END RSA PRIVATE KEY-----\n"
)
ALL_KINDS = {kind: 1 for kind in SECRETS}


def leaked(paths: list[Path], secrets: dict[str, str] = SECRETS) -> dict[str, list[str]]:
    """Each file under `paths` that holds a secret's bytes, and which."""
    found: dict[str, list[str]] = {}
    for root in paths:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            hits = [kind for kind, secret in secrets.items() if secret.encode() in data]
            if hits:
                found[str(path)] = hits
    return found


# --- the detector ----------------------------------------------------------------------


def test_every_kind_is_replaced_by_its_marker_and_counted() -> None:
    redactor = Redactor(PrivacyConfig())
    text, counts = redactor.redact_text(ENV_DUMP)
    assert counts == ALL_KINDS
    assert not [kind for kind, secret in SECRETS.items() if secret in text]
    assert "OPENAI_API_KEY=[REDACTED:openai_api_key]\n" in text
    # The context stays: who was asked, with what header, at which host.
    assert "Authorization: Bearer [REDACTED:bearer_token]'" in text
    assert "https://admin:[REDACTED:url_password]@db.internal.example/q" in text
    assert "$ cat ~/.ssh/id_rsa\n[REDACTED:private_key]\n" in text


@pytest.mark.parametrize(
    "text",
    [
        "the task-force reviewed disk-usage-monitoring-service-config",
        "bearer tokens expire; see https://example.com/docs@v2",
        "mailto: bob@example.com is kept unless privacy.redact_emails",
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "AKIA is a prefix; hf_ too; sk-short",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert Redactor(PrivacyConfig()).redact_text(text) == (text, {})


def test_secrets_in_keys_values_and_nested_json_strings() -> None:
    redactor = Redactor(PrivacyConfig())
    item = {
        "metadata": {"AWS_SECRET_ACCESS_KEY": SECRETS["aws_secret_access_key"],
                     SECRETS["github_token"]: "a token as a key"},
        # A tool's arguments as JSON text inside JSON: escapes around the secret.
        "arguments": json.dumps({"cmd": f"export\tOPENAI_API_KEY=\n{SECRETS['openai_api_key']}"}),
    }
    out, counts = redactor.redact(item)
    assert counts == {"aws_secret_access_key": 1, "github_token": 1, "openai_api_key": 1}
    assert not leaked_in(out)
    assert json.loads(out["arguments"])["cmd"].endswith("\n[REDACTED:openai_api_key]")


def leaked_in(value: Any) -> list[str]:
    text = json.dumps(value)
    return [kind for kind, secret in SECRETS.items() if secret in text]


def test_emails_and_extra_patterns_by_config() -> None:
    config = PrivacyConfig(redact_emails=True, extra_patterns=[r"\bACME-[0-9]{6}\b"])
    redactor = pickle.loads(pickle.dumps(Redactor(config)))  # as the ingest processes get it
    text, counts = redactor.redact_text("mail bob@example.com about ACME-123456")
    assert text == "mail [REDACTED:email] about [REDACTED:custom]"
    assert counts == {"email": 1, "custom": 1}


def test_everything_off_stores_as_sent() -> None:
    redactor = Redactor(PrivacyConfig(redact_secrets=False))
    assert redactor.redact({"x": ENV_DUMP}) == ({"x": ENV_DUMP}, {})


@pytest.mark.process
@pytest.mark.parametrize("pattern", ["(unclosed", "a(?=b)", ""])
def test_a_bad_extra_pattern_is_a_one_line_config_error(tmp_path: Path, pattern: str) -> None:
    config = write_config(tmp_path, {"db_path": str(tmp_path / "t.db")},
                          privacy={"extra_patterns": ["ok-[0-9]+", pattern]})
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "privacy.extra_patterns.1" in line


# --- every ingest path, and every file the hub writes ----------------------------------


def _items() -> dict[str, dict[str, Any]]:
    return {
        "native": native_trace(steps=[
            {"type": "action", "tool": "terminal", "call_id": "c1",
             "arguments": {"command": "env", "token": SECRETS["github_token"]}},
            {"type": "observation", "call_id": "c1", "content": ENV_DUMP},
            {"type": "final", "content": "Printed the environment."},
        ]),
        "openai": {"messages": [
            {"role": "user", "content": f"Use this key: {SECRETS['openai_api_key']}"},
            {"role": "assistant", "content": f"Running it.\n{ENV_DUMP}"},
        ]},
        "sharegpt": {"conversations": [
            {"from": "human", "value": "Print the config."},
            {"from": "gpt", "value": ENV_DUMP},
        ]},
        "atif": {
            "schema_version": "ATIF-v1.4", "session_id": "s-redaction",
            "agent": {"name": "a", "version": "1", "model_name": "m"},
            "steps": [
                {"step_id": 1, "source": "user", "message": "Show the environment."},
                {"step_id": 2, "source": "agent", "message": ENV_DUMP},
            ],
        },
    }


def _group() -> dict[str, Any]:
    return {
        "tokens": [[1, 2, 3], [1, 2, 4]], "masks": [[-100, 2, 3], [-100, 2, 4]],
        "scores": [1.0, 0.0],
        "messages": [[{"role": "user", "content": "env?"},
                      {"role": "assistant", "content": ENV_DUMP}]] * 2,
        "group_overrides": {"note": f"Bearer {SECRETS['bearer_token']}"},
    }


def _batching(tmp_path: Path, batch_size: int) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """A SQLite hub's trace_server section, its batch directory and the sections that
    batch every trace there, `batch_size` at a time."""
    trace_server = {"storage_backend": "sqlite", "db_path": str(tmp_path / "traces.db")}
    out = tmp_path / "batches"
    sections: dict[str, Any] = {
        "environment": {"invalid_trace_filters": []},
        "distributor": {"target": "jsonl", "output_dir": str(out), "batch_size": batch_size,
                        "min_reward_threshold": -1000},
    }
    return trace_server, out, sections


@pytest.mark.process
def test_no_path_stores_a_secret(start_hub: Any, tmp_path: Path) -> None:
    trace_server, out, sections = _batching(tmp_path, 5)
    # atropos import of a file, into the database.
    source = tmp_path / "agent-run.jsonl"
    source.write_text(json.dumps({"messages": [
        {"role": "user", "content": "What is in .env?"},
        {"role": "assistant", "content": ENV_DUMP}]}) + "\n")
    config = write_config(tmp_path, trace_server, **sections)
    imported = run_cli("import", "--config", str(config), str(source))
    assert imported.returncode == 0, imported.stderr
    assert leaked([tmp_path / "traces.db"]) == {}

    hub = start_hub(trace_server, otlp={"quiet_seconds": 0.5}, **sections)
    ids = []
    with hub.client() as client:
        trainer = {"wandb_group": "g", "wandb_project": "p", "batch_size": 2,
                   "max_token_len": 512, "checkpoint_dir": "c", "save_checkpoint_interval": 10,
                   "starting_step": 0, "num_steps": 10}
        assert client.post("/register", json=trainer).status_code == 200
        for fmt, item in _items().items():
            r = client.post("/v1/traces", json=item)
            assert r.status_code == 202, (fmt, r.text)
            ids.append(r.json()["trace_id"])
        assert client.post("/scored_data", json=_group()).status_code == 200
        assert client.post("/scored_data_list", json=[_group()]).status_code == 200
        # OTLP spans: stored as they come (the files are searched below; a span's
        # bytes stay in them after it is deleted), assembled into a trajectory later.
        otlp_id = trace_id()
        spans = weather_run(otlp_id)
        spans[2]["attributes"] += attributes({"process.environ": ENV_DUMP})
        r = client.post("/v1/traces", content=protobuf(document(spans)), headers=PROTOBUF)
        assert r.status_code == 200, r.text
        wait_until(lambda: client.get(f"/v1/traces/{otlp_id}").status_code == 200,
                   what="the OTLP trajectory")
        ids.append(otlp_id)

        for stored_id in ids:
            for view in ("original", "canonical"):
                record = client.get(f"/v1/traces/{stored_id}", params={"view": view})
                assert record.status_code == 200, record.text
                assert not leaked_in(record.json()), (stored_id, view)
            trace = client.get(f"/v1/traces/{stored_id}").json()["trace"]
            assert set(trace["metadata"]["redactions"]) >= set(SECRETS) - {"github_token"}
        redactions = client.get("/v1/stats").json()["redactions"]
        assert set(redactions) == set(SECRETS)
        # One per trace: four formats, the import and the OTLP trajectory.
        assert redactions["private_key"] == 6
        served = client.get("/batch").json()["batch"]  # as a trainer gets the groups
        assert served and "[REDACTED:jwt]" in json.dumps(served) and not leaked_in(served)

    wait_until(lambda: (out / "manifest.jsonl").exists(), what="the batch to be written")
    exported = tmp_path / "export.jsonl"
    done = run_cli("export", "--config", str(config), "--format", "openai", "-o", str(exported))
    assert done.returncode == 0, done.stderr
    assert "[REDACTED:openai_api_key]" in exported.read_text()
    # The database and its WAL while the hub runs, then once it has checkpointed.
    written = [p for p in tmp_path.iterdir() if p.name.startswith("traces.db")]
    assert any(p.name.endswith("-wal") for p in written)
    assert leaked([*written, out, exported]) == {}
    hub.stop()
    assert leaked([p for p in tmp_path.iterdir() if p.name.startswith("traces.db")]) == {}


def test_counts_per_trace_and_in_stats_on_both_databases(client: Any) -> None:
    """The `client` hub runs on SQLite and on PostgreSQL (the stats' JSON query differs)."""
    item = _items()["native"]
    # A client's own metadata.redactions is not the hub's count.
    r = client.post("/v1/traces", json={**item, "metadata": {"redactions": {"jwt": 99}}})
    assert r.status_code == 202, r.text
    record = client.get(f"/v1/traces/{r.json()['trace_id']}").json()
    assert record["trace"]["metadata"]["redactions"] == {**ALL_KINDS, "github_token": 2}
    plain = client.post("/v1/traces", json=native_trace(metadata={"redactions": {"jwt": 99}}))
    assert plain.status_code == 202, plain.text
    assert client.get("/v1/stats").json()["redactions"] == {**ALL_KINDS, "github_token": 2}


# Secrets spelt so that they slipped past: each searched for in every file the hub writes.
SLIPPED = {
    "private_key": "MIIEpAIBAAKCAQEA0FakeKeyCutShort0123456789abcdefghijklmnopqrstuvw",
    "openai_api_key": "sk-proj-FakeEscaped0penAIkey1234567890abcd",
    "github_token": "ghp_FakeEscaped0123456789abcdefghijklmnop",
    "slash_password": "FakeP/ss+word42",
    "at_password": "FakeP@ssword42",
}


def _escaped(secret: str) -> str:
    """The secret as JSON may spell it: its first character as a \\u escape."""
    return f"\\u{ord(secret[0]):04x}{secret[1:]}"


@pytest.mark.process
def test_secrets_spelt_to_slip_past_are_redacted_on_the_way_to_training(
    start_hub: Any, tmp_path: Path
) -> None:
    """A private key cut short inside a Hermes <tool_response> (the tool's JSON output,
    its line breaks escaped), secrets \\u-escaped in JSON tool arguments, URL passwords
    holding `/`, `+` or `@`, and a secret in a span id that does not decode: in no
    file the hub writes (database, batch files, export), nor its log."""
    trace_server, out, sections = _batching(tmp_path, 3)
    key = ("-----BEGIN RSA PRIVATE KEY-----\n" + SLIPPED["private_key"] + "\n"
           + SLIPPED["private_key"][::-1] + "\n")  # `head -3 id_rsa`: no END line
    hermes = {"conversations": [
        {"from": "human", "value": "Show me the deploy key."},
        {"from": "gpt", "value": '<tool_call>\n{"name": "terminal", "arguments": '
                                 '{"command": "head -3 ~/.ssh/id_rsa"}}\n</tool_call>'},
        {"from": "tool", "value": "<tool_response>\n" + json.dumps(
            {"name": "terminal", "content": {"output": key, "exit_code": 0}})
            + "\n</tool_response>"},
        {"from": "gpt", "value": "That is the key."},
    ]}
    arguments = ('{"env": {"OPENAI_API_KEY": "' + _escaped(SLIPPED["openai_api_key"])
                 + '", "token": "' + _escaped(SLIPPED["github_token"]) + '"}}')
    openai = {"messages": [
        {"role": "user", "content": "Deploy."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "deploy", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "deployed"},
        {"role": "assistant", "content": "Done."},
    ]}
    urls = {"messages": [
        {"role": "user", "content": "Which databases?"},
        {"role": "assistant", "content": (
            f"postgresql://app:{SLIPPED['slash_password']}@db.internal/app and "
            f"redis://:{SLIPPED['at_password']}@cache.internal:6379/0")},
    ]}
    hub = start_hub(trace_server, otlp={"quiet_seconds": 0.5}, **sections)
    with hub.client() as client:
        for item in (hermes, openai, urls):
            r = client.post("/v1/traces", json=item)
            assert r.status_code == 202, r.text
            record = client.get(f"/v1/traces/{r.json()['trace_id']}").text
            assert not [k for k, s in SLIPPED.items() if s in record], record
        stray = document(weather_run(trace_id()))
        stray["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["spanId"] = SLIPPED[
            "github_token"]
        r = client.post("/v1/traces", json=stray)
        assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
        assert "[REDACTED:github_token]" in r.json()["partialSuccess"]["errorMessage"]
        hub.wait_for_log("spans rejected")
        assert not [k for k, s in SLIPPED.items() if s in hub.log]
    wait_until(lambda: (out / "manifest.jsonl").exists(), what="the batch to be written")
    exported = tmp_path / "export.jsonl"
    config = write_config(tmp_path, trace_server, **sections)
    done = run_cli("export", "--config", str(config), "--format", "sharegpt", "-o",
                   str(exported))
    assert done.returncode == 0, done.stderr
    assert "[REDACTED:private_key]" in exported.read_text()
    written = [p for p in tmp_path.iterdir() if p.name.startswith("traces.db")]
    assert leaked([*written, out, exported], SLIPPED) == {}


def test_a_secret_shaped_trace_id_is_refused_not_merged_with_another(client: Any) -> None:
    """Redacted, two ids holding different secrets would be one stored id: the second
    trace answered as the first's duplicate (or 409). Each is refused, naming trace_id."""
    for token in (SECRETS["github_token"], SECRETS["github_token"][:-1] + "w"):
        r = client.post("/v1/traces", json={"trace_id": token, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "trace_id"
        assert token not in r.text
    assert client.get("/v1/stats").json()["traces"] == 0
