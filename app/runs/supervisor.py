"""The run supervisor: starts a run's processes in order, watches them, stops them
in reverse order, and takes runs over again after a hub restart.

One supervisor per `atropos serve` process (when runs.enabled), owned by the hub's
lifespan. Each run it watches has a task of its own (`_Run`): launch -> monitor ->
end. Everything a later hub needs is in the database (status, pids with start times,
log paths) or beside the logs (exit codes), so the supervisor may stop at any point:
stopping the hub leaves the runs' processes running, and the next hub on this machine
re-attaches to them, or fails the runs whose processes are gone, saying why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import RunsConfig, TinkerConfig
from app.db.types import utcnow
from app.errors import Conflict, Invalid
from app.runs import records
from app.runs.channel import ModelChannel, process_env
from app.runs.health import Exited, Healthy, Interrupted, TimedOut, wait_until_healthy
from app.runs.logs import log_path, tail
from app.runs.process import SupervisedProcess, describe_exit, is_running, start_ticks
from app.runs.records import RunRecord, RunStatus
from app.runs.spec import RunSpec
from app.waits import event_set_within

log = logging.getLogger("atropos.runs")

Outcome = tuple[RunStatus, str | None]
# A _Run method that carries a run to its end: launch, or resume.
_Step = Callable[..., Awaitable[None]]


class RunSupervisor:
    def __init__(self, engine: AsyncEngine, config: RunsConfig, tinker: TinkerConfig) -> None:
        self._engine = engine
        self._config = config
        self._tinker = tinker
        self.host = socket.gethostname()
        # Names this hub process in `runs.supervisor`; another hub on this machine can
        # tell from it whether the watcher of a run is still alive.
        self.identity = f"{self.host}:{os.getpid()}:{start_ticks(os.getpid())}"
        self._runs: dict[str, _Run] = {}
        # Health checks go to the run's own processes, normally on this machine: a
        # proxy from HTTP_PROXY would only be in the way.
        self._http = httpx.AsyncClient(trust_env=False)

    async def start(self) -> None:
        """Take over the unfinished runs of this machine that no live hub watches."""
        async with self._engine.begin() as conn:
            candidates = await records.unwatched_runs(conn, self.host, self.identity)
        for run_id, owner in candidates:
            try:
                await self._take_over(run_id, owner)
            except Exception:
                # One run the hub cannot make sense of must not keep it from serving.
                log.exception("run %s: could not take it over", run_id)

    async def _take_over(self, run_id: str, owner: str | None) -> None:
        if owner is not None and _alive(owner, self.host):
            return  # another hub process on this machine watches it
        async with self._engine.begin() as conn:
            if not await records.claim(conn, run_id, owner, self.identity):
                return  # another hub took it first
            record = await records.get_run(conn, run_id)
        self._watch(_Run.adopt(self, record), _Run.resume, record.status)

    async def close(self) -> None:
        """Stop watching; the runs' processes keep running for the next hub."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()
        try:
            async with self._engine.begin() as conn:
                await records.release(conn, self.identity)
        except (SQLAlchemyError, OSError) as exc:
            # Harmless: the next hub sees that this process is gone and takes them over.
            log.warning("runs not released (%s); the next hub takes them over", exc)

    async def create(self, spec: RunSpec, hub_url: str) -> RunRecord:
        """Record a pending run and start launching it; answers at once."""
        try:
            cwd = Path(spec.cwd or os.getcwd()).expanduser().resolve()
            found = cwd.is_dir()
        except OSError as exc:  # a name too long, a directory we may not enter
            raise Invalid(f"cwd: {exc.strerror}", field="cwd") from None
        if not found:
            raise Invalid(f"cwd: {spec.cwd} is not a directory on the hub's machine", field="cwd")
        spec = spec.model_copy(update={"cwd": str(cwd)})
        run_id = uuid.uuid4().hex[:12]
        processes = [
            (role, p.command, str(log_path(self._config.logs_dir, role, run_id)))
            for role, p in spec.processes()
        ]
        async with self._engine.begin() as conn:
            await records.create_run(
                conn,
                run_id,
                spec.model_dump(mode="json", exclude_none=True),
                processes,
                host=self.host,
                supervisor=self.identity,
            )
            record = await records.get_run(conn, run_id)
        channel = ModelChannel.from_tinker(self._tinker)
        if not channel.api_key:
            log.warning(
                "run %s: %s is not set; the trainer starts without OPENAI_API_KEY",
                run_id,
                channel.api_key_env,
            )
        log.info(
            "run %s: created; trainer %s, %d environment(s), logs in %s",
            run_id,
            shlex.join(spec.trainer.command),
            len(spec.environments),
            self._config.logs_dir,
        )
        self._watch(_Run(self, run_id, spec, channel, hub_url), _Run.launch)
        return record

    async def stop(self, run_id: str) -> RunRecord:
        """Ask for the run to stop. The hub that watches it (this one, or another on
        its machine at its next poll) stops the processes, environments first."""
        async with self._engine.begin() as conn:
            status = await records.status_of(conn, run_id)
            if status.finished:
                raise Conflict(f"run {run_id} has already {status.value}", field="run_id")
            await records.move(
                conn,
                run_id,
                RunStatus.STOPPING,
                expected=[RunStatus.PENDING, RunStatus.STARTING, RunStatus.RUNNING],
            )
            record = await records.get_run(conn, run_id)
        if run_id in self._runs:
            self._runs[run_id].stop_requested.set()
        elif record.host == self.host:
            # Its watcher may be dead: then this hub carries the stop out itself.
            await self._take_over(run_id, record.supervisor)
        return record

    async def describe(self, run_id: str, tail_lines: int = 0) -> dict[str, Any]:
        """The run's record; with `tail_lines`, the end of each process's log too."""
        async with self._engine.connect() as conn:
            record = await records.get_run(conn, run_id)
        body = record.to_json()
        if tail_lines:
            # A trainer that prints its key has it in its own log; the API does not
            # pass it on.
            channel = ModelChannel.from_tinker(self._tinker)
            for shown, process in zip(body["processes"], record.processes):
                lines = await asyncio.to_thread(tail, Path(process.log_path), tail_lines)
                shown["log_tail"] = [channel.redact(line) for line in lines]
        return body

    async def list(self, status: RunStatus | None, limit: int) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            return [r.to_json() for r in await records.list_runs(conn, status, limit)]

    def _watch(self, run: _Run, step: _Step, *args: Any) -> None:
        self._runs[run.run_id] = run
        run.task = asyncio.create_task(run.guarded(step, *args), name=f"run-{run.run_id}")
        run.task.add_done_callback(lambda _: self._runs.pop(run.run_id, None))


