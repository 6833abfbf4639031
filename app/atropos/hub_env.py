"""The hub's own Atropos env: trajectories the `atropos` target delivers (app/targets/
atropos.py) become scored groups in the queue GET /batch serves, beside the groups
real envs send, by the same packing rules.

The env is registered (`desired_name` distributor.atropos_env, with its weight and
min_batch_allocation, group_size distributor.group_size) once the trainer has started,
as atroposlib's envs are, and again after /reset_data. Until then rollouts wait.

Each rollout is a row of atropos_rollouts, keyed by its trace_id, so that a trace
delivered twice (a worker died before acknowledging its batch) is kept once. A group
forms when group_size rollouts of one key are pending: the oldest, in one transaction
that moves them `pending` -> `grouped` (checking each was still pending) and puts the
group in the queue. So a trajectory is in at most one group, and the queue's own
states put a group in at most one batch; a crash at any point leaves either both
writes or neither.

Left out, each with a reason and counted (`figures`): a rollout that cannot be a
sequence (`unusable`: no tokens, no score), one longer than the trainer's
max_token_len (`too_long`), one whose policy_version is a step more than
distributor.max_policy_lag behind the trainer's (`stale`), a group whose scores are
all equal (`same_scores`: no advantage to learn from, as atroposlib's
`ensure_scores_are_not_same` drops it), and, with group_timeout `drop`, a group still
short of group_size after group_timeout_seconds (`timed_out`; with `release` it
enters the queue as it is).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
import sqlalchemy as sa

from app.atropos import queue
from app.atropos.models import RegisterEnv, ScoredData
from app.atropos.presence import record
from app.atropos.registration import register_env_in
from app.atropos.segments import deflate
from app.atropos.tables import ENVS, STATE, AtroposDb, AtroposRunState, run_state
from app.config import AtroposConfig, AtroposTargetConfig
from app.db.dialect import insert_ignoring_conflicts
from app.db.group_commit import GroupCommit
from app.db.models import ATROPOS_ROLLOUTS
from app.db.types import utcnow
from app.outage import Outage

if TYPE_CHECKING:
    from app.targets import Rollout

log = logging.getLogger("atropos.groups")

ROLLOUTS = ATROPOS_ROLLOUTS
PENDING, GROUPED, DROPPED = "pending", "grouped", "dropped"
_TRAILING_NUMBER = re.compile(r"(\d{1,18})$")
# Deliveries (and passes) written in one transaction, at most.
_MAX_ADDS = 16


class Raced(Exception):
    """A rollout picked for a group was no longer pending: another hub formed it."""


@dataclass
class Formed:
    """What one pass did: groups that entered the queue, rollouts left out by reason."""

    groups: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    raced: bool = False  # another hub moved some of its rollouts: the pass is undone

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n

    @property
    def moved(self) -> int:
        return len(self.groups) + sum(self.dropped.values())


@dataclass(frozen=True, slots=True)
class _HubEnvRegistration:
    env_id: int
    name: str | None


class HubEnv:
    """The hub's env, a kind of the hub's group commit (app/db/group_commit.py): the
    rollouts deliveries add and the grouping stage's passes are written together, in the
    writer's turn like every other kind, each transaction forming what is then full."""

    name = "hub env rollouts"

    def __init__(self, db: AtroposDb, config: AtroposTargetConfig,
                 atropos: AtroposConfig, outage: Outage) -> None:
        self._db = db
        self._config = config
        self._atropos = atropos
        # No deadline: the callers are stages, each waiting for its own write.
        self._commits: GroupCommit[list[Rollout], Formed] = GroupCommit(
            self, db.writer, outage, max_items=_MAX_ADDS)

    def start(self) -> None:
        self._commits.start()

    async def close(self) -> None:
        """Write what was submitted, then stop."""
        await self._commits.stop()
        await self._db.close()

    async def add(self, batch_id: str, rollouts: list[Rollout]) -> dict[str, Any]:
        """Keep the rollouts (a trace kept before stays as it was) and form what is
        full; the delivery's receipt."""
        formed = await self._commits.submit(rollouts)
        return {"rollouts": len(rollouts), "groups": formed.groups, "dropped": formed.dropped}

    async def form(self) -> int:
        """One pass: register the env when due, form full groups, release or drop the
        timed-out ones. How many groups and drops it made (0: nothing to do)."""
        if not await self._db.read(_any_pending):
            return 0
        formed = await self._commits.submit([])
        return 1 if formed.raced else formed.moved

    def write(self, conn: sa.Connection, items: Sequence[list[Rollout]]) -> list[Formed]:
        """One transaction: keep every item's rollouts, then one forming pass, whose
        groups and drops the first item's result carries."""
        now = utcnow()
        results = [self._keep(conn, rollouts, now) for rollouts in items]
        try:
            with conn.begin_nested():
                self._form_into(conn, results[0], now)
        except Raced:
            # Its rollouts stay kept; only the forming is undone, and done again.
            log.info("another hub formed some of these groups first; forming again")
            results[0].raced = True
        for formed in results:
            self._said(formed)
        return results

    def _said(self, formed: Formed) -> None:
        for group_id in formed.groups:
            log.info("group %s of env %s queued", group_id, self._config.atropos_env)
        for reason, n in formed.dropped.items():
            log.info("%d rollout(s) left out of the hub's groups: %s", n, reason)

    def _keep(self, conn: sa.Connection, rollouts: list[Rollout], now: datetime) -> Formed:
        formed = Formed()
        rows = [_row(r, now) for r in rollouts]
        if rows:
            insert = insert_ignoring_conflicts(self._db.dialect, ROLLOUTS, "trace_id")
            new = set(conn.execute(insert.returning(ROLLOUTS.c.trace_id), rows).scalars())
            formed.drop("unusable", sum(1 for r in rows
                                        if r["trace_id"] in new and r["state"] == DROPPED))
        return formed

    def _form_into(self, conn: sa.Connection, formed: Formed, now: datetime) -> None:
        run = run_state(conn, lock=True)
        if not run.started:
            return  # no env may register before the trainer's first GET /batch
        env = self._env(conn, run, now)
        self._drop_unfit(conn, run, formed, now)
        size = self._config.group_size
        timeout = now - timedelta(seconds=self._config.group_timeout_seconds)
        keys = conn.execute(
            sa.select(ROLLOUTS.c.group_key, sa.func.count(), sa.func.min(ROLLOUTS.c.created_at))
            .where(ROLLOUTS.c.state == PENDING)
            .group_by(ROLLOUTS.c.group_key)
        ).all()
        for key, pending, first in keys:
            full = pending // size
            for _ in range(full):
                if not self._group(conn, key, size, env, formed, now):
                    return  # the queue is full: the rest waits for the trainer
            pending -= full * size
            if pending and full:
                first = conn.execute(sa.select(sa.func.min(ROLLOUTS.c.created_at)).where(
                    ROLLOUTS.c.state == PENDING, ROLLOUTS.c.group_key == key)).scalar()
            if pending and first <= timeout:
                if self._config.group_timeout == "release":
                    if not self._group(conn, key, pending, env, formed, now):
                        return
                else:
                    formed.drop("timed_out", _drop(
                        conn, ROLLOUTS.c.group_key == key, "timed_out",
                        f"{pending} of group_size {size} after group_timeout_seconds "
                        f"{self._config.group_timeout_seconds:g}", now))

    def _env(self, conn: sa.Connection, run: AtroposRunState, now: datetime) -> _HubEnvRegistration:
        """The hub's env (registered now if it is not yet)."""
        row = conn.execute(
            sa.select(ENVS.c.env_id, ENVS.c.real_name).where(ENVS.c.hub_owned)).first()
        if row is not None:
            record(conn, [row.env_id], now)  # the hub's env is alive while it has work
            return _HubEnvRegistration(int(row.env_id), row.real_name)
        config = self._config
        answer = register_env_in(conn, RegisterEnv(
            max_token_length=run.max_token_len, desired_name=config.atropos_env,
            weight=config.atropos_env_weight, group_size=config.group_size,
            min_batch_allocation=config.atropos_env_min_batch_allocation,
        ), hub_owned=True)
        log.info("the hub's env registered as %s (env_id %s)", answer["wandb_name"],
                 answer["env_id"])
        return _HubEnvRegistration(int(answer["env_id"]), answer["wandb_name"])

    def _drop_unfit(self, conn: sa.Connection, run: AtroposRunState, formed: Formed,
                    now: datetime) -> None:
        c = ROLLOUTS.c
        if run.max_token_len > 0:
            formed.drop("too_long", _drop(
                conn, c.tokens > run.max_token_len, "too_long",
                f"longer than the trainer's max_token_len {run.max_token_len}", now))
        lag = self._config.max_policy_lag
        if lag is not None:
            formed.drop("stale", _drop(
                conn, c.policy_step < run.step - lag, "stale",
                f"policy_version more than {lag} steps behind the trainer's step {run.step}",
                now))

    def _group(self, conn: sa.Connection, key: str, size: int, env: _HubEnvRegistration,
               formed: Formed, now: datetime) -> bool:
        c = ROLLOUTS.c
        rows = conn.execute(
            sa.select(c.trace_id, c.score, c.rollout)
            .where(c.state == PENDING, c.group_key == key)
            .order_by(c.created_at, c.trace_id)
            .limit(size)
        ).all()
        group_id = f"hg-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}"
        ids = [r.trace_id for r in rows]
        scores = [float(r.score) for r in rows]
        if len(set(scores)) == 1:
            _move(conn, ids, DROPPED, now, group_id=group_id, reason="same_scores",
                  detail=f"all {len(ids)} scores are {scores[0]:g}", env_id=env.env_id,
                  env=env.name)
            formed.drop("same_scores", len(ids))
            return True
        group = _new_group(env.env_id, group_id, ids, scores, [r.rollout for r in rows])
        if not queue.has_room(conn, self._atropos, group):
            return False
        _move(conn, ids, GROUPED, now, group_id=group_id, env_id=env.env_id, env=env.name)
        queue.enqueue(conn, self._db.dialect, group)
        formed.groups.append(group_id)
        return True


