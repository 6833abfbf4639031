"""Groups of rollouts as the dashboard shows them: the groups envs sent (their
trajectories carry the group's id in traces.group_id) and the groups the hub formed
for its own env (atropos_rollouts.group_id). A rollout's score is what the trainer
got: the env's score (env_reward) or the one the `atropos` target took; its advantage
is that score minus the group's mean."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.models import ATROPOS_ROLLOUTS, PAYLOADS, TRACES, WITH_PAYLOADS

_R = ATROPOS_ROLLOUTS.c
_T = TRACES.c


async def group_of(conn: AsyncConnection, trace_id: str) -> str | None:
    """The group a trace's rollout is in, if any."""
    formed = (await conn.execute(
        sa.select(_R.group_id).where(_R.trace_id == trace_id))).scalar()
    if formed is not None:
        return str(formed)
    sent = (await conn.execute(sa.select(_T.group_id).where(_T.trace_id == trace_id))).scalar()
    return None if sent is None else str(sent)


async def group_members(conn: AsyncConnection, group_id: str) -> list[dict[str, Any]]:
    """The rollouts of a group in the trainer's order, each with its score, advantage,
    stored trace and, for a group the hub formed, its state (grouped or dropped, and
    why)."""
    formed = (await conn.execute(
        sa.select(_R.trace_id, _R.score, _R.state, _R.reason, _R.detail)
        .where(_R.group_id == group_id).order_by(_R.created_at, _R.trace_id))).all()
    if formed:
        order = [(r.trace_id, r.score, {"state": r.state, "reason": r.reason,
                                        "detail": r.detail}) for r in formed]
    else:
        sent = (await conn.execute(
            sa.select(_T.trace_id, _T.env_reward).where(_T.group_id == group_id))).all()
        # Sent rollouts are named <group>-<index>.
        order = sorted(((r.trace_id, r.env_reward, {}) for r in sent),
                       key=lambda m: _index(m[0]))
    if not order:
        return []
    rows = {r.trace_id: r for r in await conn.execute(
        sa.select(_T.trace_id, PAYLOADS.c.trace, _T.env, _T.stage, _T.reward)
        .select_from(WITH_PAYLOADS).where(_T.trace_id.in_([m[0] for m in order])))}
    scores = [s for _, s, _ in order if s is not None]
    mean = sum(scores) / len(scores) if scores else None
    members = []
    for trace_id, score, extra in order:
        row = rows.get(trace_id)
        members.append({
            "trace_id": trace_id, "score": score,
            "advantage": None if score is None or mean is None else score - mean,
            "trace": row.trace if row is not None else None,
            "env": row.env if row is not None else None,
            "stage": row.stage if row is not None else None, **extra,
        })
    return members


async def recent_groups(conn: AsyncConnection, env: str | None = None,
                        limit: int = 50) -> list[dict[str, Any]]:
    """The newest groups, those envs sent and those the hub formed for its own env
    (with `env`, only that env's): id, env, size, mean score, when."""
    sent_query = (
        sa.select(_T.group_id, sa.func.min(_T.env).label("env"), sa.func.count().label("size"),
                  sa.func.avg(_T.env_reward).label("mean"),
                  sa.func.max(_T.created_at).label("at"))
        .where(_T.group_id.is_not(None))
        .group_by(_T.group_id).order_by(sa.desc("at")).limit(limit)
    )
    formed_query = (
        sa.select(_R.group_id, sa.func.min(_R.env).label("env"), sa.func.count().label("size"),
                  sa.func.avg(_R.score).label("mean"),
                  sa.func.max(_R.grouped_at).label("at"),
                  sa.func.min(_R.state).label("state"))
        .where(_R.group_id.is_not(None))
        .group_by(_R.group_id).order_by(sa.desc("at")).limit(limit)
    )
    if env is not None:
        sent_query = sent_query.where(_T.env == env)
        formed_query = formed_query.where(_R.env == env)
    groups = [{**r._mapping, "formed": False} for r in await conn.execute(sent_query)]
    groups += [{**r._mapping, "formed": True} for r in await conn.execute(formed_query)]
    groups.sort(key=lambda g: g["at"], reverse=True)
    return groups[:limit]


async def group_envs(conn: AsyncConnection) -> list[str]:
    """The names the hub's own env had when it formed groups (for the filter form)."""
    rows = await conn.execute(
        sa.select(_R.env).where(_R.env.is_not(None)).distinct().order_by(_R.env))
    return list(rows.scalars())


def _index(trace_id: str) -> int:
    tail = trace_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
