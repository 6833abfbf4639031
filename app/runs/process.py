"""The processes of a run: spawned detached from the hub, found again after a hub
restart, stopped as a group.

Each command runs under `launcher.py` (which records its exit code in a file beside
its log) in a session and process group of its own: a hub restart or a Ctrl-C at the
hub's terminal does not reach it, and stopping it signals everything it started.

A process is named by its pid *and* its start time (`/proc/<pid>/stat`, clock ticks
after boot): by the time a restarted hub looks, the pid may belong to someone else.
Linux only, like /proc.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from app import files

log = logging.getLogger("atropos.runs")

LAUNCHER = Path(__file__).with_name("launcher.py")
# How often a stop looks whether the group is gone, and how long it waits after
# SIGKILL (which cannot be refused, but a process in uninterruptible sleep takes a moment).
_STOP_POLL = 0.05
_AFTER_KILL = 5.0


@dataclass(frozen=True)
class _Stat:
    state: str
    start_ticks: int


def _stat(pid: int) -> _Stat | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")".
    fields = raw[raw.rindex(")") + 2 :].split()
    return _Stat(state=fields[0], start_ticks=int(fields[19]))


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks after boot; None if it is gone."""
    stat = _stat(pid)
    return stat.start_ticks if stat else None


def is_running(pid: int, ticks: int | None) -> bool:
    """`pid` is alive (not a zombie) and is the process that started at `ticks`."""
    stat = _stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return False
    return ticks is None or stat.start_ticks == ticks


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"code {code} (killed by {name})"
    return f"code {code}"


class SupervisedProcess:
    """One command of a run, led by its launcher: `pid` is the launcher's, and also
    the id of the process group that holds the command and whatever it starts."""

    def __init__(
        self,
        run_id: str,
        role: str,
        log_path: Path,
        pid: int,
        ticks: int | None,
        popen: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.run_id = run_id
        self.role = role
        self.log_path = log_path
        self.pid = pid
        self.start_ticks = ticks
        # Only the hub that spawned the process has it; it must reap it (poll) or the
        # dead launcher lingers as a zombie that still counts as a group member.
        self._popen = popen

    @classmethod
    def spawn(
        cls,
        run_id: str,
        role: str,
        command: list[str],
        *,
        cwd: str,
        env: dict[str, str],
        log_path: Path,
        user: str | None = None,
    ) -> SupervisedProcess:
        """`command` under the launcher, which runs it as `user` (runs.user) when given;
        the launcher itself stays the hub's, so that it can write the exit file."""
        files.make_dir(log_path.parent)
        exit_path = _exit_path(log_path)
        exit_path.unlink(missing_ok=True)
        with files.open_new(log_path, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-I", str(LAUNCHER), str(exit_path),
                 *(["--user", user] if user else []), "--", *command],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(run_id, role, log_path, popen.pid, start_ticks(popen.pid), popen)

    @classmethod
    def attach(
        cls, run_id: str, role: str, log_path: Path, pid: int, ticks: int | None
    ) -> SupervisedProcess:
        """A process another hub process spawned."""
        return cls(run_id, role, log_path, pid, ticks)

    def running(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return is_running(self.pid, self.start_ticks)

    def exit_code(self) -> int | None:
        """The command's return code once it has ended; None while it runs, or when
        nothing recorded it (the launcher itself was killed, the machine restarted)."""
        try:
            return int(_exit_path(self.log_path).read_text())
        except (FileNotFoundError, ValueError):
            pass
        return self._popen.poll() if self._popen is not None else None

    async def stop(self, timeout: float) -> None:
        """SIGTERM to the group, up to `timeout` seconds for it to end, then SIGKILL."""
        if not self._signal(signal.SIGTERM):
            return
        if await self._gone_within(timeout):
            return
        log.warning(
            "run %s: %s (pid %d) still running %g s after SIGTERM; sending SIGKILL",
            self.run_id,
            self.role,
            self.pid,
            timeout,
        )
        self._signal(signal.SIGKILL)
        if not await self._gone_within(_AFTER_KILL):
            log.error(
                "run %s: %s (pid %d): its process group is still there after SIGKILL",
                self.run_id,
                self.role,
                self.pid,
            )

    def _group_alive(self) -> bool:
        if self._popen is not None:
            self._popen.poll()
        stat = _stat(self.pid)
        if stat is not None and self.start_ticks not in (None, stat.start_ticks):
            return False  # the pid now leads someone else's group; ours is gone
        # The leader may be gone while processes it started live on in its group; the
        # kernel does not hand out a pid that is still a group id, so the group is ours.
        return _has_live_members(self.pid)

    def _signal(self, sig: signal.Signals) -> bool:
        """Signal the group if it is still there; False if it is not."""
        if not self._group_alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    async def _gone_within(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._group_alive():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_STOP_POLL)
        return True


def _has_live_members(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie. kill(-pgid, 0)
    would count zombies too, and whoever reaps the orphans of a killed launcher
    (init, a container's pid 1) may take its time."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        state, _ppid, pgrp = raw[raw.rindex(")") + 2 :].split(maxsplit=3)[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            return True
    return False


def _exit_path(log_path: Path) -> Path:
    return log_path.with_suffix(".exit")