def _new_group(env_id: int, group_id: str, trace_ids: list[str], scores: list[float],
               rollouts: list[dict[str, Any]]) -> queue.NewGroup:
    data = scored_data(env_id, group_id, trace_ids, scores, rollouts)
    return queue.NewGroup(env_id=env_id, size=len(trace_ids),
                          json=deflate(orjson.dumps(data.__dict__)),
                          fill_logprobs=data.inference_logprobs is None)


def scored_data(env_id: int | None, group_id: str, trace_ids: list[str],
                scores: list[float], rollouts: list[dict[str, Any]]) -> ScoredData:
    """The group as the queue serves it (and `atropos export --format atropos` writes
    it), its sequences in `trace_ids`' order."""
    logprobs = [r["logprobs"] for r in rollouts]
    messages = [r["messages"] for r in rollouts]
    return ScoredData(
        tokens=[r["tokens"] for r in rollouts],
        masks=[r["masks"] for r in rollouts],
        scores=scores,
        # Only when every sequence has them: a trainer takes them for the whole group.
        inference_logprobs=logprobs if all(v is not None for v in logprobs) else None,
        messages=messages if all(_chat(m) for m in messages) else None,
        group_overrides={"hub_group": group_id, "trace_ids": trace_ids},
        env_id=env_id,
    )


