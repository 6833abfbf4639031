"""Training runs: the trainer and environment processes the hub starts, watches and
stops. `app.runs.supervisor.RunSupervisor` is the entry point, imported from there
alone: the API's schemas import this package, and a hub whose runs are off needs no
supervisor (nor its HTTP client) to serve. See docs/runs.md."""

from __future__ import annotations

from app.runs.records import RunStatus
from app.runs.spec import HealthCheck, ProcessSpec, RunSpec

__all__ = ["HealthCheck", "ProcessSpec", "RunSpec", "RunStatus"]
