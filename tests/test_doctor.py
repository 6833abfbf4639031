"""`atropos doctor`: every diagnosis fires on its fault, each as one actionable line
naming the variable, URL or model involved, with a non-zero exit; exit 0 when all pass."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakes.model_server import FakeModel
from tests.support.processes import run_cli

pytestmark = pytest.mark.process

KEY = FakeModel.key
KEY_ENV = "DOCTOR_TEST_KEY"
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
              "ALL_PROXY", "no_proxy", "NO_PROXY")


@pytest.fixture
def root(model_server: tuple[FakeModel, str], fake_model: FakeModel) -> str:
    return model_server[1]  # of a server reset for this test


def doctor(tmp_path: Path, base_url: str, env: dict[str, str | None],
           **tinker: Any) -> tuple[int, list[str]]:
    path = tmp_path / "tinker.json"
    path.write_text(json.dumps({"tinker": {"base_url": base_url, "api_key_env": KEY_ENV,
                                           "model_id": "fake/model-1", **tinker}}))
    environ = {k: v for k, v in os.environ.items() if k not in PROXY_VARS and k != KEY_ENV}
    environ |= {k: v for k, v in env.items() if v is not None}
    done = run_cli("doctor", "--tinker", str(path), env=environ)
    lines = done.stdout.splitlines()
    assert all(line.split()[0] in ("ok", "warn", "FAIL") for line in lines), done.stdout
    return done.returncode, lines


def marked(lines: list[str], mark: str) -> list[str]:
    return [line for line in lines if line.startswith(mark)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_checks_pass(fake_model: FakeModel, root: str, tmp_path: Path) -> None:
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: KEY})
    assert code == 0 and not marked(lines, "FAIL") and not marked(lines, "warn")
    text = "\n".join(lines)
    assert f"POST {root}/v1/chat/completions" in text and "ends at a version" in text
    assert "none applies" in text
    assert "Model request completed: status=200, tokens=120" in text
    assert KEY not in text


def test_provider_root_url_is_explained(
    fake_model: FakeModel, root: str, tmp_path: Path
) -> None:
    fake_model.prefix = "/api/v1"
    try:
        code, lines = doctor(tmp_path, f"{root}/api", {KEY_ENV: KEY})
    finally:
        fake_model.prefix = "/v1"
    assert code == 0
    assert any(f"POST {root}/api/v1/chat/completions" in line and "provider root" in line
               for line in lines)


def test_missing_key(root: str, tmp_path: Path) -> None:
    code, lines = doctor(tmp_path, f"{root}/v1", {})
    [key, chat] = marked(lines, "FAIL")
    assert code == 1 and KEY_ENV in key and "not set" in key and f"export {KEY_ENV}=" in key
    assert "not tried" in chat


def test_whitespace_around_the_key_warns(
    fake_model: FakeModel, root: str, tmp_path: Path
) -> None:
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: f" {KEY}\n"})
    [warning] = marked(lines, "warn")
    assert code == 0 and KEY_ENV in warning and "whitespace" in warning


def test_401_names_the_variable(root: str, tmp_path: Path) -> None:
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: "sk-wrong"})
    [fail] = marked(lines, "FAIL")
    assert code == 1 and "HTTP 401" in fail and KEY_ENV in fail and "sk-wrong" not in fail


def test_404_names_the_url_and_model(root: str, tmp_path: Path) -> None:
    code, lines = doctor(tmp_path, f"{root}/wrong/v1", {KEY_ENV: KEY})
    [fail] = marked(lines, "FAIL")
    assert code == 1 and "HTTP 404" in fail
    assert f"{root}/wrong/v1/chat/completions" in fail and "fake/model-1" in fail
    assert "tinker.base_url" in fail


def test_a_proxy_that_does_not_answer(root: str, tmp_path: Path) -> None:
    proxy = f"http://127.0.0.1:{closed_port()}"
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: KEY, "HTTP_PROXY": proxy})
    [fail, chat] = marked(lines, "FAIL")
    assert code == 1 and "HTTP_PROXY" in fail and proxy in fail and "does not answer" in fail
    assert "NO_PROXY" in fail and "not tried" in chat


def test_a_proxy_exempted_by_no_proxy_is_not_used(
    fake_model: FakeModel, root: str, tmp_path: Path
) -> None:
    proxy = f"http://127.0.0.1:{closed_port()}"
    code, lines = doctor(tmp_path, f"{root}/v1",
                         {KEY_ENV: KEY, "HTTP_PROXY": proxy, "NO_PROXY": "127.0.0.1"})
    assert code == 0
    assert any("none applies" in line and "HTTP_PROXY" in line for line in lines)


def test_a_200_without_choices(
    fake_model: FakeModel, root: str, tmp_path: Path
) -> None:
    fake_model.faults.append("no_choices")
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: KEY})
    [fail] = marked(lines, "FAIL")
    assert code == 1 and "without `choices`" in fail and "fake/model-1" in fail


def test_tinker_backend_without_the_sdk(
    fake_model: FakeModel, root: str, tmp_path: Path
) -> None:
    if importlib.util.find_spec("tinker") is not None:
        pytest.skip("the tinker SDK is installed here")
    code, lines = doctor(tmp_path, f"{root}/v1", {KEY_ENV: KEY}, backend="tinker")
    [fail] = marked(lines, "FAIL")
    assert code == 1 and "atropos-hub[tinker]" in fail
