"""Prometheus metrics (prometheus_client): what the hub counts as it works, and what
GET /metrics serves.

Counters and histograms are recorded where the work happens, by the process doing it
(an ingest, a delivery, a commit): one add, or one histogram bucket, each. Figures of
what the database holds (traces by stage, backlogs, batches, the Atropos queue) are
read when Prometheus scrapes (`database_families`), so they are right whichever
process changed the rows.

Several processes: with PROMETHEUS_MULTIPROC_DIR set to a directory (empty, and the
same for every `atropos serve` and `atropos worker` on the machine, before they start),
each process keeps its counters in a file there and /metrics of any of them serves the
sum over all of them (prometheus_client's multi-process mode). Without it, /metrics
serves the counters of the process that answers, with its process_* and python_*
metrics.

Names and labels are listed in docs/metrics.md; docs/grafana-dashboard.json is built
on them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, Generic, TypeVar

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.domain import ELIGIBLE, BatchState, Stage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No `_created` series beside every counter: a timestamp per series that dashboards
# do not use, doubling what Prometheus stores.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds. Requests: most are milliseconds, a large batch or a locked database seconds.
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# A commit: a millisecond on a quiet disk, seconds behind a lock.
_COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# A delivery: a file write, an HTTP call, or a training job that polls for an hour.
_DELIVERY_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600)

# Every metric has a label, so that a process that never records one (an ingest
# process importing this module) creates no file for it in multi-process mode.
HTTP_REQUESTS = Histogram(
    "atropos_http_request_duration_seconds",
    "HTTP requests, by method, route template and status: their time from the first "
    "byte read to the last byte written (the _count is the number of requests)",
    ["method", "route", "status"],
    buckets=_REQUEST_BUCKETS,
)
TRACES_INGESTED = Counter(
    "atropos_traces_ingested",
    "Traces received (POST /v1/traces, atropos import), by format and outcome: accepted, "
    "rejected (stored, by a filter), duplicate (already stored), refused (4xx), "
    "unavailable (503: send again)",
    ["format", "outcome"],
)
REJECTIONS = Counter(
    "atropos_rejections",
    "Traces rejected at ingest, by filter (a trace may fail several)",
    ["filter"],
)
COMPRESSIONS = Counter(
    "atropos_compressions",
    "Traces compression finished (at ingest, or in the compression stage), by outcome: "
    "compressed, skipped (small enough, or compression off), failed (gave up)",
    ["outcome"],
)
COMPRESSIONS_SKIPPED = Counter(
    "atropos_compressions_skipped",
    "Traces compression kept whole, by reason: disabled, small (ratio x tokens under "
    "min_tokens_after), within_target, min_saving (it would save too little), unsafe",
    ["reason"],
)
COMPRESSION_TOKENS_IN = Counter(
    "atropos_compression_input_tokens",
    "Tokens of the traces compressed, before, by strategy",
    ["strategy"],
)
COMPRESSION_TOKENS_OUT = Counter(
    "atropos_compression_output_tokens",
    "Tokens of the traces compressed, after, by strategy",
    ["strategy"],
)
DELIVERY_ATTEMPTS = Histogram(
    "atropos_delivery_attempt_seconds",
    "Attempts to deliver a batch, by target and result (delivered, failed): their "
    "duration (the _count is the number of attempts)",
    ["target", "result"],
    buckets=_DELIVERY_BUCKETS,
)
GROUPS_RECEIVED = Counter(
    "atropos_api_groups_received",
    "Groups the Atropos API stored (POST /scored_data, /scored_data_list), by where "
    "they went: queued, or buffered (smaller than their env's group_size)",
    ["placed"],
)
INGEST_RESTARTS = Counter(
    "atropos_ingest_process_restarts",
    "Ingest processes started again, by reason: too_slow (past limits.max_item_seconds), "
    "died (crashed or killed)",
    ["reason"],
)
DB_COMMITS = Histogram(
    "atropos_db_commit_seconds",
    "Write transactions of the hub's writers (traces: the ingest group commit; "
    "atropos_groups: the Atropos API's), from begin to commit",
    ["writer"],
    buckets=_COMMIT_BUCKETS,
)


def count_compression_skipped(kind: str) -> None:
    """A trace compression kept whole (SKIP_KINDS), wherever that was decided."""
    COMPRESSIONS.labels("skipped").inc()
    COMPRESSIONS_SKIPPED.labels(kind).inc()


def count_compressed(strategy: str, tokens_before: int, tokens_after: int) -> None:
    """A trace compressed, wherever that was done (at ingest, or in its stage)."""
    COMPRESSIONS.labels("compressed").inc()
    COMPRESSION_TOKENS_IN.labels(strategy).inc(tokens_before)
    COMPRESSION_TOKENS_OUT.labels(strategy).inc(tokens_after)


# The values a label takes, where they are known before anything happens.
INGEST_OUTCOMES = ("accepted", "rejected", "duplicate", "refused", "unavailable")
COMPRESSION_OUTCOMES = ("compressed", "skipped", "failed")
DELIVERY_RESULTS = ("delivered", "failed")
GROUP_PLACES = ("queued", "buffered")
RESTART_REASONS = ("too_slow", "died")
WRITERS = ("traces", "atropos_groups")


def start_at_zero(*, formats: Iterable[str], filters: Iterable[str], strategy: str,
                  target: str) -> None:
    """Every series whose labels are known at start-up, at 0: a fresh hub's dashboard
    shows 0 rather than "No data", and rate() has a start. (A process that records
    into a series creates it anyway; this is for the ones nothing has touched yet.)"""
    for fmt in formats:
        for outcome in INGEST_OUTCOMES:
            TRACES_INGESTED.labels(fmt, outcome)
    for name in filters:
        REJECTIONS.labels(name)
    for outcome in COMPRESSION_OUTCOMES:
        COMPRESSIONS.labels(outcome)
    COMPRESSION_TOKENS_IN.labels(strategy)
    COMPRESSION_TOKENS_OUT.labels(strategy)
    for result in DELIVERY_RESULTS:
        DELIVERY_ATTEMPTS.labels(target, result)
    for place in GROUP_PLACES:
        GROUPS_RECEIVED.labels(place)
    for reason in RESTART_REASONS:
        INGEST_RESTARTS.labels(reason)
    for writer in WRITERS:
        DB_COMMITS.labels(writer)


M = TypeVar("M", Counter, Histogram)


class Labeled(Generic[M]):
    """The children of a metric by label values, kept: for the hot paths (every
    request, every trace), where `metric.labels(...)` would check and lock each time."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


