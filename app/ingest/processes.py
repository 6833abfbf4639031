"""The ingest processes: where parsing, scoring and tokenizing run, beside the event
loop rather than contending with it for the GIL.

Each process is fed over a socket pair straight from the event loop (length-prefixed
pickles; replies come back in the order sent), without the two helper threads of a
`ProcessPoolExecutor`, whose hand-offs took the serving process's GIL for about a third
as long as the requests did (bench/ingest.py, 5 KB traces: ~650/s with it, ~870/s
without). A process that dies fails only the items it held (503, never acknowledged)
and is replaced on the next call.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from app.errors import HubError, Unavailable
from app.ingest.tokens import encoding

if TYPE_CHECKING:
    from app.ingest.ingestor import Preparer

Row = dict[str, Any]
Reply = list[Row | HubError]

log = logging.getLogger("atropos.ingest")
_HEAD = struct.Struct("!I")  # frame length; bodies are bounded by limits.max_body_bytes

# forkserver: the processes start from a clean server process that has imported the
# hub's code and loaded the tokenizer once, not as forks of a process that runs an
# event loop and threads.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["app.ingest.ingestor", "app.ingest.preload"])


@dataclass(eq=False)
class _Process:
    process: BaseProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    waiting: deque[tuple[int, asyncio.Future[Reply]]] = field(default_factory=deque)
    items: int = 0  # items sent and not yet answered: the next call goes to the fewest
    task: asyncio.Task[None] | None = None  # reads the replies


class IngestProcesses:
    def __init__(self, preparer: Preparer, processes: int) -> None:
        self._preparer = preparer
        self._size = processes
        self._processes: list[_Process] = []
        self._starting = asyncio.Lock()
        self._started: asyncio.Task[None] | None = None

    @property
    def pids(self) -> list[int | None]:
        return [proc.process.pid for proc in self._processes]

    def start(self) -> None:
        """Starts the processes in the background (~1 s: the fork server imports the hub
        and loads the tokenizer first), so that the first trace does not wait."""
        self._started = asyncio.create_task(self._start_all(), name="ingest-processes")

    async def _start_all(self) -> None:
        try:
            await self._fill()
        except OSError as exc:  # no fork, no socket: the system's limits
            log.error("the ingest processes did not start (%s); the next trace tries again", exc)
        except Exception:
            log.exception("the ingest processes did not start; the next trace tries again")

    async def rows(self, items: list[Any], fmt: str | None) -> Reply:
        """Each item's row or the HubError that refuses it, in order."""
        proc = await self._least_busy()
        done: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        frame = pickle.dumps((items, fmt), protocol=pickle.HIGHEST_PROTOCOL)
        proc.writer.write(_HEAD.pack(len(frame)) + frame)
        proc.waiting.append((len(items), done))
        proc.items += len(items)
        return await done

    async def _least_busy(self) -> _Process:
        if len(self._processes) < self._size:
            await self._fill()  # not started yet, or one died
        return min(self._processes, key=lambda p: p.items)

    async def _fill(self) -> None:
        async with self._starting:
            while len(self._processes) < self._size:
                self._processes.append(await self._start())

    async def _start(self) -> _Process:
        ours, theirs = socket.socketpair()
        process = _CONTEXT.Process(
            target=_serve, args=(theirs, self._preparer), name="atropos-ingest", daemon=True
        )
        # The first start also starts the fork server (an interpreter importing the
        # hub): off the event loop.
        await asyncio.to_thread(process.start)
        theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        proc = _Process(process, reader, writer)
        proc.task = asyncio.create_task(self._read_replies(proc), name="ingest-replies")
        return proc

    async def _read_replies(self, proc: _Process) -> None:
        try:
            while True:
                (length,) = _HEAD.unpack(await proc.reader.readexactly(_HEAD.size))
                reply = pickle.loads(await proc.reader.readexactly(length))
                count, done = proc.waiting.popleft()
                proc.items -= count
                if done.done():
                    continue
                if isinstance(reply, BaseException):
                    done.set_exception(reply)  # a bug in preparing: a 500, as in-process
                else:
                    done.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            await self._lost(proc)

    async def _lost(self, proc: _Process) -> None:
        """The process died (killed, out of memory): what it held was never acknowledged."""
        if proc in self._processes:
            self._processes.remove(proc)
            await asyncio.to_thread(proc.process.join, 5)
            log.error(
                "an ingest process stopped (exit code %s); another starts on the next trace",
                proc.process.exitcode,
            )
        while proc.waiting:
            _, done = proc.waiting.popleft()
            if not done.done():
                done.set_exception(
                    Unavailable("an ingest process stopped while preparing this trace; retry")
                )
        proc.writer.close()

    async def close(self, timeout: float = 10) -> None:
        """Ends each process once it has answered what it was sent (by then, normally
        nothing: the server has finished its requests); one still busy after `timeout`
        seconds is killed."""
        if self._started is not None:
            await self._started  # a process being started is then closed with the rest
        processes, self._processes = self._processes, []
        for proc in processes:
            proc.writer.write_eof()
        for proc in processes:
            assert proc.task is not None
            try:
                await asyncio.wait_for(asyncio.shield(proc.task), timeout)
            except TimeoutError:
                proc.process.kill()
                await proc.task  # the kill ends its socket: what it held fails with 503
            await asyncio.to_thread(proc.process.join, 5)
            proc.writer.close()


def _serve(sock: socket.socket, preparer: Preparer) -> None:
    """An ingest process: reads (items, fmt), answers their rows, until EOF (the serving
    process closed its end or died)."""
    # A terminal's Ctrl-C and systemd's stop signal every process of the job: the
    # serving process decides when its ingest processes stop (EOF), once it has answered
    # what it accepted.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    encoding()  # loaded by the fork server already (app/ingest/preload.py); if not, now
    with sock, sock.makefile("rb") as stream:
        while head := stream.read(_HEAD.size):
            (length,) = _HEAD.unpack(head)
            items, fmt = pickle.loads(stream.read(length))
            reply: Reply | BaseException
            try:
                reply = preparer.rows(items, fmt)
            except Exception as exc:
                reply = exc
            try:
                frame = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # an exception that does not pickle
                frame = pickle.dumps(RuntimeError(f"{type(reply).__name__}: {exc}"))
            sock.sendall(_HEAD.pack(len(frame)) + frame)
