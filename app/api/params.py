"""Query parameters that GET /v1/traces and the dashboard's /ui/traces share, so that an
address of one works on the other (`/ui/traces?<the API's parameters>`)."""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from app.db.trace_queries import LabelFilter, Sort, TraceFilter
from app.domain import Stage, Status
from app.durations import parse_moment


def _moment(value: Any) -> Any:
    """An age (`1h`, `7d`) as the moment that long ago; anything else as given."""
    return parse_moment(value) if isinstance(value, str) else value


# An ISO 8601 date or time, or an age back from now: what the CLI's --since takes.
Moment = Annotated[datetime, BeforeValidator(_moment)]


class TraceQuery(BaseModel):
    stage: Stage | None = None
    status: Status | None = None
    env: str | None = None
    model: str | None = None
    policy_version: str | None = None
    group: str | None = Field(
        None, description="Rollouts of one group: an Atropos group an env sent, or a "
        "trace's metadata.group")
    min_reward: float | None = None
    max_reward: float | None = None
    min_env_reward: float | None = Field(
        None, description="The environment's own reward at least this (traces with none: left out)"
    )
    max_env_reward: float | None = Field(
        None, description="The environment's own reward at most this"
    )
    since: Moment | None = Field(
        None, description="Stored at or after: ISO 8601, or an age back from now (1h, 7d)"
    )
    until: Moment | None = Field(
        None, description="Stored before: ISO 8601, or an age back from now (1h, 7d)"
    )
    label: LabelFilter | None = Field(
        None, description="A reviewer's label; `unreviewed`: traces nobody has reviewed"
    )
    rejected_by: str | None = Field(
        None, description="Rejected by this filter (a name from reject_reasons)"
    )
    q: str | None = Field(
        None, max_length=200, description="Words in the task or the final answer "
        "(case-insensitive; on SQLite for ASCII letters only)"
    )
    sort: Sort = Field(
        "-created_at", description="By created_at, reward or total_tokens; '-' for descending"
    )
    limit: int = Field(50, ge=1, le=1000)
    cursor: str | None = Field(None, description="next_cursor of the page before")

    def filter(self) -> TraceFilter:
        """The filters among these parameters (every field TraceFilter has)."""
        given: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(TraceFilter)}
        return TraceFilter(**given)