def total(metric: Counter | Histogram, **labels: str) -> float:
    """The sum of a counter (or of a histogram's _count) over the children whose labels
    match `labels`, in this process: for the log's periodic summary."""
    wanted = labels.items()
    summed = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(("_total", "_count")) and wanted <= sample.labels.items():
                summed += sample.value
    return summed


# --- the log's periodic summary ----------------------------------------------------

_summary_log = logging.getLogger("atropos.summary")

# What the summary line counts, each a total() over this process's metrics.
_SUMMARY: tuple[tuple[str, Counter | Histogram, dict[str, str]], ...] = (
    ("traces in", TRACES_INGESTED, {}),
    ("rejected", TRACES_INGESTED, {"outcome": "rejected"}),
    ("refused", TRACES_INGESTED, {"outcome": "refused"}),
    ("compressed", COMPRESSIONS, {"outcome": "compressed"}),
    ("batches delivered", DELIVERY_ATTEMPTS, {"result": "delivered"}),
    ("delivery attempts failed", DELIVERY_ATTEMPTS, {"result": "failed"}),
    ("Atropos groups in", GROUPS_RECEIVED, {}),
)


# Refused requests (4xx) by client address and status since the last summary: the
# first of each is said at once, the rest counted into one line per interval.
_refusals: collections.Counter[tuple[str, int]] = collections.Counter()
_refusal_log = logging.getLogger("atropos.http")


def refused(client: str, status: int) -> None:
    """A request answered 4xx. Visible at the default level without a line per
    request: one for the first from a client with that status, then a count."""
    key = (client, status)
    _refusals[key] += 1
    if _refusals[key] == 1:
        _refusal_log.info("answered %d to %s; more such answers to it are counted in the "
                          "log's summary", status, client)


def _refusal_lines(every: float) -> None:
    for (client, status), n in sorted(_refusals.items()):
        if n > 1:
            _refusal_log.info("answered %d to %s: %d more in the last %g s", status,
                              client, n - 1, every)
    _refusals.clear()


def _summary_totals() -> dict[str, float]:
    return {what: total(metric, **labels) for what, metric, labels in _SUMMARY}


def _skip_totals() -> dict[str, float]:
    return {sample.labels["reason"]: sample.value
            for family in COMPRESSIONS_SKIPPED.collect() for sample in family.samples
            if sample.name.endswith("_total")}


def _skipped(now: dict[str, float], last: dict[str, float]) -> str:
    """"N compression skipped (small 3; min_saving 1)": the phrase seed 002 tells users
    to look for, with why."""
    done = {why: int(n - last.get(why, 0)) for why, n in now.items()}
    done = {why: n for why, n in done.items() if n}
    if not done:
        return ""
    reasons = "; ".join(f"{why} {n}" for why, n in sorted(done.items()))
    return f"{sum(done.values())} compression skipped ({reasons})"


