"""Files the hub creates are private to its user, whatever the umask (they
were 0644 under umask 022), and readable by a configured group; `atropos export`
writes through a temporary file nobody can plant a link at."""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import files
from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.support.runs import spec, start, wait_status
from tests.support.waiting import wait_until


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common default, under which open() makes world-readable files."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root`: (permission bits, group id)."""
    found = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        found[str(path.relative_to(root)) + ("/" if path.is_dir() else "")] = (
            stat.S_IMODE(st.st_mode), st.st_gid)
    return found


@pytest.mark.process
@pytest.mark.parametrize("group", [None, "daemon"])
def test_every_file_the_hub_creates_is_private(
    tmp_path: Path, loose_umask: None, group: str | None
) -> None:
    if group is not None and os.geteuid() != 0 and grp.getgrnam(group).gr_gid not in os.getgroups():
        pytest.skip(f"this user cannot give files to group {group}")
    data = tmp_path / "hub"  # made by the hub, with everything in it
    trace_server = {"db_path": str(data / "db" / "traces.db"), "file_group": group}
    config = write_config(
        tmp_path, trace_server,
        distributor={"target": "jsonl", "output_dir": str(data / "batches"), "batch_size": 1,
                     "min_reward_threshold": -1000},
        runs={"enabled": True, "logs_dir": str(data / "logs"), "allow_without_auth": True},
    )
    hub = HubProcess(config).start()
    try:
        with hub.client() as client:
            assert client.post("/v1/traces", json=native_trace()).status_code == 202
            wait_until(lambda: list((data / "batches").glob("b-*.jsonl")), what="a batch file")
            body = spec(["/bin/sh", "-c", "echo trainer up; exec sleep 60"],
                        trainer_health={"log": "trainer up"}, cwd=str(tmp_path))
            run_id = start(client, body)
            wait_status(client, run_id, "running")
            client.delete(f"/v1/runs/{run_id}")
            wait_status(client, run_id, "stopped")
        exported = run_cli("export", "--config", str(config), "--format", "openai",
                           "-o", str(data / "export.jsonl"))
        assert exported.returncode == 0, exported.stderr
    finally:
        hub.kill()

    modes = _modes(data)
    # What the hub made: the database with its WAL and SHM, a batch file and the
    # manifest, a run log and its exit record, the export; and their directories.
    made = {"db/traces.db", "db/traces.db-wal", "db/traces.db-shm", "batches/manifest.jsonl",
            f"logs/trainer_{run_id}.log", "export.jsonl", "db/", "batches/", "logs/"}
    assert made <= modes.keys(), sorted(modes)
    assert any(name.startswith("batches/b-") for name in modes)
    file_mode, dir_mode = (0o600, 0o700) if group is None else (0o640, 0o750)
    gid = os.getegid() if group is None else grp.getgrnam(group).gr_gid
    for name, (mode, owner) in modes.items():
        if name == "./":
            continue  # tmp_path/hub: made by mkdir for the database's parent, checked below
        assert mode == (dir_mode if name.endswith("/") else file_mode), (name, oct(mode))
        assert owner == gid, name
    assert modes["./"][0] == dir_mode


@pytest.mark.process
def test_export_writes_through_a_random_name_and_never_a_link(
    start_hub: Any, tmp_path: Path
) -> None:
    """`atropos export -o out.jsonl` wrote `.out.jsonl.tmp` and followed a symlink
    planted there, overwriting its target."""
    hub = start_hub({"db_path": str(tmp_path / "traces.db")}, "--no-workers")
    with hub.client() as client:
        assert client.post("/v1/traces", json=native_trace()).status_code == 202
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out" / "out.jsonl"
    out.parent.mkdir()
    (out.parent / ".out.jsonl.tmp").symlink_to(victim)
    done = run_cli("export", "--config", str(hub.config), "--format", "openai", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n"
    assert len(out.read_text().splitlines()) == 1 and not out.is_symlink()
    assert sorted(p.name for p in out.parent.iterdir()) == [".out.jsonl.tmp", "out.jsonl"]


def test_a_temporary_file_is_never_opened_through_a_planted_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even at a name guessed right, a planted link or file is refused, not followed."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    monkeypatch.setattr("app.files.secrets.token_hex", lambda _: "guessed")
    (tmp_path / ".out.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.temporary(tmp_path, "out")
    assert victim.read_text() == "precious\n"
