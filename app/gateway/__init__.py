"""The hub as the agents' model endpoint (docs/gateway.md): an OpenAI-compatible
gateway that forwards each call upstream, streams the answer back as it comes, and
captures every call, committed before the last byte of its answer goes out; the calls
of a rollout become one trajectory (app/stages/rollouts.py, app/formats/gateway.py)."""