class _Run:
    """One run's life in this hub process: launch (or resume) -> monitor -> end."""

    def __init__(
        self,
        supervisor: RunSupervisor,
        run_id: str,
        spec: RunSpec,
        channel: ModelChannel,
        hub_url: str,
        processes: list[SupervisedProcess] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.run_id = run_id
        self.spec = spec
        self.channel = channel
        self.hub_url = hub_url
        self.processes = processes or []
        self.stop_requested = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._engine = supervisor._engine

    @classmethod
    def adopt(cls, supervisor: RunSupervisor, record: RunRecord) -> _Run:
        """A run another hub process started, with the processes it had started."""
        processes = [
            SupervisedProcess.attach(record.run_id, p.role, Path(p.log_path), p.pid, p.start_ticks)
            for p in record.processes
            if p.pid is not None
        ]
        spec = RunSpec.model_validate(record.spec)
        channel = ModelChannel.from_tinker(supervisor._tinker)
        return cls(supervisor, record.run_id, spec, channel, "", processes)

    async def guarded(self, step: _Step, *args: Any) -> None:
        try:
            await step(self, *args)
        except asyncio.CancelledError:
            raise  # the hub is stopping: the processes run on for the next one
        except Exception:
            log.exception("run %s: supervisor error; stopping the run", self.run_id)
            try:
                await self._end(
                    RunStatus.FAILED,
                    "The hub's run supervisor failed (see the hub log); the run's "
                    "processes were stopped.",
                )
            except Exception:
                log.exception("run %s: could not record the failure", self.run_id)

    async def launch(self) -> None:
        outcome = await self._start()
        await self._end(*(outcome or await self._monitor()))

    async def resume(self, status: RunStatus) -> None:
        """Carry on with a run a previous hub process left at `status`."""
        outcome: Outcome
        if status in (RunStatus.PENDING, RunStatus.STARTING):
            # Half a start cannot be finished: its health waits died with that hub.
            outcome = (
                RunStatus.FAILED,
                (
                    "The hub stopped while the run was starting; the processes it had "
                    "started were stopped."
                ),
            )
        elif status == RunStatus.STOPPING:
            outcome = RunStatus.STOPPED, None
        else:
            alive = ", ".join(f"{p.role} pid {p.pid}" for p in self.processes if p.running())
            log.info("run %s: re-attached (%s)", self.run_id, alive or "no process alive")
            outcome = await self._monitor()
        await self._end(*outcome)

    async def _start(self) -> Outcome | None:
        """Start the processes in order, each once the one before is healthy. None
        when all are up; else how the run ends."""
        if not await self._move(RunStatus.STARTING, [RunStatus.PENDING]):
            return RunStatus.STOPPED, None
        logs_dir = self.supervisor._config.logs_dir
        assert self.spec.cwd is not None  # resolved when the run was created
        for position, (role, spec) in enumerate(self.spec.processes()):
            path = log_path(logs_dir, role, self.run_id)
            env = process_env(
                role, spec_env=self.spec.env, channel=self.channel, hub_url=self.hub_url
            )
            try:
                proc = SupervisedProcess.spawn(
                    self.run_id, role, spec.command, cwd=self.spec.cwd, env=env,
                    log_path=path, user=self.supervisor._config.user,
                )
            except OSError as exc:
                return RunStatus.FAILED, f"{_label(role)} could not be started: {exc}"
            self.processes.append(proc)
            await self._record(
                position, pid=proc.pid, start_ticks=proc.start_ticks, started_at=utcnow()
            )
            log.info("run %s: %s started (pid %d), log %s", self.run_id, role, proc.pid, path)
            result = await wait_until_healthy(
                proc,
                spec.health,
                timeout=spec.start_timeout,
                http=self.supervisor._http,
                stop=self.stop_requested,
            )
            if isinstance(result, Interrupted):
                return RunStatus.STOPPED, None
            if isinstance(result, Exited):
                return RunStatus.FAILED, (
                    f"{_label(role)} exited with {describe_exit(result.code)} before it "
                    f"was healthy. Check {path}"
                )
            if isinstance(result, TimedOut):
                return RunStatus.FAILED, f"{_label(role)} {result.reason}. Check {path}"
            assert isinstance(result, Healthy)
            await self._record(position, healthy_at=utcnow())
            if spec.health is not None:
                log.info("run %s: %s is healthy", self.run_id, role)
        if not await self._move(RunStatus.RUNNING, [RunStatus.STARTING]):
            return RunStatus.STOPPED, None  # a stop came in between
        log.info("run %s: running", self.run_id)
        return None

    async def _monitor(self) -> Outcome:
        """Look every poll_interval (or at once when a stop is asked for) until the
        run is over."""
        while True:
            outcome = await self._check()
            if outcome is not None:
                return outcome
            await event_set_within(self.stop_requested, self.spec.poll_interval)

    async def _check(self) -> Outcome | None:
        """What has become of the run since the last look, if it is over."""
        if self.stop_requested.is_set():
            return RunStatus.STOPPED, None
        async with self._engine.connect() as conn:
            # A DELETE answered by another hub sharing the database lands here.
            if await records.status_of(conn, self.run_id) == RunStatus.STOPPING:
                return RunStatus.STOPPED, None
        for proc in self.processes:  # the trainer first: its exit decides the outcome
            if proc.running():
                continue
            code = proc.exit_code()
            if proc.role == "trainer" and code == 0:
                return RunStatus.COMPLETED, None
            if code is None:
                return RunStatus.FAILED, (
                    f"{_label(proc.role)} (pid {proc.pid}) is gone and nothing recorded its "
                    f"exit code (killed with SIGKILL, or the machine restarted). "
                    f"Check {proc.log_path}"
                )
            return RunStatus.FAILED, (
                f"{_label(proc.role)} exited with {describe_exit(code)}. Check {proc.log_path}"
            )
        return None

    async def _end(self, status: RunStatus, message: str | None) -> None:
        """Stop what still runs, environments first, then record how the run ended.
        Processes first: a hub that dies in between leaves the run unfinished in the
        database, and the next one comes to the same end."""
        for position, proc in reversed(list(enumerate(self.processes))):
            await proc.stop(self.spec.stop_timeout)
            async with self._engine.begin() as conn:
                await records.record_exit(conn, self.run_id, position, proc.exit_code())
        async with self._engine.begin() as conn:
            # From whichever unfinished status may end so.
            moved = await records.move(conn, self.run_id, status, error_message=message)
        if moved:
            log.info("run %s: %s%s", self.run_id, status.value, f": {message}" if message else "")

    async def _move(self, status: RunStatus, expected: list[RunStatus]) -> bool:
        async with self._engine.begin() as conn:
            return await records.move(conn, self.run_id, status, expected=expected)

    async def _record(self, position: int, **values: Any) -> None:
        async with self._engine.begin() as conn:
            await records.update_process(conn, self.run_id, position, **values)


def _label(role: str) -> str:
    return "Trainer" if role == "trainer" else f"Environment {role}"


def _alive(owner: str, host: str) -> bool:
    """Whether the hub process named `owner` ("host:pid:start_ticks") still runs."""
    owner_host, _, rest = owner.partition(":")
    pid, _, ticks = rest.partition(":")
    if owner_host != host:
        return True  # not ours to judge
    try:
        return is_running(int(pid), int(ticks) if ticks.isdigit() else None)
    except ValueError:
        return False
