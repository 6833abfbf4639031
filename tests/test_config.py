"""Config files: every bad file stops start-up with one line naming file, key, problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import (
    HttpTargetConfig,
    JsonlTargetConfig,
    RetryPolicy,
    load_compression,
    load_config,
    load_tinker,
)
from app.errors import ConfigError
from tests.support import ROOT
from tests.support.processes import run_cli


@pytest.mark.process
@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"trace_server": {"port": 70000}}', "config.json: trace_server.port: Input should be less than or equal to 65535"),
        ('{"trace_server": {"prot": 8000}}', "config.json: trace_server.prot: unknown key; known keys: host, port"),
        ('{"trace_server": ', "config.json: not valid JSON at line 1"),
        ('{"distributor": {"batch_size": "many"}}', "config.json: distributor.batch_size: Input should be a valid integer"),
        ('{"distributor": {"batch_size": 0}}', "config.json: distributor.batch_size: Input should be greater than 0"),
        ('{"trace_server": {"storage_backend": "mysql"}}', "config.json: trace_server.storage_backend: Input should be 'sqlite' or 'postgresql'"),
        ('[1]', "config.json: must be a JSON object"),
        ('{"extra_section": {}}', "config.json: extra_section: unknown key; known keys: trace_server"),
        ('{"distributor": {"target": "ftp"}}', "config.json: distributor.target: Input should be 'tinker', 'jsonl', 'http' or 'atropos'"),
        ('{"distributor": {"target": "jsonl", "url": "https://trainer"}}', "config.json: distributor.url: a key of the http target; distributor.target is jsonl"),
        ('{"distributor": {"target": "http", "url": "https://t", "ouput_dir": "x"}}', "config.json: distributor.ouput_dir: unknown key; known keys for target http: target, batch_size"),
        ('{"distributor": {"target": "http"}}', "config.json: distributor.url: Field required"),
        ('{"distributor": {"format": "native"}}', "config.json: distributor.format: Input should be 'atif', 'openai', 'messages', 'sharegpt' or 'hermes'"),
    ],
)
def test_bad_config_stops_start_up_with_one_line(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: " + expected), lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.process
def test_no_tokenizer_stops_start_up_with_one_line(tmp_path: Path) -> None:
    """The tokenizer cannot load (as with the toktok-rs package missing or broken):
    serve says so in one sentence and stops, before it opens the database. (Only its
    import is checked then: its tables load once the server answers, so that a restart
    answers within a second.)"""
    db = tmp_path / "traces.db"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"trace_server": {"db_path": str(db), "port": 0}}))
    no_tokenizer = (
        "import sys\n"
        "sys.modules['toktok'] = None\n"  # what `import toktok` then raises
        "from app.cli.main import main\n"
        "main(sys.argv[1:])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", no_tokenizer, "serve", "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: The cl100k_base tokenizer could not be loaded "
                           "(ModuleNotFoundError: "), last
    assert last.endswith("): reinstall the toktok-rs package, which ships it."), last
    assert "Traceback" not in result.stderr


@pytest.mark.process
def test_missing_files_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "config.json"
    good.write_text("{}")
    missing = tmp_path / "nope" / "compression.json"
    result = run_cli("serve", "--config", str(good), "--compression", str(missing))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: compression.json: file not found at {missing}; pass the right path"


def test_compression_and_tinker_files_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "compression.json"
    bad.write_text(json.dumps({"compression": {"ratio": 2}}))
    with pytest.raises(ConfigError, match=r"^compression.json: compression.ratio: .*less than or equal to 1"):
        load_compression(bad)
    bad = tmp_path / "tinker.json"
    bad.write_text(json.dumps({"tinker": {"api_key": "sk-secret"}}))
    with pytest.raises(ConfigError, match=r"^tinker.json: tinker.api_key: unknown key") as err:
        load_tinker(bad)
    assert "sk-secret" not in str(err.value)


def test_examples_load_with_the_seed_values() -> None:
    config = load_config(ROOT / "config.json.example")
    assert config.trace_server.port == 8000
    assert config.trace_server.endpoint == "/v1/traces"
    assert config.environment.reward_rules["timeout"] == -15
    assert config.distributor.batch_size == 32 and config.distributor.min_reward_threshold == 5
    assert config.distributor.retry == type(config.distributor.retry)()
    assert load_compression(ROOT / "compression.json.example").compression.enabled
    assert load_tinker(ROOT / "tinker.json.example").tinker.api_key_env


def test_each_target_gets_its_own_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"distributor": {
        "target": "http", "url": "https://trainer/batches", "http_timeout_seconds": 5,
        # Another target's keys at their defaults, as config.json.example lists them.
        "output_dir": "~/.atropos/batches",
    }}))  # fmt: skip
    distributor = load_config(path).distributor
    assert isinstance(distributor, HttpTargetConfig)
    assert (distributor.url, distributor.http_timeout_seconds) == ("https://trainer/batches", 5)
    assert "output_dir" not in distributor.model_dump()
    assert isinstance(load_config(ROOT / "config.json.example").distributor, JsonlTargetConfig)


def test_home_is_expanded_and_env_overrides_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"trace_server": {"db_path": "~/hub/traces.db", "port": 1}}))
    monkeypatch.setenv("ATROPOS_TRACE_SERVER__PORT", "9123")
    monkeypatch.setenv("ATROPOS_DISTRIBUTOR__TARGET", "jsonl")
    monkeypatch.setenv("ATROPOS_COMPRESSION__RATIO", "0.5")  # another file's key: ignored here
    config = load_config(path)
    assert config.trace_server.db_path == str(Path.home() / "hub" / "traces.db")
    assert config.trace_server.port == 9123
    assert config.distributor.target == "jsonl"
    monkeypatch.setenv("ATROPOS_TRACE_SERVER__PORT", "not-a-port")
    with pytest.raises(ConfigError, match="trace_server.port"):
        load_config(path)


def test_retry_policies_and_the_older_delivery_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"distributor": {"retry": {"max_attempts": 2, "jitter": 0}}}))
    retry = load_config(path).distributor.retry
    assert (retry.max_attempts, retry.base_seconds, retry.max_seconds, retry.jitter) == (2, 5, 60, 0)
    # The keys from before `retry` was an object still work, in a file or an override.
    path.write_text(json.dumps({"distributor": {"max_attempts": 3, "retry_base_seconds": 1}}))
    monkeypatch.setenv("ATROPOS_DISTRIBUTOR__RETRY_MAX_SECONDS", "4")
    retry = load_config(path).distributor.retry
    assert (retry.max_attempts, retry.base_seconds, retry.max_seconds, retry.jitter) == (3, 1, 4, 0.5)
    # ... but not beside the key they stand for, and with the same bounds.
    path.write_text(json.dumps({"distributor": {"retry": {"max_seconds": 30}}}))
    with pytest.raises(ConfigError, match=r"^config.json: distributor: .*retry_max_seconds and "
                                          r"retry.max_seconds both set; keep retry.max_seconds"):
        load_config(path)
    monkeypatch.delenv("ATROPOS_DISTRIBUTOR__RETRY_MAX_SECONDS")
    path.write_text(json.dumps({"distributor": {"retry_base_seconds": 10}}))
    with pytest.raises(ConfigError, match=r"distributor.retry.base_seconds: .*less than or equal to 5"):
        load_config(path)

    compression = tmp_path / "compression.json"
    compression.write_text(json.dumps({"compression": {"retry": {"max_attempts": 5}}}))
    policy = load_compression(compression).compression.retry
    assert (policy.max_attempts, policy.base_seconds, policy.max_seconds, policy.jitter) == (5, 5, 60, 0)


def test_the_model_client_retries_by_the_same_policy_and_reads_its_older_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tinker.json"
    path.write_text(json.dumps({"tinker": {}}))
    retry = load_tinker(path).tinker.retry
    assert isinstance(retry, RetryPolicy)
    assert (retry.max_attempts, retry.base_seconds, retry.max_seconds, retry.jitter) == (4, 1, 30, 0.5)
    # max_retries counted the retries only: 2 of them are 3 attempts.
    path.write_text(json.dumps({"tinker": {"max_retries": 2, "retry_base_delay_seconds": 0.5}}))
    monkeypatch.setenv("ATROPOS_TINKER__RETRY_MAX_DELAY_SECONDS", "8")
    retry = load_tinker(path).tinker.retry
    assert (retry.max_attempts, retry.base_seconds, retry.max_seconds) == (3, 0.5, 8)
    path.write_text(json.dumps({"tinker": {"max_retries": 2, "retry": {"max_attempts": 5}}}))
    with pytest.raises(ConfigError, match=r"max_retries and retry.max_attempts both set"):
        load_tinker(path)


def test_api_key_is_read_from_the_named_variable_and_stripped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tinker.json"
    path.write_text(json.dumps({"tinker": {"api_key_env": "HUB_TEST_KEY"}}))
    monkeypatch.setenv("HUB_TEST_KEY", "  sk-test-123\n")
    assert load_tinker(path).tinker.api_key() == "sk-test-123"


@pytest.mark.process
def test_db_upgrade_creates_a_fresh_database(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"trace_server": {"db_path": str(tmp_path / "new" / "t.db")}}))
    result = run_cli("db", "upgrade", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "schema at revision" in result.stderr
    assert (tmp_path / "new" / "t.db").exists()


def test_every_target_is_built_from_its_config_model() -> None:
    # The config knows every target's keys; app/targets knows how to build each.
    from app.config import TARGET_CONFIGS
    from app.targets import TARGETS

    assert list(TARGETS) == list(TARGET_CONFIGS)
    assert all(spec.config is TARGET_CONFIGS[name] for name, spec in TARGETS.items())
