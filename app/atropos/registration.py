"""The handshake: the trainer registers the run, its first GET /batch starts it, and
only then may envs register (each gets the next env_id). Also the run's info, and
/reset_data, which returns the hub to "no trainer registered"."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from app.atropos.models import RegisterEnv, Registration
from app.atropos.tables import (
    ATROPOS_BATCHES,
    ENVS,
    GROUP_STATES,
    GROUPS,
    SEGMENTS,
    STATE,
    AtroposDb,
    AtroposGroupState,
    count_dropped,
    not_awaiting_trajectories,
    run_state,
)
from app.db.types import utcnow

WAIT_FOR_TRAINER = {"status": "wait for trainer to start"}


async def register(db: AtroposDb, registration: Registration) -> dict[str, Any]:
    """The first /register of a run sets it up; later ones (another trainer rank, a
    restarted trainer) only get their own uuid, as with atroposlib."""
    trainer_uuid = uuid.uuid4().int

    def work(conn: sa.Connection) -> None:
        values: dict[str, Any] = {"trainer_uuid": str(trainer_uuid), "updated_at": utcnow()}
        if not run_state(conn, lock=True).registered:
            values.update(
                registered=True,
                started=False,
                wandb_group=registration.wandb_group,
                wandb_project=registration.wandb_project,
                batch_size=registration.batch_size,
                max_token_len=registration.max_token_len,
                checkpoint_dir=registration.checkpoint_dir,
                save_checkpoint_interval=registration.save_checkpoint_interval,
                starting_step=registration.starting_step,
                num_steps=registration.num_steps,
                step=registration.starting_step,
            )
        conn.execute(sa.update(STATE).where(STATE.c.id == 1).values(**values))

    await db.write(work)
    return {"uuid": trainer_uuid}


async def register_env(db: AtroposDb, env: RegisterEnv) -> dict[str, Any]:
    return await db.write(lambda conn: register_env_in(conn, env))


def register_env_in(conn: sa.Connection, env: RegisterEnv, *,
                    hub_owned: bool = False) -> dict[str, Any]:
    """Register `env` in the caller's transaction; `hub_owned`: the hub's own env
    (app/atropos/hub_env.py)."""
    # The run lock also serialises env ids across hubs sharing the database.
    run = run_state(conn, lock=True)
    if not run.started:
        return dict(WAIT_FOR_TRAINER)
    now = utcnow()
    names = conn.execute(sa.select(ENVS.c.desired_name)).scalars().all()
    env_id = len(names)
    real_name = f"{env.desired_name}_{sum(1 for n in names if n == env.desired_name)}"
    conn.execute(
        sa.insert(ENVS).values(
            env_id=env_id,
            desired_name=env.desired_name,
            real_name=real_name,
            weight=env.weight,
            max_token_length=env.max_token_length,
            group_size=env.group_size,
            min_batch_allocation=env.min_batch_allocation,
            connected=True,
            hub_owned=hub_owned,
            registered_at=now,
            last_seen_at=now,
        )
    )
    return {
        "status": "success",
        "env_id": env_id,
        "wandb_name": real_name,
        "checkpoint_dir": run.checkpoint_dir or "",
        "starting_step": run.step,
        "checkpoint_interval": run.save_checkpoint_interval,
        "num_steps": run.num_steps,
    }


async def disconnect_env(db: AtroposDb, env_id: int) -> dict[str, Any]:
    def work(conn: sa.Connection) -> int:
        update = sa.update(ENVS).where(ENVS.c.env_id == env_id).values(connected=False)
        return conn.execute(update).rowcount

    if await db.write(work) != 1:
        return {"status": "failure", "error": f"no env registered with env_id {env_id}"}
    return {"status": "success"}


async def info(db: AtroposDb) -> dict[str, Any]:
    run = await db.read(run_state)
    return {"batch_size": run.batch_size, "max_token_len": run.max_token_len}


async def wandb_info(db: AtroposDb) -> dict[str, Any]:
    run = await db.read(run_state)
    return {"group": run.wandb_group, "project": run.wandb_project}


async def reset(db: AtroposDb) -> None:
    """What atroposlib's /reset_data clears: the registration, step, envs, buffers,
    queue and formed batches. Like atroposlib, it keeps the latest example and the
    last max_token_len and checkpoint settings."""
    await db.write(_reset)


def _reset(conn: sa.Connection) -> None:
    run_state(conn, lock=True)
    conn.execute(
        sa.update(STATE)
        .where(STATE.c.id == 1)
        .values(
            registered=False,
            started=False,
            trainer_uuid=None,
            wandb_group=None,
            wandb_project=None,
            batch_size=-1,
            num_steps=-1,
            step=0,
            updated_at=utcnow(),
        )
    )
    conn.execute(sa.delete(ENVS))
    conn.execute(sa.delete(ATROPOS_BATCHES))
    latest = conn.execute(
        sa.select(GROUPS.c.id, GROUPS.c.segment_id)
        .where(GROUPS.c.state != AtroposGroupState.BUFFERED)
        .order_by(GROUPS.c.id.desc())
        .limit(1)
    ).first()
    dropped = conn.execute(sa.delete(GROUPS).where(GROUPS.c.id != (latest.id if latest else -1)))
    count_dropped(conn, dropped.rowcount)
    conn.execute(sa.delete(SEGMENTS).where(
        SEGMENTS.c.id != (latest.segment_id if latest else -1), not_awaiting_trajectories()))
    if latest is not None:
        # A wipe, not a step of the pipeline: the group kept is only an example now.
        conn.execute(
            GROUP_STATES.move(AtroposGroupState.SERVED).where(GROUPS.c.id == latest.id)
        )
