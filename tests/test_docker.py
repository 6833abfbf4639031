"""The Dockerfile and the compose file, read as Docker reads them (Docker itself is not
available where these tests run): dependencies installed from the lock before the code
is copied, the hub published on 127.0.0.1 unless the user opts in, batches to jsonl."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), " ".join(rest.split())))
    return found


def copied(arguments: str) -> list[str]:
    """The sources of a COPY (its last word is the destination)."""
    return [w for w in arguments.split()[:-1] if not w.startswith("--")]


def test_dependencies_are_installed_from_the_lock_before_the_code_is_copied() -> None:
    steps = instructions()
    copies = [(i, copied(args)) for i, (kind, args) in enumerate(steps) if kind == "COPY"]
    assert all("." not in sources for _, sources in copies), "COPY . . invalidates every layer"
    [lock_copy] = [i for i, sources in copies if "requirements.lock" in sources]
    assert "pyproject.toml" in steps[lock_copy][1]
    [install] = [i for i, (kind, args) in enumerate(steps)
                 if kind == "RUN" and "pip install -r requirements.lock" in args]
    code = [i for i, sources in copies if {"app", "migrations"} & set(sources)]
    assert lock_copy < install < min(code)
    [project] = [args for kind, args in steps[min(code):] if kind == "RUN"
                 and "pip install" in args]
    assert "pip install --no-deps ." in project and "pip check" in project
    for _, sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repo"


def test_the_lock_pins_every_dependency_to_a_version_it_allows() -> None:
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.+-]+", version), f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        wanted = Requirement(dependency)
        name = canonicalize_name(wanted.name)
        assert name in pins, f"{name} is not in requirements.lock: run scripts/lock_requirements.py"
        assert wanted.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock has {name}=={pins[name]}; pyproject.toml wants {wanted}")


def _resolve(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} interpolation."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m[1]) or m[2], text)


def _compose(env: dict[str, str]) -> dict[str, Any]:
    text = (ROOT / "docker-compose.yml").read_text()
    loaded: dict[str, Any] = yaml.safe_load(_resolve(text, env))
    return loaded


def test_compose_publishes_on_loopback_unless_the_user_opts_in() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "ATROPOS_PUBLISH=0.0.0.0" in text  # the comment says how to opt in
    for env, host in (({}, "127.0.0.1"), ({"ATROPOS_PUBLISH": "0.0.0.0"}, "0.0.0.0")):
        published = [port for service in _compose(env)["services"].values()
                     for port in service.get("ports", [])]
        assert len(published) == 2
        for port in published:
            assert str(port).split(":")[0] == host, port


def test_compose_delivers_to_jsonl_by_default() -> None:
    services = _compose({})["services"]
    hubs = {name: s for name, s in services.items() if s.get("image") == "atropos-hub:local"}
    assert set(hubs) == {"hub", "hub-pg", "worker-1", "worker-2"}
    for name, service in hubs.items():
        assert "ATROPOS_DISTRIBUTOR__TARGET" not in (service.get("environment") or {}), name
        [config] = [v.split(":")[0] for v in service["volumes"]
                    if v.split(":")[1] == "/etc/atropos/config.json"]
        assert config == "./config.json.example"
    example = json.loads((ROOT / "config.json.example").read_text())
    assert example["distributor"]["target"] == "jsonl"