def formed_groups(conn: sa.Connection, after: str | None, limit: int) -> list[dict[str, Any]]:
    """The groups the hub formed (those that entered the queue), oldest first, `limit`
    of them after the group id `after`: each as the queue served it, with the env_id
    it was queued under (a /reset_data may have given that id to another env since;
    null for a group formed before the hub kept it)."""
    c = ROLLOUTS.c
    ids = sa.select(c.group_id).where(c.state == GROUPED).distinct()
    if after is not None:
        ids = ids.where(c.group_id > after)
    page = list(conn.execute(ids.order_by(c.group_id).limit(limit)).scalars())
    if not page:
        return []
    rows = conn.execute(
        sa.select(c.group_id, c.trace_id, c.score, c.rollout, c.env_id)
        .where(c.group_id.in_(page), c.state == GROUPED)
        .order_by(c.group_id, c.created_at, c.trace_id)
    ).all()
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(row.group_id, []).append(row)
    return [scored_data(members[0].env_id, gid, [r.trace_id for r in members],
                        [float(r.score) for r in members], [r.rollout for r in members]).__dict__
            for gid, members in groups.items()]


def _chat(messages: Any) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages)


def _row(rollout: Rollout, now: datetime) -> dict[str, Any]:
    return {
        "trace_id": rollout.trace_id,
        "group_key": rollout.group_key,
        "state": DROPPED if rollout.unusable else PENDING,
        "reason": "unusable" if rollout.unusable else None,
        "detail": rollout.unusable,
        "score": rollout.score,
        "tokens": len(rollout.tokens),
        "policy_step": policy_step(rollout.policy_version),
        "rollout": {"tokens": rollout.tokens, "masks": rollout.masks,
                    "logprobs": rollout.logprobs, "messages": rollout.messages,
                    "exact": rollout.exact},
        "group_id": None,
        "created_at": now,
        "grouped_at": None,
    }


