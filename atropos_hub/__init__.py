"""A client for agents that are not instrumented: log each trajectory to an
atropos-hub as it ends, and the hub stores, scores and batches it.

    from atropos_hub import Client

    with Client("http://127.0.0.1:8000") as hub:
        hub.log({"task": "...", "steps": [...], "outcome": {"status": "success"}})

`log` returns at once (the trace's id); traces are sent in the background, in gzipped
batches, retried until the hub acknowledges them. `AsyncClient` is the same for
asyncio code (`await hub.log(trace)`).
"""

from atropos_hub.client import AsyncClient, Client, HubError

__all__ = ["AsyncClient", "Client", "HubError"]
