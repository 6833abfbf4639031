"""`atropos import`: trajectory files written by any supported agent framework, stored
through the same pipeline as POST /v1/traces (scored, filtered, deduplicated), either
into the configured database or by POSTing to a running hub."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import httpx

from app import import_sources
from app.access.keys import bearer_from_env
from app.cli.options import Commands, command, ctrl_c_stops
from app.cli.progress import Progress
from app.config import HubConfig, load_config
from app.db.migrate import database
from app.errors import ConfigError, HubError, StartupError
from app.evaluation.environment import Environment
from app.import_sources import Parsed, Record, Unreadable, read_path
from app.ingest.ingestor import Ingestor, running_ingest
from app.ingest.inserter import Stored
from app.tokens import encoding

CHUNK = 64  # traces per database group or per HTTP request
RETRIES_WHEN_BUSY = 20


@dataclass
class Summary:
    stored: int = 0
    duplicates: int = 0
    rejected_traces: int = 0  # stored, at stage rejected
    rejected: Counter[str] = field(default_factory=Counter)  # by filter (one trace: several)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (location, error)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)

    def count(self, location: str, result: Stored | HubError | dict[str, Any]) -> None:
        answer: Mapping[str, Any] = (
            result.to_json() if isinstance(result, (Stored, HubError)) else result)
        if "error" in answer:
            self.refused.append((location, answer["error"]["message"]))
        elif answer.get("duplicate"):
            self.duplicates += 1
        else:
            self.stored += 1
            self.rejected_traces += bool(answer.get("reject_reasons"))
            for reason in answer.get("reject_reasons") or []:
                self.rejected[reason["filter"]] += 1

    @property
    def read(self) -> int:
        return self.stored + self.duplicates + len(self.refused) + len(self.unreadable)

    def lines(self) -> list[str]:
        """One line of counts, then what was rejected by filter, refused or unreadable,
        the unreadable grouped by reason."""
        out = [f"read {self.read}, stored {self.stored}, duplicates {self.duplicates}, "
               f"rejected {self.rejected_traces}, refused {len(self.refused)}, "
               f"unreadable {len(self.unreadable)}"]
        if self.rejected:
            out.append("  rejected by filter: " + ", ".join(
                f"{name} {n}" for name, n in sorted(self.rejected.items())))
        out += [f"  refused {loc}: {why}" for loc, why in self.refused]
        by_reason: dict[str, list[str]] = {}
        for loc, why in self.unreadable:
            by_reason.setdefault(_kind(why), []).append(loc)
        for why, locations in sorted(by_reason.items(), key=lambda item: -len(item[1])):
            shown = ", ".join(locations[:_LOCATIONS_SHOWN])
            more = len(locations) - _LOCATIONS_SHOWN
            out.append(f"  unreadable {len(locations)}: {why} ({shown}"
                       + (f" and {more} more)" if more > 0 else ")"))
        return out


# Where an unreadable reason was met: the first few places, enough to look at one.
_LOCATIONS_SHOWN = 3


def _kind(reason: str) -> str:
    """A reason without the particulars of one record (its numbers, what follows in
    parentheses), so that the records one problem spoils are counted together."""
    return re.sub(r"\d+", "N", reason.split(" (", 1)[0])


def records(paths: Iterable[Path], fmt: str) -> Iterator[Record]:
    for path in paths:
        yield from read_path(path, fmt)


def chunks(items: Iterator[Record], size: int = CHUNK) -> Iterator[list[Record]]:
    while chunk := list(islice(items, size)):
        yield chunk


def body(record: Parsed) -> dict[str, Any]:
    """An imported trace as the native item it is stored (and POSTed) as; where it
    came from is kept in its metadata."""
    trace = record.trace
    item = trace.model_dump(mode="json", exclude_none=True, exclude={"source_format"})
    item["metadata"] = {
        **trace.metadata,
        "imported_from": {"format": trace.source_format, "location": record.location},
    }
    return item | {"format": "native"}


async def import_into_database(
    ingestor: Ingestor, chunk: list[Record], summary: Summary
) -> None:
    parsed = _split(chunk, summary)
    results = await ingestor.ingest_many([body(p) for p in parsed])
    for record, result in zip(parsed, results):
        summary.count(record.location, result)


async def import_over_http(
    client: httpx.AsyncClient, endpoint: str, chunk: list[Record], summary: Summary
) -> None:
    parsed = _split(chunk, summary)
    if not parsed:
        return
    payload = {"traces": [body(p) for p in parsed]}
    response = await client.post(endpoint, json=payload)
    for _ in range(RETRIES_WHEN_BUSY):
        # 429 (rate limit) and 503 (write path full) say when to come back.
        if response.status_code not in (429, 503) or "retry-after" not in response.headers:
            break
        await asyncio.sleep(float(response.headers["retry-after"]))
        response = await client.post(endpoint, json=payload)
    if response.status_code != 207:
        raise StartupError(f"the hub answered {response.status_code}: {response.text[:300]}")
    for record, result in zip(parsed, response.json()["results"]):
        summary.count(record.location, result)


def _split(chunk: list[Record], summary: Summary) -> list[Parsed]:
    parsed = []
    for record in chunk:
        if isinstance(record, Unreadable):
            summary.unreadable.append((record.location, record.reason))
        else:
            parsed.append(record)
    return parsed


# --- the command ----------------------------------------------------------------


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    imp = command(commands, "import", _import,
                  example="atropos import --config config.json runs/tau-bench/ "
                          "--url http://127.0.0.1:8000")
    imp.add_argument("paths", nargs="+", type=Path, help="files or folders of trajectories")
    imp.add_argument("--format", default="auto", help="an adapter name, or auto (default)")
    imp.add_argument("--url", help="POST to this running hub instead of the database")
    imp.add_argument(
        "--api-key-env",
        default="ATROPOS_API_KEY",
        help="with --url: the environment variable holding the hub's API key "
        "(default ATROPOS_API_KEY; unset: none is sent)",
    )
    imp.add_argument("--strict", action="store_true", help="an unreadable record fails the run")


async def _import(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.format != "auto" and args.format not in import_sources.formats():
        known = ", ".join(import_sources.formats())
        raise ConfigError(f"--format {args.format}: unknown; one of auto, {known}")
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        raise StartupError(f"no such file or folder: {', '.join(missing)}")
    summary = Summary()
    progress = Progress("imported")
    with ctrl_c_stops() as stopping:
        batches = _until(stopping, chunks(records(args.paths, args.format)))
        if args.url:
            await _over_http(args, config, batches, summary, progress)
        else:
            await _into_database(config, batches, summary, progress)
    progress.close()
    for line in summary.lines():
        print(line)
    if stopping.is_set():
        print("interrupted (Ctrl-C): the traces counted above are stored; the rest were not "
              "read. Importing the same paths again stores the rest (the stored ones come "
              "back as duplicates)")
        return 130
    nothing_read = summary.read == len(summary.unreadable)
    failed = nothing_read or summary.refused or (args.strict and summary.unreadable)
    if nothing_read:
        print("nothing could be read from " + ", ".join(map(str, args.paths)), file=sys.stderr)
    return 1 if failed else 0


def _until(stopping: asyncio.Event, batches: Iterator[list[Record]]) -> Iterator[list[Record]]:
    """The chunks, until Ctrl-C: the chunk in hand is stored and counted first."""
    for chunk in batches:
        if stopping.is_set():
            return
        yield chunk


async def _over_http(
    args: argparse.Namespace,
    config: HubConfig,
    batches: Iterator[list[Record]],
    summary: Summary,
    progress: Progress,
) -> None:
    headers = bearer_from_env(args.api_key_env)
    async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=headers) as client:
        for chunk in batches:
            try:
                await import_over_http(client, config.trace_server.endpoint, chunk, summary)
            except httpx.TransportError as exc:
                raise StartupError(
                    f"cannot reach the hub at {args.url} ({_transport_reason(exc)}): is it "
                    "running (atropos serve)? check --url"
                ) from exc
            progress.advance(len(chunk))


def _transport_reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused" if "refused" in str(exc).lower() else "cannot connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return type(exc).__name__


async def _into_database(
    config: HubConfig, batches: Iterator[list[Record]], summary: Summary, progress: Progress
) -> None:
    environment = Environment.from_config(config.environment)
    encoding()
    async with (
        database(config) as engine,
        running_ingest(engine, config, environment, admitted=False, start_wait=0) as ingest,
    ):
        for chunk in batches:
            await import_into_database(ingest.ingestor, chunk, summary)
            progress.advance(len(chunk))
