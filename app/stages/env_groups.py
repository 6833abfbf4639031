"""The env groups stage: each group an env sent to /scored_data or /scored_data_list
becomes trajectories, one per rollout, which go through the ingest pipeline as any
trace does (scored, filtered, listed, searched, reviewed, exported).

The group commit marks each stored group (atropos_env_groups, a small row in the same
transaction: /scored_data does no more), and keeps its segment until this stage has
read it, even once the group is served. A rollout becomes:
- its messages, when the env sent them (an OpenAI chat);
- otherwise its tokens decoded with tinker.tokenizer when one is set: the prompt (the
  positions masked -100 before the first trained one) as the user's turn, the rest as
  the assistant's;
- otherwise a token-only trajectory (`metadata.atropos.token_only`).
Its score is the env_reward; `metadata.group` is the group's id (the traces list's
`group=`), `metadata.atropos` names the env, the trainer's step when the group arrived,
the rollout's index, its length in tokens and its advantage (its score minus the
group's mean); a token-only one keeps its ids as sent in `metadata.tokens` /
`metadata.masks` (what the tinker target trains on).

A pass makes the trajectories of at most `batch` groups, and the stage passes again
while groups wait, but makes none while more than `batch` groups arrived in the last
poll_seconds: the envs' groups can arrive faster than eight trajectories each are
made, and /scored_data keeps the CPU and the writer; a backlog waits for a quieter
moment (or `atropos worker --burst`), its segments kept. The trajectories are stored
through the traces' group commit, in the writer's turn, so that a GET /batch waits
for one short transaction rather than for a pass. The trace ids follow from the
group's, so a pass repeated after a crash stores nothing twice; a group's mark and
segment are deleted once its trajectories are committed (or refused for good), a
group with one not stored for now (503) stays marked for the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.atropos.segments import Segment, inflate
from app.atropos.tables import ENV_GROUPS, ENVS, GROUPS, SEGMENTS
from app.db.dialect import writing
from app.db.types import utcnow
from app.errors import HubError
from app.ingest.ingestor import Ingestor
from app.ingest.inserter import Stored
from app.stages.assembly import stored_trajectories
from app.training.chat_template import ChatTokenizer, load_tokenizer

log = logging.getLogger("atropos.groups")

# Groups a pass makes trajectories of, at most; and groups arrived in the last
# poll_seconds past which it makes none.
BATCH = 8
TOKEN_ONLY_TASK = "(an Atropos rollout sent as tokens only)"
MASKED = -100


def group_id(segment_id: int, received_at: datetime) -> str:
    return f"ag-{received_at:%Y%m%dT%H%M%S%f}-{segment_id}"


class EnvGroupStage:
    name = "env groups"
    poll_seconds = 1.0
    gives_way = True  # to /scored_data (runner.GivesWay)

    def __init__(self, engine: AsyncEngine, ingestor: Ingestor, tokenizer: str | None, *,
                 batch: int = BATCH, on_advance: Callable[[], None] | None = None) -> None:
        """`ingestor`: the hub's, which prepares the trajectories in its processes and
        stores them; `tokenizer`: tinker.tokenizer, for rollouts sent without messages."""
        self._engine = engine
        self._ingestor = ingestor
        self._tokenizer_name = tokenizer
        self._tokenizer: ChatTokenizer | None = None
        self._batch = batch
        self._on_advance = on_advance

    async def run_once(self) -> int:
        e = ENV_GROUPS.c
        async with self._engine.connect() as conn:
            # Envs sending faster than this stage makes trajectories: /scored_data comes
            # first, and the backlog is made once they slow down.
            if self.gives_way and (await conn.execute(
                sa.select(sa.func.count()).where(
                    e.received_at >= utcnow() - timedelta(seconds=self.poll_seconds))
            )).scalar_one() > self._batch:
                return 0
            marks = (await conn.execute(
                sa.select(e.segment_id, e.env_id, e.step, e.received_at, SEGMENTS.c.deflated,
                          sa.func.coalesce(ENVS.c.real_name, ENVS.c.desired_name).label("env"))
                .join(SEGMENTS, SEGMENTS.c.id == e.segment_id)
                .outerjoin(ENVS, ENVS.c.env_id == e.env_id)
                .order_by(e.segment_id)
                .limit(self._batch)
            )).all()
        if not marks:
            return 0
        groups = await asyncio.to_thread(lambda: [self._items(m) for m in marks])
        ids = [item["trace_id"] for items in groups for item in items]
        async with self._engine.connect() as conn:
            stored = await stored_trajectories(conn, ids)
        todo = [item for items in groups for item in items if item["trace_id"] not in stored]
        made = dict(zip([t["trace_id"] for t in todo],
                        await self._ingestor.prepare(todo, None)))
        # Through the traces' group commit, in the writer's turn like every write, a
        # group's at a time: a GET /batch waits for one group's transaction at most.
        outcomes: dict[str, Stored | HubError] = {}
        for items in groups:
            due = [i["trace_id"] for i in items if i["trace_id"] in made]
            outcomes |= zip(due, await self._ingestor.store([made[t] for t in due]))
        done = []
        for mark, items in zip(marks, groups):
            errors = [(i["trace_id"], outcomes.get(i["trace_id"])) for i in items]
            if any(isinstance(o, HubError) and o.status == 503 for _, o in errors):
                continue  # not stored for now: the group stays marked, for the next pass
            done.append(mark.segment_id)
            for trace_id, error in errors:
                if isinstance(error, HubError):
                    log.warning("rollout %s of an env's group makes no trajectory: %s",
                                trace_id, error.message)
        if done:
            async with writing(self._engine) as conn:
                await conn.execute(sa.delete(ENV_GROUPS).where(e.segment_id.in_(done)))
                # The segments of groups already served: nothing needs them now.
                in_use = sa.select(GROUPS.c.id).where(GROUPS.c.segment_id == SEGMENTS.c.id)
                await conn.execute(sa.delete(SEGMENTS).where(
                    SEGMENTS.c.id.in_(done), ~in_use.exists()))
        new = sum(1 for o in outcomes.values() if not isinstance(o, HubError) and not o.duplicate)
        log.info("%d env groups became %d trajectories", len(done), new)
        if new and self._on_advance is not None:
            self._on_advance()
        return len(done)

    def _items(self, mark: Any) -> list[dict[str, Any]]:
        group = orjson.loads(inflate(Segment(mark.deflated, 0, 0)))
        gid = group_id(mark.segment_id, mark.received_at)
        scores = group.get("scores") or []
        mean = sum(scores) / len(scores) if scores else 0.0
        messages = group.get("messages") or []
        items = []
        for i, (tokens, masks) in enumerate(zip(group["tokens"], group["masks"])):
            score = scores[i] if i < len(scores) else None
            atropos: dict[str, Any] = {
                "env": mark.env, "env_id": mark.env_id, "step": mark.step, "index": i,
                "group_size": len(group["tokens"]),
                "advantage": None if score is None else score - mean,
            }
            atropos["tokens"] = len(tokens)
            item: dict[str, Any] = {
                "trace_id": f"{gid}-{i}",
                "env": mark.env,
                "reward": score,
                "metadata": {"group": gid, "atropos": atropos},
            }
            chat = messages[i] if i < len(messages) else None
            if not chat:
                chat = self._decoded(tokens, masks)
                atropos["decoded"] = chat is not None
            if chat:
                items.append({"format": "openai", "messages": chat, **item})
            else:
                # Nothing else holds what the policy did: the ids, as sent.
                atropos["token_only"] = True
                item["metadata"] |= {"tokens": tokens, "masks": masks}
                items.append({"format": "native", "task": TOKEN_ONLY_TASK, "steps": [], **item})
        return items

    def _decoded(self, tokens: list[int], masks: list[int]) -> list[dict[str, Any]] | None:
        """The prompt and the generation as text, when a tokenizer is set."""
        tokenizer = self._loaded()
        if tokenizer is None:
            return None
        first = next((k for k, m in enumerate(masks) if m != MASKED), len(tokens))
        return [{"role": "user", "content": tokenizer.decode(tokens[:first])},
                {"role": "assistant", "content": tokenizer.decode(tokens[first:])}]

    def _loaded(self) -> ChatTokenizer | None:
        if self._tokenizer is None and self._tokenizer_name is not None:
            try:
                self._tokenizer = load_tokenizer(self._tokenizer_name)
            except (OSError, ImportError, ValueError) as exc:
                log.warning("tinker.tokenizer %r cannot be loaded (%s): env groups sent "
                            "without messages become token-only trajectories",
                            self._tokenizer_name, exc)
                self._tokenizer_name = None
        return self._tokenizer
