"""Traces and steps for tests: the domain objects (for the scoring and filter tests)
and the JSON a client sends (native_trace, whose steps may be given as domain steps)."""

from __future__ import annotations

from typing import Any

from app.domain import Outcome, Status, Step, StepType, Trace


def thought(text: str | None = "thinking") -> Step:
    return Step(type=StepType.THOUGHT, content=text)


def action(tool: str | None = "bash", arguments: Any = None, call_id: str | None = None) -> Step:
    return Step(type=StepType.ACTION, tool=tool, arguments=arguments, call_id=call_id)


def observation(
    content: str = "ok",
    *,
    error: str | None = None,
    exit_code: int | None = None,
    call_id: str | None = None,
) -> Step:
    return Step(type=StepType.OBSERVATION, content=content, error=error, exit_code=exit_code,
                call_id=call_id)


def message(role: str, content: str | None) -> Step:
    return Step(type=StepType.MESSAGE, role=role, content=content)


def final(text: str | None) -> Step:
    return Step(type=StepType.FINAL, content=text)


def trace(*steps: Step, status: Status = Status.UNKNOWN, **fields: Any) -> Trace:
    code_runs_ok = fields.pop("code_runs_ok", None)
    outcome = Outcome(status=status, code_runs_ok=code_runs_ok)
    return Trace(task="t", steps=list(steps), outcome=outcome, **fields)


def native_trace(**overrides: Any) -> dict[str, Any]:
    """A small, valid native trace as a client posts it: a thought, a tool call, its
    result, a final answer. Steps given as domain Steps are sent as their JSON."""
    trace: dict[str, Any] = {
        "task": "How many lines are in notes.txt?",
        "agent": {"name": "hermes", "model": "example/model-8b"},
        "env": "shell",
        "steps": [
            {"type": "thought", "content": "Count them with wc."},
            {"type": "action", "tool": "terminal", "arguments": {"command": "wc -l notes.txt"},
             "call_id": "c1"},
            {"type": "observation", "call_id": "c1", "content": "12 notes.txt", "exit_code": 0},
            {"type": "final", "content": "notes.txt has 12 lines."},
        ],
        "outcome": {"status": "success"},
    }
    trace.update(overrides)
    if isinstance(trace["steps"], list):
        trace["steps"] = [
            s.model_dump(mode="json", exclude_none=True) if isinstance(s, Step) else s
            for s in trace["steps"]
        ]
    return trace


def long_trace(trace_id: str, steps: int = 60) -> dict[str, Any]:
    """A native trace of `steps` thought/action/observation rounds (~125 tokens each),
    long enough to be compressed."""
    body: list[dict[str, Any]] = []
    for i in range(steps):
        body += [
            {"type": "thought", "content": f"Step {i}: the build of module {i} failed; look."},
            {"type": "action", "tool": "terminal", "call_id": f"c{i}",
             "arguments": {"command": f"make target_{i}"}},
            {"type": "observation", "call_id": f"c{i}", "exit_code": 0,
             "content": " ".join(f"compiling src/module_{j}.py ok" for j in range(12))},
        ]
    body.append({"type": "final", "content": "The build passes now."})
    return native_trace(trace_id=trace_id, steps=body)
