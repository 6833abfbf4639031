"""OTLP benchmark: 8 concurrent senders post what OpenTelemetry exporters post
(batches of 512 spans of about 1 KB, protobuf) to a real `atropos serve`, then to
Arize Phoenix with the same load, each for a fixed time. Prints, for each, spans
acknowledged per second and spans stored when acknowledged; for the hub, also how long
after its last span was acknowledged each run became a trajectory (p50, p99), against
otlp.quiet_seconds + 5 s.

The spans are agent runs of 32 spans each, as the GenAI conventions write them: an
invoke_agent root, 16 chat spans (each repeating the conversation so far) and 15
execute_tool spans, ended children first.

    python bench/otlp.py                                     # the hub alone, 15 s
    python bench/otlp.py --phoenix /tmp/phoenix/bin/phoenix  # and Phoenix beside it

Phoenix is not a dependency of the hub: install it in a venv of its own,
`python -m venv /tmp/phoenix && /tmp/phoenix/bin/pip install arize-phoenix==20.26.1`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from app.formats.otlp import wire  # noqa: E402

BATCH = 512
SENDERS = 8
ROUNDS = 15  # tool calls per run: 1 + 16 + 15 = 32 spans


# --- the load ---------------------------------------------------------------------------


def _kv(key: str, value: str | int) -> KeyValue:
    any_value = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(
        string_value=value)
    return KeyValue(key=key, value=any_value)


def _span(name: str, sid: bytes, parent: bytes, start: int, attrs: dict[str, Any]) -> Span:
    return Span(trace_id=_TRACE, span_id=sid, parent_span_id=parent, name=name,
                kind=Span.SPAN_KIND_CLIENT, start_time_unix_nano=start,
                end_time_unix_nano=start + 900_000,
                attributes=[_kv(k, v) for k, v in attrs.items()])


# Placeholders in the template run, replaced by fresh ids in each copy (same lengths,
# so the protobuf encoding stays valid).
_TRACE = bytes(range(100, 116))
_IDS = [bytes([200, i, 1, 2, 3, 4, 5, 6]) for i in range(2 * ROUNDS + 2)]


def template_run() -> list[bytes]:
    """One run's spans, encoded, in the order an exporter sends them (children end
    first, the root last)."""
    root, t0 = _IDS[0], time.time_ns()
    said: list[dict[str, Any]] = [{"role": "user", "parts": [{"type": "text", "content":
        "Find why the nightly build of service api-gateway fails, fix it, and confirm."}]}]
    spans: list[Span] = []
    for r in range(ROUNDS + 1):
        call = f"call_{r:02d}"
        answer = {"role": "assistant", "parts": [
            {"type": "tool_call", "id": call, "name": "terminal",
             "arguments": {"command": f"make -C build target_{r}"}}
        ] if r < ROUNDS else [{"type": "text", "content": "The build passes again."}]}
        spans.append(_span("chat qwen3-8b", _IDS[1 + 2 * r], root, t0 + r * 10**7, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen3-8b",
            "gen_ai.provider.name": "openai", "gen_ai.usage.input_tokens": 40 * (r + 1),
            "gen_ai.usage.output_tokens": 20,
            "gen_ai.input.messages": json.dumps(said[-6:]),  # a sliding window, as agents keep
            "gen_ai.output.messages": json.dumps([answer]),
        }))
        said.append(answer)
        if r == ROUNDS:
            break
        result = f"target_{r}: " + " ".join(f"cc -c src/m{j}.c ok;" for j in range(12))
        spans.append(_span("execute_tool terminal", _IDS[2 + 2 * r], root,
                           t0 + r * 10**7 + 5 * 10**6, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "terminal",
            "gen_ai.tool.call.id": call,
            "gen_ai.tool.call.arguments": json.dumps({"command": f"make -C build target_{r}"}),
            "gen_ai.tool.call.result": result,
        }))
        said.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": call,
                                                "response": result}]})
    spans.append(_span("invoke_agent build-fixer", root, b"", t0 - 10**6, {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "build-fixer"}))
    return [s.SerializeToString() for s in spans]


@dataclass
class Stream:
    """One sender's spans: runs after runs, cut into exporter batches."""

    template: list[list[bytes | int]]  # each span: its bytes, and slots for fresh ids
    resource: bytes
    scope: bytes
    runs: list[str] = field(default_factory=list)  # trace ids, in order
    pending: list[tuple[str, bytes]] = field(default_factory=list)  # (trace id, span)

    def batch(self) -> tuple[bytes, list[str]]:
        """The next batch's body, and the runs whose last span it carries."""
        while len(self.pending) < BATCH:
            trace_id = os.urandom(16)
            ids = [trace_id, *(os.urandom(8) for _ in _IDS)]
            tid = trace_id.hex()
            self.pending += [(tid, b"".join(p if isinstance(p, bytes) else ids[p] for p in pieces))
                             for pieces in self.template]
        batch, self.pending = self.pending[:BATCH], self.pending[BATCH:]
        following = batch[1:] + (self.pending[:1] or [("", b"")])
        done = [tid for (tid, _), nxt in zip(batch, following) if nxt[0] != tid]
        body = wire.join([(self.resource, self.scope, [span for _, span in batch])])
        return body, done


