"""Training runs: the trainer and environment processes the hub starts, watches and
stops. `RunSupervisor` is the entry point; see docs/runs.md."""

from __future__ import annotations

from app.runs.records import RunStatus
from app.runs.spec import HealthCheck, ProcessSpec, RunSpec
from app.runs.supervisor import RunSupervisor

__all__ = ["HealthCheck", "ProcessSpec", "RunSpec", "RunStatus", "RunSupervisor"]
