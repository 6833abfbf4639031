"""The hub and its commands in processes of their own, as a user runs them: for what
only a process shows (signals, kill -9, several processes, the command's own output)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.support import ROOT
from tests.support.hubs import HubUnderTest

LISTENING = re.compile(r"Trace server listening on ([\d.]+):(\d+)")


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`atropos ARGS` in its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class HubProcess(HubUnderTest):
    """`atropos serve` as a user runs it, in its own process."""

    command = "serve"

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines = []

    def start(self, timeout: float = 30) -> HubProcess:
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", self.command, "--config", str(self.config),
             *self.args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own process group, as a job in a terminal is
        )
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(self.proc, ready), daemon=True)
        self._reader.start()
        if not ready.wait(timeout):
            self.kill()
            raise AssertionError("hub did not start:\n" + self.log)
        return self

    def _read(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stderr is not None
        with proc.stderr:
            for line in proc.stderr:
                self.lines.append(line)
                if self._ready(line):
                    ready.set()
        ready.set()

    def _ready(self, line: str) -> bool:
        if match := LISTENING.search(line):
            self.url = f"http://{match[1]}:{match[2]}"
            return True
        return False

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._reader.join(10)

    def group(self) -> list[int]:
        """The pids in the hub's process group: itself and what it started."""
        assert self.proc is not None
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def forked(self) -> list[int]:
        """The ingest processes' fork server and the processes it forked."""
        return [pid for pid in self.group() if b"forkserver" in _cmdline(pid)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        """The exit code, once the process has ended and its log is read."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code


class WorkerProcess(HubProcess):
    """`atropos worker`: the background stages alone, ready once they say so."""

    command = "worker"

    def _ready(self, line: str) -> bool:
        return "pipeline ready" in line


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # exited meanwhile
