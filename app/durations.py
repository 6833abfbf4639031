"""Human durations as the CLI and config.json write them: `30d`, `12h`, `90m`, `2w`,
`45s` (one number, one unit)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def parse_duration(text: str) -> timedelta:
    """`30d` -> 30 days. Raises ValueError naming the accepted forms."""
    match = _DURATION.match(text) if isinstance(text, str) else None
    if not match or float(match[1]) <= 0:
        raise ValueError(
            f"{text!r} is not a duration; write a positive number and a unit: "
            "45s, 90m, 12h, 30d or 2w"
        )
    return timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def format_duration(value: timedelta) -> str:
    """The shortest exact form: 30 days -> `30d`, 90 minutes -> `90m`."""
    seconds = value.total_seconds()
    for unit in ("w", "d", "h", "m"):
        if seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def parse_moment(text: str) -> datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise), or an age back from now
    (`1h`, `7d`): what `--since` and the API's `since` take. Raises ValueError."""
    try:
        return datetime.now(UTC) - parse_duration(text)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(
            f"not an ISO 8601 date or time, nor an age like 7d: {text!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
