"""The dashboard's pages (/ui): each route reads through the same query functions as
the API (app/db, app/runs, app/atropos) and renders a template; forms post back and
are answered with a redirect (post/redirect/get), so reloading never sends twice."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode

import orjson
from fastapi import APIRouter, Request
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection
from starlette.responses import RedirectResponse, Response

from app.access.guard import Principal
from app.api.deps import ConnDep, HubDep
from app.api.params import TraceQuery
from app.api.schemas import ReviewBody
from app.api.traces import reviewer_name
from app.api.ui import charts
from app.api.ui.render import render
from app.api.ui.session import (
    Admin,
    Reader,
    Reviewer,
    Visitor,
    VisitorDep,
    read_form,
    safe_next,
    sign_in,
    sign_out,
)
from app.api.ui.traces import trace_view
from app.db import group_queries, trace_queries
from app.db.batch_queries import get_batch, list_batches, retry_batch
from app.db.review_queries import (
    ReviewInput,
    claim_next,
    claim_of,
    release,
    save_review,
    waiting,
)
from app.db.trace_queries import SORTS, TraceFilter, View, get_trace
from app.domain import BatchState, Stage, Status
from app.errors import Forbidden, HubError, Invalid, NotFound
from app.hub import Hub
from app.ingest.otlp import store as otlp_store

router = APIRouter(prefix="/ui", include_in_schema=False)

# How the dashboard names each sort order.
SORT_NAMES = {"-created_at": "newest first", "created_at": "oldest first",
              "-reward": "highest reward", "reward": "lowest reward",
              "-total_tokens": "most tokens", "total_tokens": "fewest tokens"}
VIEWS: tuple[View, ...] = ("canonical", "original", "compressed")


# --- overview ----------------------------------------------------------------------


@router.get("")
async def overview(
    request: Request, conn: ConnDep, hub: HubDep, visitor: VisitorDep, _: Reader
) -> Response:
    threshold = hub.config.distributor.min_reward_threshold
    stats = await trace_queries.stats(conn, threshold, rule_firings=False)
    chosen = {k: request.query_params.get(k) or None
              for k in ("env", "model", "policy_version")}
    span = request.query_params.get("range", "all")
    if span not in charts.RANGES:
        span = "all"
    ends = await trace_queries.time_span(conn)
    buckets: list[dict[str, Any]] = []
    bucket = 0
    if ends is not None:
        width = charts.RANGES[span]
        since = datetime.now(UTC) - width if width is not None else None
        bucket = charts.bucket_seconds(width if width is not None else ends[1] - ends[0])
        where = TraceFilter(env=chosen["env"], model=chosen["model"],
                            policy_version=chosen["policy_version"], since=since)
        buckets = await trace_queries.over_time(conn, where, bucket)
    by_stage = stats["by_stage"]
    return render(request, visitor, "overview.html", {
        "stats": stats,
        "funnel": charts.bars(_funnel(stats["traces"], by_stage)),
        "stages": charts.bars(_ordered(by_stage, [s.value for s in Stage]),
                              {s: f"/ui/traces?stage={s}" for s in by_stage}),
        "statuses": charts.bars(_ordered(stats["by_status"], [s.value for s in Status]),
                                {s: f"/ui/traces?status={s}" for s in stats["by_status"]}),
        "rejections": charts.bars(
            sorted(stats["rejections_by_filter"].items(), key=lambda kv: -kv[1]),
            {f: f"/ui/traces?rejected_by={f}" for f in stats["rejections_by_filter"]}),
        "histogram": charts.bars(charts.histogram(stats["reward_histogram"])),
        "env_histogram": charts.bars([
            (f"{b['from']:.3g} to {b['to']:.3g}", b["traces"])
            for b in stats["env_reward"]["histogram"]]),
        "over_time": charts.charts_over_time(buckets),
        "bucket": _duration(bucket),
        "chosen": chosen,
        "range": span,
        "ranges": list(charts.RANGES),
        "envs": await trace_queries.distinct_values(conn, "env"),
        "models": await trace_queries.distinct_values(conn, "model"),
        "labels": await trace_queries.label_counts(conn),
        "otlp": await otlp_store.counts(conn),
    }, nav="overview", title="Overview")


def _funnel(total: int, by_stage: dict[str, int]) -> list[tuple[str, float]]:
    """received -> accepted -> compressed -> batched -> delivered: how many traces got
    at least that far (a trace batched was compressed or skipped first)."""
    n = by_stage.get
    delivered = n("delivered", 0)
    batched = delivered + n("batched", 0)
    compressed = batched + n("compressed", 0) + n("compression_skipped", 0) + n(
        "below_threshold", 0)
    accepted = total - n("rejected", 0) - n("received", 0)
    return [("received", total), ("accepted", accepted), ("compressed or skipped", compressed),
            ("batched", batched), ("delivered", delivered)]


def _ordered(counts: dict[str, int], order: list[str]) -> list[tuple[str, float]]:
    known: list[tuple[str, float]] = [(k, counts[k]) for k in order if k in counts]
    return known + [(k, v) for k, v in sorted(counts.items()) if k not in order]


def _duration(seconds: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = seconds // size
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return f"{seconds} s"


# --- traces ------------------------------------------------------------------------


@router.get("/traces")
async def traces(
    request: Request, conn: ConnDep, hub: HubDep, visitor: VisitorDep, _: Reader
) -> Response:
    params = {k: v for k, v in request.query_params.items() if v != ""}
    error = None
    matches = None
    try:
        query = TraceQuery.model_validate(params)
        where = query.filter()
        records, next_cursor = await trace_queries.list_traces(
            conn, where, query.limit, query.cursor, query.sort)
        if where.words is not None:
            matches = await trace_queries.count_traces(conn, where)
    except ValidationError as exc:
        first = exc.errors()[0]
        error = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        query, records, next_cursor = TraceQuery(), [], None
    except HubError as exc:
        error = exc.message
        query, records, next_cursor = TraceQuery(), [], None
    shown = {k: v for k, v in params.items() if k != "cursor"}
    next_href = f"/ui/traces?{urlencode({**shown, 'cursor': next_cursor})}" if next_cursor else None
    return render(request, visitor, "traces.html", {
        "query": query,
        "params": shown,
        "records": records,
        "matches": matches,
        "next_href": next_href,
        "first_href": f"/ui/traces?{urlencode(shown)}" if "cursor" in params else None,
        "api_href": hub.config.trace_server.endpoint + (f"?{urlencode(params)}" if params else ""),
        "error": error,
        "stages": [s.value for s in Stage],
        "statuses": [s.value for s in Status],
        "filters": _filter_names(hub),
        "sorts": [(s, SORT_NAMES[s]) for s in SORTS],
        "sort_name": SORT_NAMES[query.sort],
        "envs": await trace_queries.distinct_values(conn, "env"),
        "models": await trace_queries.distinct_values(conn, "model"),
        "has_env_reward": "min_env_reward" in TraceQuery.model_fields,
    }, status=400 if error else 200, nav="traces", title="Traces")


@router.get("/traces/{trace_id:path}")
async def trace(
    trace_id: str, request: Request, conn: ConnDep, hub: HubDep, visitor: VisitorDep,
    _: Reader,
) -> Response:
    download = request.query_params.get("download")
    if download is not None:
        if download not in VIEWS:
            raise Invalid(f"download must be one of {', '.join(VIEWS)}", field="download")
        record = await get_trace(conn, trace_id, download)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in trace_id)
        return Response(
            orjson.dumps(record, option=orjson.OPT_INDENT_2),
            media_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="{safe}.{download}.json"',
                     "Cache-Control": "no-store"},
        )
    record = await get_trace(conn, trace_id, "canonical")
    compressed = None
    if record["compression"] is not None and "skipped" not in record["compression"]:
        try:
            compressed = (await get_trace(conn, trace_id, "compressed"))["trace"]
        except HubError:
            compressed = None
    queue = request.query_params.get("queue")
    return render(request, visitor, "trace.html", {
        "waiting": None if queue is None else await _waiting(conn, parse_qsl(queue)),
        "record": record,
        "view": trace_view(record, compressed),
        "claim": await claim_of(conn, trace_id),
        "queue": queue,
        "queue_params": parse_qsl(queue or ""),
        "views": [v for v in VIEWS if v != "compressed" or compressed is not None],
        "threshold": hub.config.distributor.min_reward_threshold,
        "saved": request.query_params.get("saved"),
        "group": await group_queries.group_of(conn, trace_id),
    }, nav="traces", title=f"Trace {trace_id}")


@router.post("/traces/{trace_id:path}")
async def review(
    trace_id: str, request: Request, hub: HubDep, visitor: VisitorDep, principal: Reviewer
) -> Response:
    """The review form: label, note, reward override. From the queue, on to the next."""
    form = await read_form(request, visitor)
    reward_text = form.get("reward", "").strip()
    try:
        # The API's schema, so that a form is held to what the API allows (the note's
        # length, the reward's bounds).
        body = ReviewBody.model_validate({
            "label": form.get("label", ""),
            "note": form.get("note", "").strip() or None,
            "reward": float(reward_text) if reward_text else None,
        })
    except ValueError as exc:
        raise _form_error(exc, reward_text) from None
    await save_review(hub.engine, trace_id, ReviewInput(body.label, body.note, body.reward),
                      reviewer_name(principal))
    queue = form.get("queue")
    if queue is not None:
        return await _next_in_queue(hub, visitor, principal, queue, after=None)
    return RedirectResponse(f"/ui/traces/{trace_id}?saved=1#review", status_code=303)


def _form_error(exc: ValueError, reward_text: str) -> Invalid:
    """The review form's one problem, named as the form names its fields."""
    if not isinstance(exc, ValidationError):
        return Invalid(f"reward {reward_text!r} is not a number", field="reward")
    first = exc.errors(include_url=False)[0]
    field = str(first["loc"][0]) if first["loc"] else None
    if field == "label":
        return Invalid("choose good or bad", field="label")
    return Invalid(f"{field}: {first['msg']}", field=field)


