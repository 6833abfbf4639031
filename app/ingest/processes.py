"""The ingest processes: where parsing, scoring and tokenizing run, beside the event
loop rather than contending with it for the GIL.

Each process is fed over a socket pair straight from the event loop (length-prefixed
pickles; replies come back in the order sent), without the two helper threads of a
`ProcessPoolExecutor`, whose hand-offs took the serving process's GIL for about a third
as long as the requests did (bench/ingest.py, 5 KB traces: ~650/s with it, ~870/s
without). A process that dies fails only the items it held (503, never acknowledged)
and is replaced on the next call.

No item may hold a process longer than `limits.max_item_seconds`, so that no parser
bug, present or future, can stall ingestion: each process notes in shared memory which
item it is on and since when, a watchdog kills a process past the limit, that item is
answered 422 naming the limit, and the other items it held go to the other processes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from app.errors import HubError, Invalid, Unavailable
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


# What a process is doing, in shared memory: the number of the frame it is on (frames
# are answered in order), the item of that frame, and when it started on that item
# (time.monotonic(), one clock for every process; 0.0 between items).
_FRAME, _ITEM, _SINCE = range(3)


@dataclass(slots=True)
class _Frame:
    """Items sent to a process in one message, kept until answered: they go to another
    process if this one is stopped for taking too long."""

    items: list[Any]
    fmt: str | None
    done: asyncio.Future[Reply]


@dataclass(eq=False)
class _Process:
    process: BaseProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    progress: Any  # a shared array of 3 doubles: _FRAME, _ITEM, _SINCE
    waiting: deque[_Frame] = field(default_factory=deque)
    items: int = 0  # items sent and not yet answered: the next call goes to the fewest
    answered: int = 0  # frames answered so far: the number of the one in progress
    task: asyncio.Task[None] | None = None  # reads the replies
    too_slow: tuple[int, int] | None = None  # (frame, item) it was stopped on


class IngestProcesses:
    def __init__(self, preparer: Preparer, processes: int) -> None:
        self._preparer = preparer
        self._size = processes
        self._processes: list[_Process] = []
        self._starting = asyncio.Lock()
        self._started: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._resent: set[asyncio.Task[None]] = set()
        self._closing = False

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
        except Exception as exc:
            log.error("the ingest processes did not start (%s); the next trace tries again", exc)

    async def rows(self, items: list[Any], fmt: str | None) -> Reply:
        """Each item's row or the HubError that refuses it, in order."""
        done: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        await self._send(_Frame(items, fmt, done))
        return await done

    async def _send(self, frame: _Frame) -> None:
        proc = await self._least_busy()
        data = pickle.dumps((frame.items, frame.fmt), protocol=pickle.HIGHEST_PROTOCOL)
        proc.writer.write(_HEAD.pack(len(data)) + data)
        proc.waiting.append(frame)
        proc.items += len(frame.items)

    async def _least_busy(self) -> _Process:
        if self._closing:
            raise Unavailable("the hub is stopping; retry shortly", retry_after=1)
        if len(self._processes) < self._size:
            await self._fill()  # not started yet, or one died
        return min(self._processes, key=lambda p: p.items)

    async def _fill(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="ingest-watchdog")
        async with self._starting:
            while len(self._processes) < self._size:
                self._processes.append(await self._start())

    async def _start(self) -> _Process:
        ours, theirs = socket.socketpair()
        progress = _CONTEXT.RawArray("d", 3)
        process = _CONTEXT.Process(
            target=_serve,
            args=(theirs, self._preparer, progress),
            name="atropos-ingest",
            daemon=True,
        )
        # The first start also starts the fork server (an interpreter importing the
        # hub): off the event loop.
        await asyncio.to_thread(process.start)
        theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        proc = _Process(process, reader, writer, progress)
        proc.task = asyncio.create_task(self._read_replies(proc), name="ingest-replies")
        return proc

    async def _read_replies(self, proc: _Process) -> None:
        try:
            while True:
                (length,) = _HEAD.unpack(await proc.reader.readexactly(_HEAD.size))
                reply = pickle.loads(await proc.reader.readexactly(length))
                frame = proc.waiting.popleft()
                proc.items -= len(frame.items)
                proc.answered += 1
                if frame.done.done():
                    continue
                if isinstance(reply, BaseException):
                    frame.done.set_exception(reply)  # a bug in preparing: a 500, as in-process
                else:
                    frame.done.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            await self._lost(proc)

    async def _lost(self, proc: _Process) -> None:
        """The process died (killed, out of memory): what it held was never acknowledged.
        Stopped by the watchdog, it held one item too slow and others that were not:
        those are prepared again by the other processes."""
        if proc in self._processes:
            self._processes.remove(proc)
            await asyncio.to_thread(proc.process.join, 5)
            if proc.too_slow is None:
                log.error(
                    "an ingest process stopped (exit code %s); another starts on the next "
                    "trace",
                    proc.process.exitcode,
                )
        for number, frame in enumerate(proc.waiting, start=proc.answered):
            if frame.done.done():
                continue
            if proc.too_slow is None or self._closing:
                frame.done.set_exception(
                    Unavailable("an ingest process stopped while preparing this trace; retry")
                )
                continue
            slow_frame, slow_item = proc.too_slow
            task = asyncio.create_task(
                self._resend(frame, slow_item if number == slow_frame else -1)
            )
            self._resent.add(task)
            task.add_done_callback(self._resent.discard)
        proc.waiting.clear()
        proc.writer.close()

    async def _resend(self, frame: _Frame, too_slow: int) -> None:
        """`frame` again, on another process, but for its item `too_slow` (-1: none),
        which is answered 422."""
        others = [item for i, item in enumerate(frame.items) if i != too_slow]
        try:
            rows = await self.rows(others, frame.fmt) if others else []
        except Exception as exc:
            if not frame.done.done():
                frame.done.set_exception(exc)
            return
        if 0 <= too_slow:
            rows.insert(too_slow, self._too_slow())
        if not frame.done.done():
            frame.done.set_result(rows)

    def _too_slow(self) -> Invalid:
        limit = self._preparer.limits.max_item_seconds
        return Invalid(
            f"preparing this trace took longer than limits.max_item_seconds ({limit:g} s); "
            "it was stopped",
            field="limits.max_item_seconds",
            code="too_slow",
        )

    async def _watch(self) -> None:
        """Stops a process that has spent longer than limits.max_item_seconds on one
        item: killed, it is replaced like any process that dies."""
        limit = self._preparer.limits.max_item_seconds
        every = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for proc in self._processes:
                progress = proc.progress
                since = progress[_SINCE]
                if not proc.waiting or proc.too_slow is not None or since == 0.0:
                    continue
                if now - since > limit and int(progress[_FRAME]) == proc.answered:
                    proc.too_slow = (proc.answered, int(progress[_ITEM]))
                    log.warning(
                        "an ingest process spent over %g s on one trace "
                        "(limits.max_item_seconds); it is stopped and replaced",
                        limit,
                    )
                    proc.process.kill()

    async def close(self, timeout: float = 10) -> None:
        """Ends each process once it has answered what it was sent (by then, normally
        nothing: the server has finished its requests); one still busy after `timeout`
        seconds is killed."""
        if self._started is not None:
            await self._started  # a process being started is then closed with the rest
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
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


