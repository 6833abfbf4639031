"""The Atropos trajectory API's domain: registration, queueing (with per-env
buffering and a bound), batch formation, leases. No HTTP here; app/api/atropos.py
maps the paths onto `Atropos`.

Modules: models (request bodies), tables (tables, states, write transactions),
registration, status, queue, packing (pure batch formation), trainer_batches, lease,
logprobs, service (`Atropos`)."""

from __future__ import annotations

from app.atropos.service import Atropos

__all__ = ["Atropos"]