def _filter_names(hub: Hub) -> list[str]:
    """The configured invalid-trace filters (what `rejected_by` can name)."""
    return sorted(hub.config.environment.invalid_trace_filters)


# --- the review queue --------------------------------------------------------------


async def _waiting(conn: AsyncConnection, params: list[tuple[str, str]]) -> int | None:
    """How many traces wait in the queue these filters make (None: filters that make
    no queue, which the queue itself will say)."""
    try:
        where = TraceQuery.model_validate(
            {k: v for k, v in params if v != "" and k != "empty"}).filter()
    except ValidationError:
        return None
    return await waiting(conn, where)


@router.get("/review")
async def review_queue(
    request: Request, conn: ConnDep, hub: HubDep, visitor: VisitorDep, _: Reader
) -> Response:
    return render(request, visitor, "review.html", {
        "waiting": await _waiting(conn, list(request.query_params.items())),
        "params": dict(request.query_params),
        "empty": request.query_params.get("empty"),
        "stages": [s.value for s in Stage],
        "statuses": [s.value for s in Status],
        "filters": _filter_names(hub),
        "envs": await trace_queries.distinct_values(conn, "env"),
        "models": await trace_queries.distinct_values(conn, "model"),
    }, nav="review", title="Review queue")


@router.post("/review")
async def review_next(
    request: Request, hub: HubDep, visitor: VisitorDep, principal: Reviewer
) -> Response:
    form = await read_form(request, visitor)
    skip = form.pop("skip", None) or None
    query = urlencode({k: v for k, v in form.items() if v != ""})
    return await _next_in_queue(hub, visitor, principal, query, after=skip)


