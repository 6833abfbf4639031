"""The ops files: Dockerfile, docker-compose.yml, .dockerignore, requirements.lock,
scripts/pg-test-cluster.

No Docker engine runs here, so the Docker files are checked for what the README relies on
(services, volumes, ports on 127.0.0.1, commands, non-root user, health check, the
dependencies installed from the lock before the code is copied); the PostgreSQL helper
is run for real.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PG_TEST_CLUSTER = ROOT / "scripts" / "pg-test-cluster"
CONFIGS = ["--config", "/etc/atropos/config.json", "--compression", "/etc/atropos/compression.json"]
SERVE = ["atropos", "serve", *CONFIGS]
WORKER = ["atropos", "worker", *CONFIGS]
CONFIG_MOUNTS = [
    "./config.json.example:/etc/atropos/config.json:ro",
    "./compression.json.example:/etc/atropos/compression.json:ro",
]


def _steps() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order (keyword, arguments), comment lines dropped
    and continuation lines joined."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    found = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        keyword, _, args = line.strip().partition(" ")
        if keyword:
            found.append((keyword.upper(), " ".join(args.split())))
    return found


def _dockerfile(instruction: str) -> list[str]:
    """The arguments of every `instruction` line."""
    return [args for keyword, args in _steps() if keyword == instruction]


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def _default(value: str, env: dict[str, str] | None = None) -> str:
    """`${VAR:-default}` as compose resolves it, with VAR unset unless `env` has it."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: (env or {}).get(m[1]) or m[2], value)


# Dockerfile


def test_dockerfile_base_user_volume_and_port() -> None:
    assert _dockerfile("FROM") == ["python:3.11-slim"]
    users = _dockerfile("USER")
    assert users and users[-1] not in ("root", "0"), "the server must not run as root"
    assert _dockerfile("VOLUME") == ["/data"]
    assert _dockerfile("EXPOSE") == ["8000"]
    env = " ".join(_dockerfile("ENV"))
    assert "ATROPOS_TRACE_SERVER__DB_PATH=/data/traces.db" in env
    # The jsonl target's files land in the volume too.
    assert "ATROPOS_DISTRIBUTOR__OUTPUT_DIR=/data/batches" in env


def test_dockerfile_cmd_is_the_serve_command() -> None:
    (cmd,) = _dockerfile("CMD")
    assert json.loads(cmd) == SERVE


def test_dockerfile_installs_the_configs_the_cmd_reads() -> None:
    run = " ".join(_dockerfile("RUN"))
    assert "pip install --no-deps ." in run
    for example, target in [
        ("config.json.example", "/etc/atropos/config.json"),
        ("compression.json.example", "/etc/atropos/compression.json"),
    ]:
        assert f"{example} {target}" in run
        assert (ROOT / example).is_file(), f"the image copies {example}, which is missing"


def test_dockerfile_healthcheck_asks_healthz_with_python() -> None:
    (check,) = _dockerfile("HEALTHCHECK")
    options, _, cmd = check.partition("CMD ")
    argv = json.loads(cmd)
    assert argv[:2] == ["python", "-c"], "python:slim has no curl"
    compile(argv[2], "<healthcheck>", "exec")
    assert "http://127.0.0.1:8000/healthz" in argv[2]
    assert "--timeout=" in options


def test_dockerignore_keeps_what_the_build_needs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, pattern) for pattern in patterns)

    for path in ["pyproject.toml", "README.md", "app", "migrations", "config.json.example"]:
        assert not ignored(path), f"{path} is ignored but the build needs it"
    for path in [".git", "tests", "config.json", ".env"]:
        assert ignored(path), f"{path} would be sent to the build"


def _copied(arguments: str) -> list[str]:
    """The sources of a COPY (its last word is the destination)."""
    return [w for w in arguments.split()[:-1] if not w.startswith("--")]


def test_dependencies_are_installed_from_the_lock_before_the_code_is_copied() -> None:
    steps = _steps()
    copies = [(i, _copied(args)) for i, (kind, args) in enumerate(steps) if kind == "COPY"]
    assert all("." not in sources for _, sources in copies), "COPY . . invalidates every layer"
    [lock_copy] = [i for i, sources in copies if "requirements.lock" in sources]
    assert "pyproject.toml" in steps[lock_copy][1]
    [install] = [i for i, (kind, args) in enumerate(steps)
                 if kind == "RUN" and "pip install -r requirements.lock" in args]
    code = [i for i, sources in copies if {"app", "migrations"} & set(sources)]
    assert lock_copy < install < min(code)
    [project] = [args for kind, args in steps[min(code):] if kind == "RUN" and "pip install" in args]
    assert "pip install --no-deps ." in project and "pip check" in project
    for _, sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repo"


def test_the_lock_pins_every_dependency_to_a_version_it_allows() -> None:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[\w.+!-]+", version), f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        wanted = Requirement(dependency)
        name = canonicalize_name(wanted.name)
        assert name in pins, f"{name} is not in requirements.lock: run scripts/lock_requirements.py"
        assert wanted.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock has {name}=={pins[name]}; pyproject.toml wants {wanted}")


# docker-compose.yml


def test_compose_sqlite_hub() -> None:
    compose = _compose()
    assert set(compose["services"]) == {"hub", "postgres", "hub-pg", "worker-1", "worker-2"}
    assert set(compose["volumes"]) == {"hub-data", "pg-data", "batches"}
    hub = compose["services"]["hub"]
    assert "profiles" not in hub, "`docker compose up` must start the SQLite hub"
    assert hub["build"] == "."
    assert [_default(p) for p in hub["ports"]] == ["127.0.0.1:8000:8000"]
    assert "command" not in hub, "the hub runs the image's CMD"
    assert [_default(v) for v in hub["volumes"]] == [*CONFIG_MOUNTS, "hub-data:/data"]
    for mount in CONFIG_MOUNTS:
        assert (ROOT / mount.split(":")[0]).is_file(), f"compose mounts {mount}, which is missing"