def new_stream(template: list[bytes]) -> Stream:
    resource = ResourceSpans(resource=Resource(attributes=[_kv("service.name", "bench-agent")]))
    scope = ScopeSpans(scope=InstrumentationScope(name="bench"))
    slotted = [_slots(span) for span in template]
    return Stream(slotted, resource.SerializeToString(), scope.SerializeToString())


def _slots(span: bytes) -> list[bytes | int]:
    """The span's encoding cut at its placeholders: slot 0 the trace id, n the nth span id."""
    placeholders = [_TRACE, *_IDS]
    pieces: list[bytes | int] = []
    rest = span
    while True:
        found = [(rest.find(p), n) for n, p in enumerate(placeholders) if p in rest]
        if not found:
            return [*pieces, rest]
        at, n = min(found)
        pieces += [rest[:at], n]
        rest = rest[at + len(placeholders[n]):]


@dataclass
class Sent:
    spans: int = 0
    seconds: float = 0
    errors: dict[int, int] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)  # trace id -> wall time of its ack


async def sender(port: int, path: str, stream: Stream, until: float, sent: Sent) -> None:
    """Posts batch after batch; a batch refused with 429/503 is sent again after its
    Retry-After, as exporters do."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body, done = stream.batch()
    while time.perf_counter() < until:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/x-protobuf\r\nContent-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode() + body)
        status = int((await reader.readline()).split()[1])
        length, retry_after = 0, 1.0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"retry-after":
                retry_after = float(value)
        await reader.readexactly(length)
        if status == 200:
            sent.spans += BATCH
            now = time.time()
            sent.finished.update((tid, now) for tid in done)
            body, done = stream.batch()
            continue
        sent.errors[status] = sent.errors.get(status, 0) + 1
        if status in (429, 503):
            await asyncio.sleep(min(retry_after, until - time.perf_counter()))
        else:  # not retryable: these spans are dropped, as an exporter drops them
            stream.pending = []  # the half-sent runs would never complete
            body, done = stream.batch()
    writer.close()


async def send(port: int, path: str, seconds: float, template: list[bytes]) -> Sent:
    sent = Sent()
    started = time.perf_counter()
    await asyncio.gather(*(sender(port, path, new_stream(template), started + seconds, sent)
                           for _ in range(SENDERS)))
    sent.seconds = time.perf_counter() - started
    return sent


# --- the servers ---------------------------------------------------------------------------


def start(command: list[str], env: dict[str, str], ready: str, log: Path) -> subprocess.Popen[Any]:
    out = open(log, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{command[0]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time (user + system) of process `pid`, and of its descendants (the hub's
    ingest processes and their fork server), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, grew = {pid}, True
    while grew:
        more = {p for p, (parent, _) in stats.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    own = stats.get(pid, (0, 0.0))[1]
    return own, sum(stats[p][1] for p in tree if p != pid and p in stats)


def spent(before: tuple[float, float], after: tuple[float, float]) -> float:
    """CPU seconds between two `cpu_seconds` readings, the process and its children."""
    return sum(after) - sum(before)


def count(db: Path, sql: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return int(conn.execute(sql).fetchone()[0])


def run_hub(args: argparse.Namespace, template: list[bytes], work: Path) -> None:
    db = work / "hub.db"
    config = {
        "trace_server": {"host": "127.0.0.1", "port": args.port, "db_path": str(db)},
        "otlp": {"quiet_seconds": args.quiet_seconds, "max_wait_seconds": 600},
        # Batching and delivery are later stages: no run reaches the threshold here.
        "distributor": {"target": "jsonl", "output_dir": str(work / "batches"),
                        "min_reward_threshold": 1e9},
    }
    (work / "config.json").write_text(json.dumps(config))
    # Compression is a later stage, with a cost of its own (bench/compress.py): off here.
    (work / "compression.json").write_text(json.dumps({"compression": {"enabled": False}}))
    proc = start([sys.executable, "-m", "app.cli", "serve", "--config", str(work / "config.json"),
                  "--compression", str(work / "compression.json")],
                 {"PYTHONPATH": str(ROOT)}, "Compression pipeline ready", work / "hub.log")
    try:
        cpu = [cpu_seconds(proc.pid)]
        sent = asyncio.run(send(args.port, "/v1/traces", args.seconds, template))
        stored = count(db, "SELECT count(*) FROM otlp_spans")
        cpu.append(cpu_seconds(proc.pid))
        runs = len(sent.finished)
        deadline = time.monotonic() + args.quiet_seconds + 300
        while count(db, "SELECT count(*) FROM traces") < runs and time.monotonic() < deadline:
            time.sleep(0.5)
        cpu.append(cpu_seconds(proc.pid))
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            created = dict(conn.execute("SELECT trace_id, created_at FROM traces"))
    finally:
        proc.terminate()
        proc.wait(60)
    delays = sorted(
        datetime.fromisoformat(created[tid]).replace(tzinfo=UTC).timestamp() - acked
        for tid, acked in sent.finished.items() if tid in created
    )
    qs = statistics.quantiles(delays, n=100) if len(delays) > 1 else [float("nan")] * 99
    print(f"atropos-hub: {sent.spans / sent.seconds:,.0f} spans/s acknowledged, "
          f"{stored:,} of {sent.spans:,} stored when acknowledged; "
          f"refused (status: requests) {sent.errors}")
    print(f"  runs: {runs:,} complete, {len(delays):,} assembled; trajectory after its last "
          f"span: p50 {qs[49]:.1f} s, p99 {qs[98]:.1f} s "
          f"(target: quiet_seconds {args.quiet_seconds:g} + 5 s)")
    # CPU time, not wall time: the figures that do not depend on what else the machine
    # runs (the wall-time rates above do: read them as ratios within one run).
    loading, total = spent(cpu[0], cpu[1]), spent(cpu[0], cpu[2])
    print(f"  CPU: {sent.spans / loading:,.0f} spans acknowledged per CPU-second while the "
          f"load ran ({loading:.1f} s); {sent.spans / total:,.0f} received and assembled per "
          f"CPU-second ({total:.1f} s in all: {cpu[2][0] - cpu[0][0]:.1f} s the serving "
          f"process, {cpu[2][1] - cpu[0][1]:.1f} s the ingest processes)")


def run_phoenix(args: argparse.Namespace, template: list[bytes], work: Path) -> None:
    phoenix = Path(args.phoenix)
    env = {"PHOENIX_WORKING_DIR": str(work / "phoenix"), "PHOENIX_PORT": str(args.port + 1),
           "PHOENIX_GRPC_PORT": str(args.port + 2), "PHOENIX_HOST": "127.0.0.1"}
    proc = start([str(phoenix), "serve"], env, "Application startup complete",
                 work / "phoenix.log")
    db = work / "phoenix" / "phoenix.db"
    try:
        cpu = [cpu_seconds(proc.pid)]
        sent = asyncio.run(send(args.port + 1, "/v1/traces", args.seconds, template))
        stored = count(db, "SELECT count(*) FROM spans")
        cpu.append(cpu_seconds(proc.pid))
        time.sleep(args.settle)  # not a wait for a condition: Phoenix is given this long
        later = count(db, "SELECT count(*) FROM spans")
        cpu.append(cpu_seconds(proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"arize-phoenix: {sent.spans / sent.seconds:,.0f} spans/s acknowledged, "
          f"{stored:,} of {sent.spans:,} stored when acknowledged "
          f"({later:,} {args.settle:g} s later); refused (status: requests) {sent.errors}")
    loading, total = spent(cpu[0], cpu[1]), spent(cpu[0], cpu[2])
    print(f"  CPU: {sent.spans / loading:,.0f} spans acknowledged per CPU-second while the "
          f"load ran ({loading:.1f} s); {later / total:,.0f} stored per CPU-second "
          f"({total:.1f} s in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--quiet-seconds", type=float, default=2,
                        help="the hub's otlp.quiet_seconds (default 10 in config.json)")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--phoenix", help="the `phoenix` executable (arize-phoenix)")
    parser.add_argument("--settle", type=float, default=30,
                        help="seconds after the load to count Phoenix's spans again")
    args = parser.parse_args()
    template = template_run()
    sizes = [len(s) for s in template]
    print(f"otlp: {SENDERS} senders, batches of {BATCH} spans, runs of {len(template)} spans "
          f"({statistics.mean(sizes):,.0f} bytes a span on average), {args.seconds:g} s each")
    with tempfile.TemporaryDirectory() as tmp:
        run_hub(args, template, Path(tmp))
        if args.phoenix:
            run_phoenix(args, template, Path(tmp))
    print("reproduce: python bench/otlp.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