@router.post("/review/release")
async def release_hold(
    request: Request, hub: HubDep, visitor: VisitorDep, principal: Reviewer
) -> Response:
    """The queue's page was left (static/queue.js sends this as the page goes): the
    trace it held goes back to the queue now rather than when the hold expires."""
    form = await read_form(request, visitor)
    await release(hub.engine, form.get("trace_id", ""), _holder(visitor, principal))
    return Response(status_code=204)


def _holder(visitor: Visitor, principal: Principal) -> str:
    """Who holds the queue's claims from the dashboard: the key, or with auth off the
    browser's session."""
    return (f"key:{principal.key.key_id}" if principal.key is not None
            else f"session:{visitor.session}")


async def _next_in_queue(
    hub: Hub, visitor: Visitor, principal: Principal, query: str, after: str | None
) -> Response:
    """Claim the next trace matching `query` (the queue's filters, as a query string)
    and show it, or say the queue is empty."""
    params = dict(parse_qsl(query))
    try:
        where = TraceQuery.model_validate(params).filter()
    except ValidationError as exc:
        raise Invalid(f"the queue's filters: {exc.errors()[0]['msg']}") from None
    claim = await claim_next(hub.engine, where, _holder(visitor, principal), skip=after)
    if claim is None:
        return RedirectResponse(f"/ui/review?{urlencode({**params, 'empty': '1'})}",
                                status_code=303)
    target = f"/ui/traces/{claim.trace_id}?{urlencode({'queue': query})}#review"
    return RedirectResponse(target, status_code=303)


