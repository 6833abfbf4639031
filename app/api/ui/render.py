"""Templates (app/api/ui/templates, Jinja2, autoescaped) and the filters they format
figures with."""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from starlette.responses import HTMLResponse, Response

from app.api.ui.session import CSRF_FIELD, Visitor, remember

if TYPE_CHECKING:
    import jinja2

NAV = [("overview", "/ui", "Overview"), ("traces", "/ui/traces", "Traces"),
       ("review", "/ui/review", "Review"), ("batches", "/ui/batches", "Batches"),
       ("runs", "/ui/runs", "Runs"), ("atropos", "/ui/atropos", "Atropos API")]


@cache
def environment() -> jinja2.Environment:
    # Imported with the first page asked for: a hub that restarts answers the API first.
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("app.api.ui", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(number=number, reward=reward, when=when, pct=pct, pretty=pretty)
    return env


def render(
    request: Request,
    visitor: Visitor,
    template: str,
    context: dict[str, Any],
    *,
    status: int = 200,
    nav: str | None = None,
    title: str | None = None,
) -> Response:
    page = environment().get_template(template).render(
        request=request,
        visitor=visitor,
        csrf_field=CSRF_FIELD,
        nav=NAV,
        current=nav,
        title=title,
        **context,
    )
    response = HTMLResponse(page, status_code=status)
    # Pages show what the database holds now, and some hold a form token.
    response.headers["Cache-Control"] = "no-store"
    return remember(response, request, visitor)


def number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def reward(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def pct(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"


def when(value: str | datetime | None) -> str:
    """A timestamp as the pages show it: UTC, to the second."""
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty(value: Any) -> str:
    """A JSON value as indented text (tool arguments, receipts)."""
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