def test_compose_postgres_profile() -> None:
    services = _compose()["services"]
    for name in ["postgres", "hub-pg", "worker-1", "worker-2"]:
        assert services[name]["profiles"] == ["postgres"], name

    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:")
    assert postgres["volumes"] == ["pg-data:/var/lib/postgresql/data"]
    assert "pg_isready" in postgres["healthcheck"]["test"]
    user, db = postgres["environment"]["POSTGRES_USER"], postgres["environment"]["POSTGRES_DB"]

    hub_pg = services["hub-pg"]
    assert hub_pg["command"] == [*SERVE, "--no-workers"]
    assert [_default(p) for p in hub_pg["ports"]] == ["127.0.0.1:8001:8000"]
    assert hub_pg["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ["hub-pg", "worker-1", "worker-2"]:
        env = services[name]["environment"]
        assert env["ATROPOS_TRACE_SERVER__STORAGE_BACKEND"] == "postgresql", name
        url = _default(env["ATROPOS_TRACE_SERVER__DATABASE_URL"])
        assert re.fullmatch(rf"postgresql://{user}:[^@]+@postgres:5432/{db}", url), url
    assert [_default(v) for v in hub_pg["volumes"]] == CONFIG_MOUNTS
    for name in ["worker-1", "worker-2"]:  # they deliver: the batch files go to one volume
        volumes = [_default(v) for v in services[name]["volumes"]]
        assert volumes == [*CONFIG_MOUNTS, "batches:/data/batches"], name
    for name in ["worker-1", "worker-2"]:
        worker = services[name]
        assert worker["command"] == WORKER
        assert "ports" not in worker
        assert worker["healthcheck"] == {"disable": True}, "a worker serves no /healthz"
        assert worker["depends_on"]["hub-pg"]["condition"] == "service_healthy"


def test_compose_publishes_on_loopback_unless_the_user_opts_in() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "ATROPOS_PUBLISH=0.0.0.0" in text  # the comment says how to opt in
    ports = [port for service in _compose()["services"].values()
             for port in service.get("ports", [])]
    assert len(ports) == 2
    for port in ports:
        assert _default(port).startswith("127.0.0.1:"), port
        assert _default(port, {"ATROPOS_PUBLISH": "0.0.0.0"}).startswith("0.0.0.0:"), port


def test_compose_delivers_to_jsonl_by_default() -> None:
    services = _compose()["services"]
    for name in ["hub", "hub-pg", "worker-1", "worker-2"]:
        assert "ATROPOS_DISTRIBUTOR__TARGET" not in (services[name].get("environment") or {})
        assert [_default(v) for v in services[name]["volumes"]][0] == CONFIG_MOUNTS[0]
    example = json.loads((ROOT / "config.json.example").read_text())
    assert example["distributor"]["target"] == "jsonl"


@pytest.mark.process
@pytest.mark.parametrize("argv", [[*SERVE, "--no-workers"], WORKER], ids=["serve", "worker"])
def test_the_cli_takes_the_flags_the_docker_files_pass(argv: list[str]) -> None:
    atropos = Path(sys.executable).parent / "atropos"
    command = [str(atropos)] if atropos.exists() else [sys.executable, "-m", "app.cli"]
    result = subprocess.run(
        [*command, argv[1], "--help"], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for flag in (arg for arg in argv if arg.startswith("--")):
        assert flag in result.stdout, f"`atropos {argv[1]}` has no {flag}"


# scripts/pg-test-cluster


def _postgres_binaries() -> bool:
    return shutil.which("initdb") is not None or any(
        Path("/usr/lib/postgresql").glob("*/bin/initdb")
    )


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PG_TEST_CLUSTER), *args], check=False, capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
@pytest.mark.skipif(
    not _postgres_binaries() and not os.environ.get("CI"),
    reason="no PostgreSQL server binaries (CI installs them)",
)
async def test_pg_test_cluster_starts_serves_and_stops() -> None:
    # Directly under /tmp: as root the cluster runs as another user, who must reach the dir.
    state = Path(tempfile.gettempdir()) / f"atropos-pg-test-{uuid.uuid4().hex[:8]}"
    try:
        started = _cluster("start", str(state))
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert re.fullmatch(r"postgresql://\w+@127\.0\.0\.1:\d+/atropos_test", url), url
        assert (state / "url").read_text().strip() == url

        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT current_database()") == "atropos_test"
            assert await conn.fetchval("SELECT current_setting('fsync')") == "off"
            await conn.execute("CREATE TABLE t (x int); INSERT INTO t VALUES (1), (2)")
            assert await conn.fetchval("SELECT sum(x) FROM t") == 3
        finally:
            await conn.close()
    finally:
        stopped = _cluster("stop", str(state))
    assert stopped.returncode == 0, stopped.stderr
    assert not state.exists()
    with pytest.raises(OSError):
        await asyncpg.connect(url, timeout=5)
    assert _cluster("stop", str(state)).returncode == 0, "stopping twice is harmless"


@pytest.mark.process
def test_pg_test_cluster_stop_leaves_other_dirs_alone() -> None:
    with tempfile.TemporaryDirectory() as other:
        (Path(other) / "keep").write_text("mine")
        result = _cluster("stop", other)
        assert result.returncode != 0
        assert "not a pg-test-cluster dir" in result.stderr
        assert (Path(other) / "keep").read_text() == "mine"
