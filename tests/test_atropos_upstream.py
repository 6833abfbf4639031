"""The hub against atroposlib 0.4.0 itself (installed from PyPI at test time):

- atroposlib's own API tests (atroposlib/tests/test_api_*.py), with the hub
  launched in place of `python -m atroposlib.cli.run_api`
  (tests/support/atropos_upstream_plugin.py);
- the hub and the real run-api driven with the same random request sequences,
  answering the same, response for response;
- the hub's batch formation and buffer release against atroposlib's own functions.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import random
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from app.atropos.packing import EnvShare, Item, form_batches, groups_summing_to
from tests.support import ROOT
from tests.support.atroposlib import install_atroposlib, installed_for_tests, start_run_api
from tests.support.hubs import InProcessHub
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.process, pytest.mark.framework]


@pytest.fixture(scope="session")
def atroposlib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_for_tests(install_atroposlib, "atroposlib", tmp_path_factory)


# --- atroposlib's own tests --------------------------------------------------------


def test_atroposlib_api_tests_pass_against_the_hub(
    atroposlib_dir: Path, dialect: str, tmp_path: Path
) -> None:
    files = sorted((atroposlib_dir / "atroposlib" / "tests").glob("test_api_*.py"))
    assert [f.name for f in files] == [
        "test_api_compression.py",
        "test_api_legacy.py",
        "test_api_messages_handling.py",
    ]
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    junit = tmp_path / "junit.xml"
    with _port_8000_held():
        result = _run_upstream(files, ini, junit, atroposlib_dir, dialect, tmp_path)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("hub-*.log"))
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:] + logs
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    print(f"atroposlib {dialect}: {counts['tests'] - counts['skipped']}/{counts['tests']} passed")
    assert counts["tests"] == 36 and counts["failures"] == counts["errors"] == 0
    assert counts["skipped"] == 0


@contextmanager
def _port_8000_held() -> Iterator[None]:
    """atroposlib's tests talk to localhost:8000, a fixed port: one run of them at a
    time on this machine (the sqlite and postgresql variants run on two xdist workers;
    they collided there)."""
    lock = Path(tempfile.gettempdir()) / "atropos-upstream-port-8000.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # bounded by pytest-timeout
        yield


def _run_upstream(files: list[Path], ini: Path, junit: Path, atroposlib_dir: Path,
                  dialect: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *map(str, files),
            "-c",
            str(ini),
            "--rootdir",
            str(atroposlib_dir),
            "-p",
            "tests.support.atropos_upstream_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={junit}",
        ],
        cwd=atroposlib_dir,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(atroposlib_dir), str(ROOT)]),
            "ATROPOS_UPSTREAM_DIR": str(tmp_path),
            "ATROPOS_UPSTREAM_BACKEND": dialect,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- the same requests to run-api and to the hub -------------------------------------


@pytest.fixture
def run_api(atroposlib_dir: Path, tmp_path: Path) -> Iterator[str]:
    """The original server, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_run_api(atroposlib_dir, port, tmp_path)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.poll() is None, "run-api exited"
        try:
            return httpx.get(url + "/info").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answers, 60, what="run-api to answer")
    yield url
    proc.terminate()
    proc.wait(10)


def test_hub_answers_like_run_api(
    run_api: str, start_hub: Any, trace_server: dict[str, Any]
) -> None:
    hub: InProcessHub = start_hub(trace_server)
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=run_api, timeout=30) as original, hub.client() as ours:
        for seed in range(5):
            for number, (method, path, body) in enumerate(_scenario(random.Random(seed))):
                expected = _answer(original, method, path, body)
                got = _answer(ours, method, path, body)
                assert got == expected, f"seed {seed}, request {number}: {method} {path} {body}"
                answer = got[1]
                if isinstance(answer, dict):
                    seen[str(answer.get("status"))] += 1
                    seen["batches"] += isinstance(answer.get("batch"), list)
    # The scenarios did exercise the interesting paths.
    assert seen["batches"] >= 20 and seen["buffered"] >= 10, seen


def _answer(client: httpx.Client, method: str, path: str, body: Any) -> tuple[int, Any]:
    response = client.request(method, path, json=body)
    if path == "/reset_data":
        return response.status_code, response.text
    answer = response.json()
    if path == "/register":
        answer = sorted(answer)  # the uuid is random
    if path == "/status-env":
        answer.pop("last_seen", None)  # the hub's one field beyond atroposlib's
    return response.status_code, answer


