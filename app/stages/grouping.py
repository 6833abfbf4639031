"""The grouping stage (distributor.target `atropos`): the hub's own Atropos env forms
what time, not a delivery, makes due (app/atropos/hub_env.py): its registration once
the trainer has started, groups whose rollouts waited for it, and groups short of
group_size past group_timeout_seconds."""

from __future__ import annotations

from app.atropos.hub_env import HubEnv


class GroupingStage:
    name = "grouping"

    def __init__(self, hub_env: HubEnv, *, poll_seconds: float) -> None:
        self._hub_env = hub_env
        self.poll_seconds = poll_seconds

    async def run_once(self) -> int:
        return await self._hub_env.form()