class Tally:
    """What this process did since the tally was made or last said: the words of the
    summary line ("12 traces in, 3 compressed, 9 compression skipped (small 9)")."""

    def __init__(self) -> None:
        self._last, self._last_skips = _summary_totals(), _skip_totals()

    def said(self) -> str:
        """What happened since the last call ("" for nothing), and start again."""
        now, skips = _summary_totals(), _skip_totals()
        done = {what: int(now[what] - self._last[what]) for what in now}
        skipped = _skipped(skips, self._last_skips)
        self._last, self._last_skips = now, skips
        if not any(done.values()) and not skipped:
            return ""
        said = []
        for what, n in done.items():
            if n or what == "traces in":
                said.append(f"{n} {what}")
            if what == "compressed" and skipped:
                said.append(skipped)
        return ", ".join(said)


async def log_summaries(every: float) -> None:
    """Every `every` seconds, one INFO line of what this process did meanwhile
    (trace_server.log_summary_seconds): the per-trace lines are DEBUG. Nothing is said
    for an interval in which nothing happened."""
    tally = Tally()
    while True:
        await asyncio.sleep(every)
        said = tally.said()
        if said:
            _summary_log.info("in the last %g s: %s", every, said)
        _refusal_lines(every)


@asynccontextmanager
async def summarizing(every: float) -> AsyncIterator[None]:
    """The periodic summary line while the block runs (none when `every` is 0)."""
    if not every:
        yield
        return
    task = asyncio.create_task(log_summaries(every), name="log-summary")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --- /metrics ---------------------------------------------------------------------


def multi_process() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def exposition(families: Iterable[Metric]) -> bytes:
    """The text /metrics answers: the counters (of every process in multi-process mode)
    and `families`, read from the database for this scrape."""
    if multi_process():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        counted = generate_latest(registry)
    else:
        counted = generate_latest(REGISTRY)
    scraped = CollectorRegistry(auto_describe=False)
    scraped.register(_Families(list(families)))
    return counted + generate_latest(scraped)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def database_families(
    traces: dict[str, tuple[int, datetime | None]],
    trace_tokens: int,
    batches: dict[str, tuple[int, datetime | None]],
    atropos: dict[str, Any],
    now: datetime,
) -> list[Metric]:
    """Gauges of what the database holds. `traces` and `batches`: the count and the
    oldest created_at by stage and by state; `atropos`: the queue's figures
    (app/atropos/status.py)."""
    by_stage = GaugeMetricFamily("atropos_traces", "Traces stored, by pipeline stage",
                                 labels=["stage"])
    for stage in Stage:  # every stage, 0 when empty: a series does not vanish
        by_stage.add_metric([stage.value], traces.get(stage.value, (0, None))[0])
    tokens = GaugeMetricFamily("atropos_trace_tokens_total",
                               "Tokens of stored traces (cl100k_base)", value=trace_tokens)
    by_state = GaugeMetricFamily("atropos_batches", "Training batches, by delivery state",
                                 labels=["state"])
    for state in BatchState:
        by_state.add_metric([state.value], batches.get(state.value, (0, None))[0])

    backlog = GaugeMetricFamily(
        "atropos_stage_backlog",
        "Items waiting for a background stage: traces for compression and distribution, "
        "pending batches for delivery", labels=["stage"])
    oldest = GaugeMetricFamily(
        "atropos_stage_oldest_item_age_seconds",
        "Age (since it was stored) of the oldest item waiting for each stage; 0 when none "
        "waits", labels=["stage"])
    for name, waiting in _WAITING_FOR.items():
        n, first = _waiting(traces if name != "delivery" else batches, waiting)
        backlog.add_metric([name], n)
        oldest.add_metric([name], 0.0 if first is None else (now - first).total_seconds())

    groups = GaugeMetricFamily(
        "atropos_api_queue_groups",
        "Atropos groups not yet served, by state: buffered, queued, batched", labels=["state"])
    for state, n in sorted(atropos["groups_waiting"].items()):
        groups.add_metric([state], n)
    queue_bytes = GaugeMetricFamily("atropos_api_queue_bytes",
                                    "JSON bytes of the Atropos groups not yet served",
                                    value=atropos["queue_bytes"])
    step = GaugeMetricFamily("atropos_api_step", "The Atropos trainer's step",
                             value=atropos["step"])
    return [by_stage, tokens, by_state, backlog, oldest, groups, queue_bytes, step]


# What each background stage takes: trace stages, and for delivery batch states.
_WAITING_FOR: dict[str, tuple[str, ...]] = {
    "compression": (Stage.ACCEPTED.value,),
    "distribution": tuple(s.value for s in ELIGIBLE),
    "delivery": (BatchState.PENDING.value,),
}


def _waiting(
    counts: dict[str, tuple[int, datetime | None]], states: tuple[str, ...]
) -> tuple[int, datetime | None]:
    n, first = 0, None
    for state in states:
        count, oldest = counts.get(state, (0, None))
        n += count
        if oldest is not None and (first is None or oldest < first):
            first = oldest
    return n, first
