"""A tiny loader for the real long trajectories in ../shared/fixtures/real, for the
compression tests and bench only (the adapters for these sources live elsewhere).

- OpenHands multi_swe_bench output lines: `history` events (run/read/edit/think/finish
  actions with `args`; run/read/edit/error observations with `cause`).
- SWE-agent `.traj`: `trajectory[]` of thought/action/observation, task from `history`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from app.domain import Outcome, Status, Step, StepType, Trace

REAL = Path(__file__).resolve().parents[1].parent / "shared/fixtures/real"
OPENHANDS = sorted(REAL.glob("openhands/multi_swe_bench_*.jsonl"))
SWE_AGENT = sorted(REAL.glob("swe-agent/*.traj"))

# The OpenHands arguments that say what a tool call did (the rest is bookkeeping).
_OH_ARGS = ("command", "path", "view_range", "old_str", "new_str", "file_text", "insert_line")
# SWE-agent flags no tool error; these are the texts its tools print on one.
_SWE_ERROR = re.compile(
    r"Traceback \(most recent call last\)|command not found|introduced new syntax error"
)


def load(path: Path) -> Trace:
    return load_openhands(path) if path.suffix == ".jsonl" else load_swe_agent(path)


def load_openhands(path: Path) -> Trace:
    run = json.loads(path.read_text().splitlines()[0])
    steps: list[Step] = []
    call_ids: dict[str, str] = {}
    status = Status.TIMEOUT if "maximum iteration" in (run.get("error") or "") else Status.UNKNOWN
    for event in run["history"]:
        action, args = event.get("action"), event.get("args") or {}
        if action == "system":
            steps.append(Step(type=StepType.MESSAGE, role="system", content=args["content"]))
        elif action in ("run", "read", "edit"):
            _thought(steps, args.get("thought"))
            call_id = (event.get("tool_call_metadata") or {}).get("tool_call_id") or event["id"]
            call_ids[str(event["id"])] = call_id
            arguments = {k: args[k] for k in _OH_ARGS if args.get(k) not in (None, "None", "")}
            steps.append(
                Step(type=StepType.ACTION, tool=action, arguments=arguments, call_id=call_id)
            )
        elif action == "think":
            _thought(steps, args.get("thought"))
        elif action == "finish":
            _thought(steps, args.get("thought"))
            steps.append(
                Step(type=StepType.FINAL, content=args.get("final_thought") or event["message"])
            )
            status = Status.SUCCESS if args.get("task_completed") == "true" else Status.FAILURE
        elif event.get("observation") in ("run", "read", "edit", "error"):
            steps.append(_oh_observation(event, call_ids.get(str(event.get("cause")))))
    return Trace(
        trace_id=run["instance_id"],
        task=run["instruction"],
        steps=steps,
        outcome=Outcome(status=status, reason=run.get("error")),
        source_format="openhands",
    )


def _oh_observation(event: dict[str, Any], call_id: str | None) -> Step:
    content = event["content"]
    exit_code = ((event.get("extras") or {}).get("metadata") or {}).get("exit_code")
    failed = (
        event["observation"] == "error"
        or (exit_code is not None and exit_code != 0)
        or content.startswith("ERROR:")
    )
    return Step(
        type=StepType.OBSERVATION,
        call_id=call_id,
        content=content,
        exit_code=exit_code,
        error=content if failed else None,
    )


def load_swe_agent(path: Path) -> Trace:
    run = json.loads(path.read_text())
    history = run["history"]
    task = next(m["content"] for m in history if m["role"] == "user" and not m.get("is_demo"))
    steps = [Step(type=StepType.MESSAGE, role="system", content=history[0]["content"])]
    for i, turn in enumerate(run["trajectory"]):
        _thought(steps, turn["thought"])
        action = turn["action"].strip()
        call_id = f"call_{i}"
        steps.append(
            Step(type=StepType.ACTION, tool=action.split()[0], arguments=action, call_id=call_id)
        )
        out = turn["observation"]
        error = out if _SWE_ERROR.search(out) else None
        steps.append(Step(type=StepType.OBSERVATION, call_id=call_id, content=out, error=error))
    return Trace(
        trace_id=path.stem,
        task=task,
        steps=steps,
        outcome=Outcome(reason=run["info"].get("exit_status")),
        source_format="swe-agent",
    )


def _thought(steps: list[Step], text: str | None) -> None:
    if text and text.strip():
        steps.append(Step(type=StepType.THOUGHT, content=text))