# --- batches -----------------------------------------------------------------------


@router.get("/batches")
async def batches(
    request: Request, conn: ConnDep, visitor: VisitorDep, _: Reader
) -> Response:
    state_text = request.query_params.get("state") or None
    try:
        state = BatchState(state_text) if state_text else None
    except ValueError:
        raise Invalid(f"state must be one of {', '.join(BatchState)}", field="state") from None
    cursor = request.query_params.get("cursor") or None
    records, next_cursor = await list_batches(conn, state, 50, cursor)
    shown = {"state": state_text} if state_text else {}
    return render(request, visitor, "batches.html", {
        "records": records,
        "state": state_text,
        "states": [s.value for s in BatchState],
        "counts": await trace_queries.batch_counts(conn),
        "next_href": f"/ui/batches?{urlencode({**shown, 'cursor': next_cursor})}"
        if next_cursor else None,
    }, nav="batches", title="Batches")


@router.get("/batches/{batch_id}")
async def batch(
    batch_id: str, request: Request, conn: ConnDep, visitor: VisitorDep, _: Reader
) -> Response:
    record = await get_batch(conn, batch_id)
    return render(request, visitor, "batch.html", {
        "record": record,
        "members": await trace_queries.summaries(conn, record["trace_ids"]),
        "retried": request.query_params.get("retried"),
    }, nav="batches", title=f"Batch {batch_id}")


@router.post("/batches/{batch_id}/retry")
async def retry(
    batch_id: str, request: Request, hub: HubDep, visitor: VisitorDep, _: Admin
) -> Response:
    await read_form(request, visitor)
    await retry_batch(hub.engine, batch_id)
    hub.stages.wake()
    return RedirectResponse(f"/ui/batches/{batch_id}?retried=1", status_code=303)


# --- training runs -----------------------------------------------------------------


@router.get("/runs")
async def runs(request: Request, hub: HubDep, visitor: VisitorDep, _: Admin) -> Response:
    listed = await hub.runs.list(None, 100) if hub.runs is not None else []
    return render(request, visitor, "runs.html", {
        "enabled": hub.runs is not None, "runs": listed,
    }, nav="runs", title="Training runs")


@router.get("/runs/{run_id}")
async def run(
    run_id: str, request: Request, hub: HubDep, visitor: VisitorDep, _: Admin
) -> Response:
    if hub.runs is None:
        raise Forbidden("training runs are off on this hub (runs.enabled)", field="runs.enabled")
    record = await hub.runs.describe(run_id, tail_lines=40)
    return render(request, visitor, "run.html", {
        "run": record, "stopping": request.query_params.get("stopping"),
    }, nav="runs", title=f"Run {run_id}")


@router.post("/runs/{run_id}/stop")
async def stop_run(
    run_id: str, request: Request, hub: HubDep, visitor: VisitorDep, _: Admin
) -> Response:
    await read_form(request, visitor)
    if hub.runs is None:
        raise Forbidden("training runs are off on this hub (runs.enabled)", field="runs.enabled")
    await hub.runs.stop(run_id)
    return RedirectResponse(f"/ui/runs/{run_id}?stopping=1", status_code=303)


# --- the Atropos API ---------------------------------------------------------------


