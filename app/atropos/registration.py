"""The handshake: the trainer registers the run, its first GET /batch starts it, and
only then may envs register (each gets the next env_id). Also the run's info, and
/reset_data, which returns the hub to "no trainer registered"."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from app.atropos.models import RegisterEnv, Registration
from app.atropos.store import BATCHES, ENVS, GROUPS, STATE, AtroposDb, GroupState
from app.db.types import utcnow

WAIT_FOR_TRAINER = {"status": "wait for trainer to start"}


async def register(db: AtroposDb, registration: Registration) -> dict[str, Any]:
    """The first /register of a run sets it up; later ones (another trainer rank, a
    restarted trainer) only get their own uuid, as with atroposlib."""
    trainer_uuid = uuid.uuid4().int
    values: dict[str, Any] = {"trainer_uuid": str(trainer_uuid), "updated_at": utcnow()}
    async with db.writing() as conn:
        run = await db.run_state(conn, lock=True)
        if not run.registered:
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
        await conn.execute(sa.update(STATE).where(STATE.c.id == 1).values(**values))
    return {"uuid": trainer_uuid}


async def register_env(db: AtroposDb, env: RegisterEnv) -> dict[str, Any]:
    async with db.writing() as conn:
        # The run lock also serialises env ids across hubs sharing the database.
        run = await db.run_state(conn, lock=True)
        if not run.started:
            return dict(WAIT_FOR_TRAINER)
        names = (await conn.execute(sa.select(ENVS.c.desired_name))).scalars().all()
        env_id = len(names)
        real_name = f"{env.desired_name}_{sum(1 for n in names if n == env.desired_name)}"
        await conn.execute(
            sa.insert(ENVS).values(
                env_id=env_id,
                desired_name=env.desired_name,
                real_name=real_name,
                weight=env.weight,
                max_token_length=env.max_token_length,
                group_size=env.group_size,
                min_batch_allocation=env.min_batch_allocation,
                connected=True,
                registered_at=utcnow(),
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
    async with db.writing() as conn:
        result = await conn.execute(
            sa.update(ENVS).where(ENVS.c.env_id == env_id).values(connected=False)
        )
    if result.rowcount != 1:
        return {"status": "failure", "error": f"no env registered with env_id {env_id}"}
    return {"status": "success"}


async def info(db: AtroposDb) -> dict[str, Any]:
    async with db.reading() as conn:
        run = await db.run_state(conn)
    return {"batch_size": run.batch_size, "max_token_len": run.max_token_len}


async def wandb_info(db: AtroposDb) -> dict[str, Any]:
    async with db.reading() as conn:
        run = await db.run_state(conn)
    return {"group": run.wandb_group, "project": run.wandb_project}


async def reset(db: AtroposDb) -> None:
    """What atroposlib's /reset_data clears: the registration, step, envs, buffers,
    queue and formed batches. Like atroposlib, it keeps the latest example and the
    last max_token_len and checkpoint settings."""
    async with db.writing() as conn:
        await db.run_state(conn, lock=True)
        await conn.execute(
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
        await conn.execute(sa.delete(ENVS))
        await conn.execute(sa.delete(BATCHES))
        latest = (
            await conn.execute(
                sa.select(sa.func.max(GROUPS.c.id)).where(GROUPS.c.state != GroupState.BUFFERED)
            )
        ).scalar()
        if latest is None:
            await conn.execute(sa.delete(GROUPS))
            return
        await conn.execute(sa.delete(GROUPS).where(GROUPS.c.id != latest))
        # A wipe, not a step of the pipeline: the one group kept is only an example now.
        await conn.execute(
            sa.update(GROUPS).where(GROUPS.c.id == latest).values(state=GroupState.SERVED)
        )
