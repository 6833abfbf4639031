"""The dashboard's charts, drawn on the server as inline SVG and HTML: no chart library
to ship, nothing to run in the browser, and every chart has its figures as text too
(bar labels, and a table under each line chart) for screen readers and for copying."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

WIDTH, HEIGHT, PAD = 600, 160, 8
# Bucket widths the charts over time choose from: about 40 buckets across the range.
_BUCKETS = (60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400)
# The reward histogram's bars, at most: however far apart the lowest and highest reward.
HISTOGRAM_BARS = 20
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7),
          "30d": timedelta(days=30), "all": None}


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    share: float  # of the largest bar, 0..1
    href: str | None = None


def bars(items: list[tuple[str, float]], hrefs: dict[str, str] | None = None) -> list[Bar]:
    top = max((v for _, v in items), default=0) or 1
    return [Bar(label, value, value / top, (hrefs or {}).get(label)) for label, value in items]


def histogram(buckets: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The reward histogram's bars, from the API's buckets (those that hold traces, each
    as wide as the first): at most HISTOGRAM_BARS from the lowest to the highest, each a
    whole number of buckets wide, the empty ones between included."""
    if not buckets:
        return []
    step = buckets[0]["to"] - buckets[0]["from"]
    low, high = buckets[0]["from"], buckets[-1]["to"]
    width = step * max(1, math.ceil((high - low) / step / HISTOGRAM_BARS))
    count = min(HISTOGRAM_BARS, max(1, math.ceil((high - low) / width - 1e-9)))
    held = [0.0] * count
    for b in buckets:
        held[min(count - 1, int((b["from"] - low) // width))] += b["traces"]
    return [(f"{low + i * width:g} to {low + (i + 1) * width:g}", n) for i, n in enumerate(held)]


@dataclass(frozen=True)
class LineChart:
    title: str
    unit: str
    segments: list[str]  # SVG polyline points, one per run of buckets with a value
    dots: list[tuple[float, float, str]]  # x, y, what it says
    low: str
    high: str
    first: str
    last: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # time, value
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def empty(self) -> bool:
        return not self.dots


def bucket_seconds(span: timedelta) -> int:
    """The narrowest bucket that gives at most ~40 points over `span`."""
    for seconds in _BUCKETS:
        if span.total_seconds() / seconds <= 40:
            return seconds
    return _BUCKETS[-1]


def line_chart(
    title: str, unit: str, series: list[tuple[datetime, float | None]], fmt: str = "{:.2f}"
) -> LineChart:
    values = [v for _, v in series if v is not None]
    if not values:
        return LineChart(title, unit, [], [], "", "", "", "")
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 1, high + 1
    start, end = series[0][0], series[-1][0]
    span = (end - start).total_seconds()

    def x(when: datetime) -> float:
        if not span:
            return WIDTH / 2  # one bucket: in the middle
        return round(PAD + (when - start).total_seconds() / span * (WIDTH - 2 * PAD), 1)

    def y(value: float) -> float:
        return round(HEIGHT - PAD - (value - low) / (high - low) * (HEIGHT - 2 * PAD), 1)

    segments: list[str] = []
    run: list[str] = []
    dots = []
    rows = []
    for when, value in series:
        label = when.strftime("%Y-%m-%d %H:%M")
        rows.append((label, "—" if value is None else fmt.format(value)))
        if value is None:
            if run:
                segments.append(" ".join(run))
            run = []
            continue
        run.append(f"{x(when)},{y(value)}")
        dots.append((x(when), y(value), f"{label} UTC: {fmt.format(value)} {unit}".strip()))
    if run:
        segments.append(" ".join(run))
    return LineChart(
        title, unit, segments, dots, fmt.format(min(values)), fmt.format(max(values)),
        start.strftime("%Y-%m-%d %H:%M"), end.strftime("%Y-%m-%d %H:%M"), rows,
    )


def charts_over_time(buckets: list[dict[str, Any]]) -> list[LineChart]:
    """The four charts over time, from trace_queries.over_time's buckets."""

    def series(key: str) -> list[tuple[datetime, float | None]]:
        return [(b["start"], b[key]) for b in buckets]

    share = [(b["start"], None if b["rejected_share"] is None else 100 * b["rejected_share"])
             for b in buckets]
    return [
        line_chart("Traces stored", "traces", series("traces"), "{:.0f}"),
        line_chart("Mean reward", "", series("mean_reward")),
        line_chart("Rejection rate", "%", share, "{:.1f}"),
        line_chart("Compression ratio", "", series("compression_ratio"), "{:.3f}"),
    ]