@router.get("/atropos")
async def atropos(request: Request, hub: HubDep, visitor: VisitorDep, _: Reader) -> Response:
    state = await hub.atropos.overview()
    return render(request, visitor, "atropos.html", {
        "atropos": state, "config": hub.config.atropos,
        "hub_env": await hub.atropos.hub_env_figures(),
    }, nav="atropos", title="Atropos API")


# --- groups of rollouts ------------------------------------------------------------


@router.get("/groups")
async def groups(request: Request, conn: ConnDep, visitor: VisitorDep, _: Reader) -> Response:
    env = request.query_params.get("env") or None
    return render(request, visitor, "groups.html", {
        "groups": await group_queries.recent_groups(conn, env),
        "env": env,
        "envs": await trace_queries.distinct_values(conn, "env"),
    }, nav="atropos", title="Groups")


@router.get("/groups/{group_id:path}")
async def group(group_id: str, request: Request, conn: ConnDep, visitor: VisitorDep,
                _: Reader) -> Response:
    members = await group_queries.group_members(conn, group_id)
    if not members:
        raise NotFound(f"no group {group_id!r}", field="group_id")
    scores = [m["score"] for m in members if m["score"] is not None]
    return render(request, visitor, "group.html", {
        "group_id": group_id,
        "members": [{**m, "steps": steps} for m, steps in zip(members, _side_by_side(members))],
        "prompt": next((m["trace"]["task"] for m in members if m["trace"]), None),
        "env": next((m["env"] for m in members if m["env"]), None),
        "mean": sum(scores) / len(scores) if scores else None,
    }, nav="atropos", title=f"Group {group_id}")


def _side_by_side(members: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each rollout's steps, a step marked `shared` where it equals the first
    rollout's at the same place: what differs stands out."""
    columns = []
    for member in members:
        trace = member["trace"] or {}
        columns.append([{
            "type": s.get("type"), "role": s.get("role"), "tool": s.get("tool"),
            "text": "\n".join(p for p in (s.get("content"), _arguments(s.get("arguments")),
                                           s.get("error")) if p),
        } for s in trace.get("steps") or []])
    first = [dict(step) for step in columns[0]] if columns else []
    for k, column in enumerate(columns):
        for i, step in enumerate(column):
            step["shared"] = k > 0 and i < len(first) and step == first[i]
    return columns


def _arguments(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else orjson.dumps(value).decode()


# --- signing in and out ------------------------------------------------------------


# What /ui/login?problem= may say: a code the hub sent there, shown as the hub's own
# words. Any other value shows nothing (a link must not put words in the hub's mouth).
LOGIN_PROBLEMS = {
    "invalid_key": "That key is not valid (unknown, revoked or mistyped).",
}


@router.get("/login")
async def login(request: Request, hub: HubDep, visitor: VisitorDep) -> Response:
    return render(request, visitor, "login.html", {
        "next": safe_next(request.query_params.get("next")),
        "problem": LOGIN_PROBLEMS.get(request.query_params.get("problem", "")),
        "auth": hub.config.auth.enabled,
        "session_hours": hub.config.auth.session_hours,
    }, title="Sign in")


@router.post("/login")
async def login_post(request: Request, hub: HubDep, visitor: VisitorDep) -> Response:
    form = await read_form(request, visitor)
    target = safe_next(form.get("next"))
    if not hub.config.auth.enabled:
        return RedirectResponse(target, status_code=303)
    client = request.client.host if request.client else "unknown"
    try:
        session_id = await hub.access.sign_in(form.get("key", "").strip(), client)
    except HubError as exc:
        if exc.status != 401:
            raise
        return RedirectResponse(
            f"/ui/login?{urlencode({'next': target, 'problem': 'invalid_key'})}",
            status_code=303)
    response = RedirectResponse(target, status_code=303)
    sign_in(response, request, session_id, int(hub.access.sessions.lifetime.total_seconds()))
    return response


@router.post("/logout")
async def logout(request: Request, hub: HubDep, visitor: VisitorDep) -> Response:
    await read_form(request, visitor)
    if visitor.session_id is not None:
        await hub.access.sessions.close(visitor.session_id)
    response = RedirectResponse("/ui/login", status_code=303)
    sign_out(response, request)
    return response
