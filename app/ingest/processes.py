"""The ingest processes: where parsing, scoring and tokenizing of traces run, the
validation and deflating of Atropos groups and the reading of OTLP requests, beside
the event loop rather than contending with it for the GIL.

Each process is fed over a socket pair straight from the event loop (length-prefixed
pickles; replies come back in the order sent), without the two helper threads of a
`ProcessPoolExecutor`, whose hand-offs took the serving process's GIL for about a third
as long as the requests did (bench/ingest.py, 5 KB traces: ~650/s with it, ~870/s
without). The calls made in one turn of the event loop go out in one write, and a
process answers the calls that arrived together in one write: each write wakes the
other side, and a wake-up on another CPU costs more than the copy. For the same
reason calls go to the first process while it keeps up, and to the others only when it
falls behind (`_pick`). A process that dies fails only the items it held (503, never
acknowledged) and is replaced on the next call.

No item (a trace, or a call such as one Atropos submission) may hold a process longer
than `limits.max_item_seconds`, so that no parser bug, present or future, can stall
ingestion: each process notes in shared memory which item it is on and since when, a
watchdog kills a process past the limit, that item is answered 422 naming the limit,
and the other items it held go to the other processes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import pickle
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

from app.errors import HubError, Invalid, Unavailable
from app.metrics import INGEST_RESTARTS
from app.outage import Outage
from app.tokens import encoding

if TYPE_CHECKING:
    from app.ingest.ingestor import Preparer
    from app.ingest.inserter import PreparedTrace

Reply = list["PreparedTrace | HubError"]
R = TypeVar("R")

log = logging.getLogger("atropos.ingest")
_HEAD = struct.Struct("!I")  # frame length; bodies are bounded by limits.max_body_bytes

# forkserver: the processes start from a clean server process that has imported the
# hub's code and loaded the tokenizer once, not as forks of a process that runs an
# event loop and threads.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    # app.ingest.preload first: it sets the fork server's signals (see there).
    ["app.ingest.preload", "app.ingest.ingestor", "app.atropos.queue", "app.ingest.otlp.request"]
)
# The signals that stop a hub's process group; its fork server and ingest processes
# outlive them until the serving process closes their pipes.
_STOPS = {signal.SIGINT, signal.SIGTERM}


# What a process is doing, in shared memory: the number of the frame it is on (frames
# are answered in order), the item of that frame, and when it started on that item
# (time.monotonic(), one clock for every process; 0.0 between items).
_FRAME, _ITEM, _SINCE = range(3)


@dataclass(slots=True)
class _Frame:
    """A call sent to a process, kept until answered: it goes to another process if this
    one is stopped for taking too long. `size`: the bytes it was sent as."""

    work: Callable[..., Any]
    args: tuple[Any, ...]
    size: int
    done: asyncio.Future[Any]


@dataclass(eq=False)
class _Process:
    process: BaseProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    progress: Any  # a shared array of 3 doubles: _FRAME, _ITEM, _SINCE
    waiting: deque[_Frame] = field(default_factory=deque)
    outgoing: list[bytes] = field(default_factory=list)  # frames not written yet
    held: int = 0  # bytes of the calls sent and not answered yet (_pick)
    answered: int = 0  # frames answered so far: the number of the one in progress
    task: asyncio.Task[None] | None = None  # reads the replies
    too_slow: tuple[int, int] | None = None  # (frame, item) it was stopped on


class IngestProcesses:
    def __init__(
        self,
        preparer: Preparer,
        processes: int,
        *,
        outage: Outage | None = None,
        start_wait: float | None = None,
    ) -> None:
        """`outage`: where the processes failing to start or dying is said (the hub's);
        `start_wait`: how long a call waits for the processes to start (None: as long as
        they take; 0: not at all, the calls being made here until they are up, unsaid:
        `atropos import`, whose first traces would wait for the fork server to import
        the hub, though its own process has done so already)."""
        self._preparer = preparer
        self._start_wait = start_wait
        self._size = processes
        self._outage = outage or ingest_outage()
        self._processes: list[_Process] = []
        self._starting = asyncio.Lock()
        self._started: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._watchdog: asyncio.Task[None] | None = None
        self._resent: set[asyncio.Task[None]] = set()
        self._closing = False

    def apart(self, processes: int = 1) -> IngestProcesses:
        """Processes of their own, not started, preparing as these do, for work that
        must not wait behind ingest's: the delivery stage's batch files, which waited
        behind every trace the hub had taken in (seconds under load)."""
        return IngestProcesses(self._preparer, processes, outage=self._outage,
                               start_wait=self._start_wait)

    @property
    def pids(self) -> list[int | None]:
        return [proc.process.pid for proc in self._processes]

    def start(self) -> None:
        """Starts the processes in the background (the fork server imports the hub and
        loads the tokenizer first), so that the first trace does not wait."""
        self._filling()

    def _filling(self) -> asyncio.Task[None]:
        """The start of the missing processes, one at a time."""
        if self._started is None or self._started.done():
            self._started = asyncio.create_task(self._start_all(), name="ingest-processes")
            self._started_at = time.monotonic()
        return self._started

    async def _start_all(self) -> None:
        try:
            await self._fill()
        except Exception as exc:
            if self._closing:
                return  # the fork server stopped with the hub's process group
            if not self._outage.failed(exc, "starting the ingest processes"):
                log.exception("the ingest processes did not start; the next trace tries again")

    async def rows(self, items: list[Any], fmt: str | None, *, compressing: bool = False
                   ) -> Reply:
        """Each item's row or the HubError that refuses it, in order (`compressing`:
        Preparer.row's)."""
        return await self.call(_rows, items, fmt, compressing)

    async def call(self, work: Callable[..., R], *args: Any) -> R:
        """work(*args) in an ingest process: `work` is a module-level function (sent
        by name), args and result are pickled. What it raises is raised here."""
        data = pickle.dumps((work, args), protocol=pickle.HIGHEST_PROTOCOL)
        proc = await self._pick()
        if proc is None:
            return await asyncio.to_thread(_inline, self._preparer, work, args)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[R] = loop.create_future()
        if not proc.outgoing:
            loop.call_soon(self._flush, proc)
        proc.outgoing += (_HEAD.pack(len(data)), data)
        proc.waiting.append(_Frame(work, args, len(data), done))
        proc.held += len(data)
        return await done

    @staticmethod
    def _flush(proc: _Process) -> None:
        """The frames of this turn of the event loop, in one write."""
        if not proc.writer.is_closing():
            proc.writer.write(b"".join(proc.outgoing))
        proc.outgoing.clear()

    async def _pick(self) -> _Process | None:
        """The first process that holds less than _SPILL_BYTES of work and has not been
        on one item for _LONG_ITEM_SECONDS, else the one holding the least: while one
        process keeps up the others sleep, and a slow item holds up no other. None
        while none has started within `start_wait`."""
        if self._closing:
            raise Unavailable("the hub is stopping; retry shortly", retry_after=1)
        if len(self._processes) < self._size:  # not started yet, or one died
            filling = self._filling()
            if not self._processes and not await self._first(filling):
                return None
        long_since = time.monotonic() - _LONG_ITEM_SECONDS
        for proc in self._processes:
            if proc.held < _SPILL_BYTES and not 0.0 < proc.progress[_SINCE] < long_since:
                return proc
        return min(self._processes, key=lambda p: p.held)

    async def _first(self, filling: asyncio.Task[None]) -> bool:
        """Waits for the processes to start, until `start_wait` after their start began
        (the hub's is limits.max_write_wait_seconds); False if none has started by then:
        the call is then made in the serving process (in a thread), so that a trace
        sent while the hub starts waits no longer than that bound for its preparing."""
        if self._start_wait == 0:
            return bool(self._processes)
        left = None
        if self._start_wait is not None:
            left = max(0.0, self._started_at + self._start_wait - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(filling), left)
        except TimeoutError:
            self._outage.failed(
                f"none started within {self._start_wait:g} s (limits.max_write_wait_seconds); "
                "preparing in the serving process meanwhile", "starting the ingest processes")
        return bool(self._processes)

    async def _fill(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="ingest-watchdog")
        async with self._starting:
            while len(self._processes) < self._size and not self._closing:
                self._processes.append(await self._start())
        self._outage.works()

    async def _start(self) -> _Process:
        _start_fork_server()
        ours, theirs = socket.socketpair()
        progress = _CONTEXT.RawArray("d", 3)
        process = _CONTEXT.Process(
            target=_serve,
            args=(theirs, self._preparer, progress),
            name="atropos-ingest",
            daemon=True,
        )
        # The first start also starts the fork server (an interpreter importing the
        # hub): off the event loop, in a thread that a stopping hub does not wait for.
        try:
            await _in_daemon_thread(process.start)
        except BaseException:  # abandoned (a stopping hub) or failed: the process, if
            ours.close()       # one is made yet, meets a closed socket and ends
            theirs.close()
            raise
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
                proc.held -= frame.size
                proc.answered += 1
                if frame.done.done():
                    continue
                if isinstance(reply, _Raised):
                    # A HubError refuses the input; anything else is a bug: a 500, as
                    # in-process.
                    frame.done.set_exception(reply.exception)
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
            if not self._closing:  # replaced at the next trace
                INGEST_RESTARTS.labels("died" if proc.too_slow is None else "too_slow").inc()
            await asyncio.to_thread(proc.process.join, 5)
            if proc.too_slow is None:
                self._outage.failed(
                    ProcessStopped(f"exit code {proc.process.exitcode}"),
                    "preparing traces",
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
        which is answered 422: in the rows of a `rows` call, or as the call's answer."""
        try:
            if frame.work is _rows:
                items, fmt, compressing = frame.args
                others = [item for i, item in enumerate(items) if i != too_slow]
                result: Any = await self.rows(
                    others, fmt, compressing=compressing) if others else []
                if 0 <= too_slow:
                    result.insert(too_slow, self._too_slow())
            elif 0 <= too_slow:
                raise self._too_slow()
            else:
                result = await self.call(frame.work, *frame.args)
        except Exception as exc:
            if not frame.done.done():
                frame.done.set_exception(exc)
            return
        if not frame.done.done():
            frame.done.set_result(result)

    def _too_slow(self) -> Invalid:
        limit = self._preparer.limits.max_item_seconds
        return Invalid(
            f"preparing this took longer than limits.max_item_seconds ({limit:g} s); "
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
                # A process answers the frames it read together at once: it may be on
                # one past the oldest unanswered; not on one answered already.
                frame = int(progress[_FRAME])
                unanswered = proc.answered <= frame < proc.answered + len(proc.waiting)
                if now - since > limit and unanswered:
                    proc.too_slow = (frame, int(progress[_ITEM]))
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
        self._closing = True  # no process starts from now on
        if self._started is not None and not self._started.done():
            # A start in progress (the fork server importing the hub, seconds under
            # load) is abandoned, not waited for: a process it makes meets a closed
            # socket and ends.
            self._started.cancel()
            await asyncio.gather(self._started, return_exceptions=True)
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


async def _in_daemon_thread(work: Callable[[], object]) -> None:
    """work() in a daemon thread: unlike asyncio.to_thread's, the interpreter does not
    wait for it at exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    def run() -> None:
        failure: BaseException | None = None
        try:
            work()
        except BaseException as exc:
            failure = exc
        try:
            loop.call_soon_threadsafe(settle, failure)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name="ingest-start", daemon=True).start()
    await done


class ProcessStopped(Exception):
    """An ingest process ended while the hub runs (killed, out of memory)."""


def ingest_outage() -> Outage:
    """The reporter of the ingest processes failing (app/outage.py)."""
    return Outage("the ingest processes",
                  "what they held gets 503, and another starts on the next trace",
                  classify=_process_failure, logger="atropos.ingest", again="work again",
                  plural=True)


def _process_failure(exc: BaseException) -> tuple[str, str] | None:
    """Not starting (no fork, no socket: the system's limits; the fork server gone) or
    one stopping."""
    if isinstance(exc, OSError | EOFError | ProcessStopped):
        return type(exc).__name__, str(exc) or type(exc).__name__
    return None


@dataclass(frozen=True, slots=True)
class _Raised:
    """What a call raised (a reply may itself be an exception, as `rows` answers)."""

    exception: BaseException


# In an ingest process: the preparer it was started with, and its shared progress.
_preparer: Preparer | None = None
_progress: Any = None


def _item_started(index: int) -> None:
    _progress[_SINCE] = 0.0  # so that the item and its start are read together
    _progress[_ITEM] = index
    _progress[_SINCE] = time.monotonic()


def _inline(preparer: Preparer, work: Callable[..., R], args: tuple[Any, ...]) -> R:
    """A call made in the serving process (no ingest process is up yet)."""
    if work is _rows:
        items, fmt, compressing = args
        rows: Any = [preparer.prepare(item, fmt, compressing) for item in items]
        return rows  # type: ignore[no-any-return]
    return work(*args)


def _rows(items: list[Any], fmt: str | None, compressing: bool) -> Reply:
    assert _preparer is not None
    rows: Reply = []
    for index, item in enumerate(items):
        _item_started(index)
        rows.append(_preparer.prepare(item, fmt, compressing))
    return rows


def _start_fork_server() -> None:
    """The fork server, started with SIGINT and SIGTERM blocked: a terminal's Ctrl-C
    and systemd's stop reach the whole process group, and the server would otherwise
    die of them, with a traceback, while it imports the hub. The mask is inherited
    through fork and exec; app.ingest.preload ignores both signals, then unblocks them.
    Blocked, not ignored, here: a signal that arrives meanwhile waits, then stops the
    hub as it would have."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _serve(sock: socket.socket, preparer: Preparer, progress: Any) -> None:
    """An ingest process: reads (work, args), answers work(*args), until EOF (the
    serving process closed its end or died). The frames that arrived together are
    answered together, in one write, unless the first answer would wait longer than
    _HOLD_SECONDS. Notes in `progress` which item it is on (a call
    that is not `rows` is one item)."""
    global _preparer, _progress
    _preparer, _progress = preparer, progress
    # A terminal's Ctrl-C and systemd's stop signal every process of the job: the
    # serving process decides when its ingest processes stop (EOF), once it has answered
    # what it accepted.
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)
    encoding()  # loaded by the fork server already (app/ingest/preload.py); if not, now
    # What exists now lives as long as the process: kept out of the collector's full
    # passes, each of which walks the whole imported hub and holds up every trace in
    # the process meanwhile (the serving process does the same, app/hub.py).
    gc.freeze()
    frames = 0
    received = bytearray()
    with sock:
        while True:
            if not _frame_at(received, 0):
                chunk = sock.recv(_READ)
                if not chunk:
                    return
                received += chunk
                continue
            replies: list[bytes] = []
            held_since = time.monotonic()
            start = 0
            while end := _frame_at(received, start):
                work, args = pickle.loads(received[start + _HEAD.size : end])
                start = end
                progress[_FRAME] = frames
                _item_started(0)
                replies += _answer(work, args)
                progress[_SINCE] = 0.0
                frames += 1
                if time.monotonic() - held_since > _HOLD_SECONDS:
                    sock.sendall(b"".join(replies))
                    replies, held_since = [], time.monotonic()
            del received[:start]
            if replies:
                sock.sendall(b"".join(replies))


# Calls go to the first process until it holds this much work, then to the others.
# Spread evenly, small traces kept every process waking up, more busy processes than
# cores, and the event loop lost its core to them mid-turn (measured with
# bench/wrk_ingest.py: docs/decisions.md, docs/ingest.md). Batches and large traces
# pass it and use every process.
_SPILL_BYTES = 256 * 1024
# A process on one item for longer than this (far longer than a large trace takes) is
# passed over.
_LONG_ITEM_SECONDS = 0.05
# How long answers may wait for the others that arrived with them: a few small traces
# go back in one write, while a batch's chunks, each far more work, go back as they
# are done (the group commit takes the first while the others are prepared).
_HOLD_SECONDS = 0.002
# How much a process reads at once: a large batch arrives in few reads.
_READ = 1 << 20


def _frame_at(received: bytearray, start: int) -> int:
    """Where the frame at `start` of `received` ends, if it is all there; else 0."""
    if len(received) < start + _HEAD.size:
        return 0
    (length,) = _HEAD.unpack_from(received, start)
    end = start + _HEAD.size + length
    return end if len(received) >= end else 0


def _answer(work: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bytes, bytes]:
    """The reply frame (head, body) to one call."""
    reply: Any
    try:
        reply = work(*args)
    except Exception as exc:
        reply = _Raised(exc)
    try:
        frame = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an exception that does not pickle
        frame = pickle.dumps(_Raised(RuntimeError(f"{type(reply).__name__}: {exc}")))
    return _HEAD.pack(len(frame)), frame