def _drop(conn: sa.Connection, where: Any, reason: str, detail: str, now: datetime) -> int:
    result = conn.execute(
        sa.update(ROLLOUTS).where(ROLLOUTS.c.state == PENDING, where)
        .values(state=DROPPED, reason=reason, detail=detail, grouped_at=now))
    return int(result.rowcount)


def _move(conn: sa.Connection, ids: list[str], state: str, now: datetime,
          **values: Any) -> None:
    moved = conn.execute(
        sa.update(ROLLOUTS).where(ROLLOUTS.c.trace_id.in_(ids), ROLLOUTS.c.state == PENDING)
        .values(state=state, grouped_at=now, **values))
    if moved.rowcount != len(ids):
        raise Raced(f"{len(ids) - moved.rowcount} of {len(ids)} rollouts were no longer pending")


def _any_pending(conn: sa.Connection) -> bool:
    """Whether a pass has anything to do: rollouts wait, and the trainer has started."""
    if not conn.execute(sa.select(STATE.c.started).where(STATE.c.id == 1)).scalar():
        return False
    return conn.execute(
        sa.select(ROLLOUTS.c.trace_id).where(ROLLOUTS.c.state == PENDING).limit(1)
    ).first() is not None


def policy_step(version: str | None) -> int | None:
    """The trainer's step a policy_version names: the number it is or ends with
    (`7`, `step-7`); None when it names none."""
    found = _TRAILING_NUMBER.search(version or "")
    return int(found.group(1)) if found else None


def figures(conn: sa.Connection) -> dict[str, Any]:
    """The rollouts by state, and those left out by reason (for /v1/stats)."""
    c = ROLLOUTS.c
    by_state: dict[str, int] = dict(
        conn.execute(sa.select(c.state, sa.func.count()).group_by(c.state)).all())
    dropped: dict[str, int] = dict(conn.execute(
        sa.select(c.reason, sa.func.count()).where(c.state == DROPPED).group_by(c.reason)
    ).all())
    groups = conn.execute(
        sa.select(sa.func.count(sa.distinct(c.group_id))).where(c.state == GROUPED)).scalar()
    return {"pending": by_state.get(PENDING, 0), "grouped": by_state.get(GROUPED, 0),
            "groups": groups or 0, "dropped": dropped}
