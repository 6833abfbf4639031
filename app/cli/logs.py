"""The log of one `atropos` command: to stderr, as text for a person or as one JSON
object per line for a log shipper (--log-format json)."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson

# Attributes a log call may pass in `extra` that a shipper wants as fields.
_IDS = ("trace_id", "batch_id", "run_id")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the
    trace/batch/run id where the call names one, and the traceback if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _IDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = str(value)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


# uvicorn's lines, under the hub's names: one log reads as one program.
_RENAMED = {"uvicorn": "atropos.http", "uvicorn.error": "atropos.http",
            "uvicorn.access": "atropos.http.access"}
# What uvicorn says of every start and stop, beside the hub's own "listening" line.
_UVICORN_CHATTER = ("Started server process", "Waiting for application", "Application startup",
                    "Shutting down", "Waiting for connections to close",
                    "Waiting for background tasks", "Application shutdown",
                    "Finished server process", "Uvicorn running on")
# Libraries whose DEBUG is every query or every frame: detail no reader of the hub's
# DEBUG log is after.
_DRIVERS = ("aiosqlite", "asyncpg", "httpcore", "hpack", "multipart", "python_multipart",
            "asyncio", "watchfiles", "urllib3")


class _HubNames(logging.Filter):
    """uvicorn's records renamed to the hub's loggers; its start and stop narration
    demoted to DEBUG (dropped unless the log is at DEBUG)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        renamed = _RENAMED.get(record.name)
        if renamed is None:
            return True
        record.name = renamed
        if record.levelno == logging.INFO and record.getMessage().startswith(_UVICORN_CHATTER):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record.levelno >= self.level


def setup(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    handler.addFilter(_HubNames(root.level))
    for name in _DRIVERS:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    # Alembic narrates every migration step; our own line says which revision we reach.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
    # One line per HTTP call (the import client's, the targets'; httpx says them at
    # INFO): detail, shown only at DEBUG.
    logging.getLogger("httpx").setLevel(
        logging.DEBUG if root.level <= logging.DEBUG else max(logging.WARNING, root.level)
    )
