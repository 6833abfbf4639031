"""The pieces under the supervisor, without a hub: the launcher's exit file, process
identity by start time, stopping a whole process group, log tails and log scanning."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from app.runs.health import _LogScanner
from app.runs.logs import TAIL_MAX_BYTES, tail
from app.runs.process import SupervisedProcess, describe_exit, is_running, start_ticks
from tests.support.waiting import wait_until_async


def _spawn(tmp_path: Path, code: str, role: str = "trainer") -> SupervisedProcess:
    return SupervisedProcess.spawn(
        "r1", role, [sys.executable, "-c", code], cwd=str(tmp_path), env=dict(os.environ),
        log_path=tmp_path / f"{role}_r1.log",
    )


async def _ended(proc: SupervisedProcess, timeout: float = 10) -> None:
    await wait_until_async(lambda: not proc.running(), timeout, what="the process to end")


@pytest.mark.parametrize(
    "code, expected",
    [
        ("print('hi')", 0),
        ("import sys; sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ],
)
async def test_the_launcher_records_the_exit_code(tmp_path: Path, code: str, expected: int) -> None:
    proc = _spawn(tmp_path, code)
    await _ended(proc)
    assert proc.exit_code() == expected
    assert (tmp_path / "trainer_r1.exit").read_text() == f"{expected}\n"
    # A hub that did not spawn it reads the same file.
    found = SupervisedProcess.attach("r1", "trainer", proc.log_path, proc.pid, proc.start_ticks)
    assert not found.running() and found.exit_code() == expected


async def test_a_missing_program_exits_127_and_says_so(tmp_path: Path) -> None:
    proc = SupervisedProcess.spawn("r1", "env_0", ["/no/such/program"], cwd=str(tmp_path),
                            env=dict(os.environ), log_path=tmp_path / "env_0_r1.log")
    await _ended(proc)
    assert proc.exit_code() == 127
    assert "cannot start '/no/such/program'" in proc.log_path.read_text()


def test_a_process_is_its_pid_and_its_start_time() -> None:
    ticks = start_ticks(os.getpid())
    assert ticks is not None and is_running(os.getpid(), ticks)
    assert not is_running(os.getpid(), ticks + 1)  # the pid, reused by someone else
    found = SupervisedProcess.attach("r1", "trainer", Path("/nonexistent.log"), os.getpid(), ticks + 1)
    assert not found.running() and found.exit_code() is None
    assert describe_exit(None) == "exit code unknown"
    assert describe_exit(-15) == "code -15 (killed by SIGTERM)"


async def test_stop_reaches_the_whole_group_and_kills_what_ignores_sigterm(
    tmp_path: Path,
) -> None:
    """The command starts a helper that ignores SIGTERM, then waits: SIGTERM ends the
    command, the helper lives on in the group until SIGKILL."""
    helper = tmp_path / "helper.pid"
    ignorer = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(helper)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {ignorer!r}]); time.sleep(60)"
    )
    proc = _spawn(tmp_path, code)
    await wait_until_async(lambda: helper.exists() and helper.read_text(), 20,
                           what="the helper's pid")
    helper_pid = int(helper.read_text())
    began = time.monotonic()
    await proc.stop(0.5)
    assert 0.5 <= time.monotonic() - began < 5
    assert not proc.running()
    assert not is_running(helper_pid, None)
    assert proc.exit_code() == -15  # the command's own end; only its helper needed SIGKILL
    await proc.stop(0.5)  # stopping a stopped process is a no-op


def test_tail_reads_the_end_of_long_and_missing_logs(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"".join(b"line %d %s\n" % (i, b"x" * 100) for i in range(5000)) + b"last")
    assert [line[:9] for line in tail(log, 3)] == ["line 4998", "line 4999", "last"]
    assert len(tail(log, 2000)) == 2000
    assert tail(log, 0) == [] and tail(tmp_path / "missing.log", 5) == []


def test_tail_reads_at_most_its_bound_from_the_end(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"y" * (3 * TAIL_MAX_BYTES) + b"\nshort\n" + b"z" * (TAIL_MAX_BYTES // 2))
    assert tail(log, 2) == ["short", "z" * (TAIL_MAX_BYTES // 2)]
    lines = tail(log, 10)  # what fits in the bound: the last line, and the end of one
    assert lines[1:] == ["short", "z" * (TAIL_MAX_BYTES // 2)]
    assert sum(len(line) for line in lines) + len(lines) - 1 == TAIL_MAX_BYTES


def test_the_log_check_sees_lines_as_they_are_written(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    scan = _LogScanner(log)
    assert not scan.contains("READY")  # no file yet
    log.write_text("starting\nRE")
    assert not scan.contains("READY")
    with open(log, "a") as f:
        f.write("ADY, listening\n")
    assert scan.contains("READY")