def _scenario(rnd: random.Random) -> Iterator[tuple[str, str, Any]]:
    """A run: register, start, envs of mixed group sizes (some with minimum
    allocations), then groups (some of odd sizes, some of no env), lists, status,
    status-env and batches in random order; reset at the end."""
    batch_size = rnd.choice([4, 8, 12, 16])
    yield (
        "POST",
        "/register",
        {
            "wandb_group": f"g{batch_size}",
            "wandb_project": "diff",
            "batch_size": batch_size,
            "max_token_len": 256,
            "checkpoint_dir": "/tmp/ckpt",
            "save_checkpoint_interval": 5,
            "starting_step": rnd.choice([0, 3]),
            "num_steps": 50,
        },
    )
    yield "POST", "/register-env", _env(rnd, 4)  # the trainer has not started: wait
    yield "GET", "/batch", None
    group_sizes = []
    for _ in range(rnd.randint(1, 3)):
        group_size = rnd.choice([2, 4, 4, 8])
        group_sizes.append(group_size)
        yield "POST", "/register-env", _env(rnd, group_size)
    connected = set(range(len(group_sizes)))
    for _ in range(120):
        roll = rnd.random()
        env_id = rnd.randrange(len(group_sizes))
        if roll < 0.45:
            size = (
                group_sizes[env_id] if rnd.random() < 0.75 else rnd.randint(1, group_sizes[env_id])
            )
            yield "POST", "/scored_data", _group(rnd, size, env_id if rnd.random() < 0.9 else None)
        elif roll < 0.55:
            yield (
                "POST",
                "/scored_data_list",
                [_group(rnd, group_sizes[env_id], env_id) for _ in range(rnd.randint(1, 3))],
            )
        elif roll < 0.75:
            yield "GET", "/batch", None
        elif roll < 0.85 and env_id in connected:
            yield "GET", "/status-env", {"env_id": env_id}
        elif roll < 0.9:
            yield "GET", "/status", None
        elif roll < 0.93:
            yield "GET", "/latest_example", None
        elif roll < 0.95 and len(connected) > 1 and env_id in connected:
            connected.discard(env_id)
            yield "POST", "/disconnect-env", {"env_id": env_id}
        else:
            yield "GET", rnd.choice(["/info", "/wandb_info"]), None
    yield "GET", "/reset_data", None
    yield "GET", "/info", None
    yield "GET", "/status", None


def _env(rnd: random.Random, group_size: int) -> dict[str, Any]:
    return {
        "max_token_length": rnd.choice([256, 512]),
        "desired_name": rnd.choice(["gsm8k", "tools"]),
        "weight": rnd.choice([0.5, 1.0, 2.0]),
        "group_size": group_size,
        "min_batch_allocation": rnd.choice([None, None, None, 0.25, 0.5]),
    }


def _group(rnd: random.Random, size: int, env_id: int | None) -> dict[str, Any]:
    tokens = [[rnd.randrange(1000) for _ in range(rnd.randint(3, 8))] for _ in range(size)]
    group: dict[str, Any] = {
        "tokens": tokens,
        "masks": [[-100, -100, *seq[2:]] for seq in tokens],
        "scores": [rnd.choice([0, 1, 0.5]) for _ in range(size)],
        "env_id": env_id,
    }
    if rnd.random() < 0.5:
        group["messages"] = [[{"role": "user", "content": f"q{i}"}] for i in range(size)]
    if rnd.random() < 0.3:
        group["inference_logprobs"] = [[1.0, 1.0, *([-0.5] * (len(s) - 2))] for s in tokens]
    return group


# --- formation against atroposlib's functions ------------------------------------------


@pytest.fixture(scope="session")
def atroposlib_utils(atroposlib_dir: Path) -> ModuleType:
    """atroposlib/api/utils.py alone (it imports nothing of atroposlib)."""
    path = atroposlib_dir / "atroposlib" / "api" / "utils.py"
    spec = importlib.util.spec_from_file_location("atroposlib_api_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batch_formation_matches_atroposlib(atroposlib_utils: ModuleType) -> None:
    rnd = random.Random(7)
    for _ in range(3000):
        envs: list[dict[str, Any]] = [
            {
                "registered_id": e,
                "connected": rnd.random() < 0.8,
                "min_batch_allocation": rnd.choice([None, None, 0.01, 0.25, 0.5, 0.7]),
            }
            for e in range(rnd.randint(0, 3))
        ]
        sizes = rnd.choice([[8], [4, 8], [1, 2, 4, 8], [2, 3, 4], [1, 2], [3]])
        queue = [
            {
                "id": i,
                "tokens": [[0]] * rnd.choice(sizes),
                "env_id": rnd.choice([*range(len(envs)), None]),
            }
            for i in range(rnd.randint(0, 40))
        ]
        batch_size = rnd.choice([1, 2, 4, 5, 6, 8, 12, 16, 32])
        expected = _atroposlib_batches(atroposlib_utils, queue, batch_size, envs)
        items = [Item(g["id"], g["env_id"], len(g["tokens"])) for g in queue]
        shares = [
            EnvShare(e["registered_id"], e["connected"], e["min_batch_allocation"]) for e in envs
        ]
        got = [[item.id for item in batch] for batch in form_batches(items, batch_size, shares)]
        assert got == expected, (queue, batch_size, envs)


def _atroposlib_batches(
    utils: ModuleType, queue: list[dict[str, Any]], batch_size: int, envs: list[dict[str, Any]]
) -> list[list[int]]:
    """What atroposlib's GET /batch forms when it has no formed batch left."""
    minimums = any(env.get("min_batch_allocation") is not None for env in envs)

    def grab(q: list[dict[str, Any]]) -> Any:
        if minimums:
            return utils.grab_batch_with_minimum_allocations(q, batch_size, envs)
        return utils.grab_exact_from_heterogeneous_queue(q, batch_size)

    batches = []
    batch, queue = grab(queue)
    while batch is not None:
        batches.append([group["id"] for group in batch])
        batch, queue = grab(queue)
    return batches


def test_buffer_release_matches_atroposlib(atroposlib_utils: ModuleType) -> None:
    rnd = random.Random(11)
    for _ in range(3000):
        target = rnd.randint(1, 16)
        sizes = [rnd.randint(1, 17) for _ in range(rnd.randint(0, 10))]
        buffer = [{"tokens": [[0]] * size} for size in sizes]
        assert groups_summing_to(sizes, target) == (
            atroposlib_utils.find_groups_summing_to_target(buffer, target)
        ), (sizes, target)