def _serve(sock: socket.socket, preparer: Preparer, progress: Any) -> None:
    """An ingest process: reads (items, fmt), answers their rows, until EOF (the serving
    process closed its end or died). Notes in `progress` which item it is on."""
    # A terminal's Ctrl-C and systemd's stop signal every process of the job: the
    # serving process decides when its ingest processes stop (EOF), once it has answered
    # what it accepted.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    encoding()  # loaded by the fork server already (app/ingest/preload.py); if not, now
    frames = 0
    with sock, sock.makefile("rb") as stream:
        while head := stream.read(_HEAD.size):
            (length,) = _HEAD.unpack(head)
            items, fmt = pickle.loads(stream.read(length))
            progress[_FRAME] = frames
            rows: Reply = []
            reply: Reply | BaseException = rows
            try:
                for index, item in enumerate(items):
                    progress[_SINCE] = 0.0  # so that the item and its start are read together
                    progress[_ITEM] = index
                    progress[_SINCE] = time.monotonic()
                    rows.append(preparer.prepare(item, fmt))
            except Exception as exc:
                reply = exc
            progress[_SINCE] = 0.0
            frames += 1
            try:
                frame = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # an exception that does not pickle
                frame = pickle.dumps(RuntimeError(f"{type(reply).__name__}: {exc}"))
            sock.sendall(_HEAD.pack(len(frame)) + frame)
