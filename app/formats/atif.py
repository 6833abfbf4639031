"""The Agent Trajectory Interchange Format (Harbor RFC 0001, `schema_version`
"ATIF-v1.x"):

    {"schema_version", "session_id", "agent": {"name", "version", "model_name"?},
     "steps": [{"step_id", "source": "system"|"user"|"agent", "message",
                "reasoning_content"?, "tool_calls"?: [{"tool_call_id", "function_name",
                "arguments"}], "observation"?: {"results": [{"source_call_id"?,
                "content"?}]}, "extra"?}],
     "notes"?, "final_metrics"?, "extra"?}

Parsing: `session_id` is the trace id (a top-level `trace_id` wins); the first user
step is the task; an agent step's reasoning is a thought, its tool calls actions and
its observation results observations; its message is said with the first call, or is
a message, or, in the last agent step without calls, the final answer. Messages may
be v1.6 content-part arrays (text parts are kept). `agent.version`, `notes`,
`final_metrics` and root `extra` go into metadata; per-step `metrics` are dropped
(the original body is stored beside the trace). Tool names come from v1.5
`agent.tool_definitions`.

The environment's reward is read from `final_metrics.extra.reward`,
`final_metrics.reward`, a top-level `reward` or `extra.atropos_hub.outcome.reward`
(several only with the same number), and exported to the first and the last.

ATIF has no place for an outcome, tool errors, exit codes or non-object arguments, so
the export writes them into the `extra` objects the RFC provides, and parsing reads
them back:
- root `extra.atropos_hub`: `{"outcome", "tools", "env", "policy_version"}`;
- step `extra`: `observation_errors` / `observation_exit_codes` (aligned with
  `observation.results`) and `raw_arguments` (`{tool_call_id: text}`; the call's
  `arguments` is then `{}`).
Without those, a result whose content starts with "Error:" is an error.

The export targets ATIF-v1.4 (the RFC revision this follows) and fills its required
fields: a missing trace id or agent name/version becomes a fresh id / "unknown".
"""

from __future__ import annotations

import uuid
from typing import Any

from app.domain import Step, Trace
from app.formats import _common as c
from app.formats.spec import Export, Format

NAME = "atif"
SCHEMA_VERSION = "ATIF-v1.4"
_SOURCES = ("system", "user", "agent")
_HUB = "atropos_hub"
_META_HOMES = ("agent_version", "notes", "final_metrics")


def looks_like(item: dict[str, Any]) -> bool:
    return "schema_version" in item


def parse(item: dict[str, Any]) -> Trace:
    version = c.req_str(item, "schema_version")
    if not version.startswith("ATIF-v1"):
        c.fail("schema_version", f"expected 'ATIF-v1.x', got {version!r}"[:300])
    env = c.envelope(item)
    extra = c.opt_dict(item, "extra") or {}
    hub = c.opt_dict(extra, _HUB, "extra") or {}
    hub_where = f"extra.{_HUB}"
    metadata = {k: v for k, v in c.check_json(extra, "extra").items() if k != _HUB}
    metadata.update(env.metadata)
    names = _agent(item, env, metadata)
    if hub.get("tools") is not None:
        names, _ = c.tools(hub["tools"], f"{hub_where}.tools")
    env.env = env.env or c.opt_str(hub, "env", hub_where)
    env.policy_version = env.policy_version or c.opt_str(hub, "policy_version", hub_where)
    for key in ("notes", "final_metrics"):
        if item.get(key) is not None:
            metadata[key] = c.check_json(item[key], key)
    outcome = c.reported_outcome(
        hub, hub_where, ("reward", item.get("reward")), *_metric_rewards(item)
    )
    task, steps = _steps(c.req_list(item, "steps"))
    c.promote_final(steps)
    return c.build(
        env,
        task=task,
        steps=steps,
        source_format=NAME,
        tools=names,
        outcome=outcome,
        metadata=metadata,
        trace_id=c.opt_str(item, "session_id"),
    )


def export(trace: Trace) -> dict[str, Any]:
    metadata = {k: v for k, v in trace.metadata.items() if k not in _META_HOMES}
    version = trace.metadata.get("agent_version")
    agent: dict[str, Any] = {
        "name": trace.agent.name or "unknown",
        "version": version if isinstance(version, str) else "unknown",
    }
    if trace.agent.model:
        agent["model_name"] = trace.agent.model
    body: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "session_id": trace.trace_id or uuid.uuid4().hex,
        "agent": agent,
        "steps": [_step(n, turn) for n, turn in enumerate(c.turns(trace), start=1)],
    }
    if isinstance(trace.metadata.get("notes"), str):
        body["notes"] = trace.metadata["notes"]
    metrics = trace.metadata.get("final_metrics")
    metrics = dict(metrics) if isinstance(metrics, dict) else {}
    if trace.outcome.reward is not None:
        extra = metrics.get("extra")
        metrics["extra"] = {**(extra if isinstance(extra, dict) else {}),
                            "reward": trace.outcome.reward}
    if metrics:
        body["final_metrics"] = metrics
    body["extra"] = {**metadata, _HUB: _hub(trace)}
    return body


# --- parsing -----------------------------------------------------------------------


def _metric_rewards(item: dict[str, Any]) -> list[tuple[str, Any]]:
    """Where ATIF writers put a verifier's reward: `final_metrics.extra.reward` (the
    RFC's place for custom aggregate metrics) or `final_metrics.reward`."""
    metrics = item.get("final_metrics")
    if not isinstance(metrics, dict):
        return []
    extra = metrics.get("extra")
    return [
        ("final_metrics.extra.reward", extra.get("reward") if isinstance(extra, dict) else None),
        ("final_metrics.reward", metrics.get("reward")),
    ]


def _agent(item: dict[str, Any], env: c.Envelope, metadata: dict[str, Any]) -> list[str] | None:
    agent = c.opt_dict(item, "agent")
    if agent is None:
        return None
    env.agent["model"] = env.agent["model"] or c.opt_str(agent, "model_name", "agent")
    version = c.opt_str(agent, "version", "agent")
    if version is not None:
        metadata["agent_version"] = version
    if agent.get("tool_definitions") is None:
        return None
    names, schemas = c.tools(agent["tool_definitions"], "agent.tool_definitions")
    if schemas:
        metadata["tool_schemas"] = schemas
    return names


def _steps(raw: list[Any]) -> tuple[str, list[c.StepDict]]:
    task: str | None = None
    steps: list[c.StepDict] = []
    for i, step in enumerate(raw):
        where = f"steps[{i}]"
        obj = c.as_dict(step, where)
        source = c.req_str(obj, "source", where)
        if source not in _SOURCES:
            c.fail(
                c.path(where, "source"),
                f"unknown source {source!r}; one of {', '.join(_SOURCES)}"[:300],
            )
        message = c.text_content(obj.get("message"), c.path(where, "message")) or ""
        if source == "user" and task is None:
            task = message
        elif source == "user":
            steps.append(c.message("user", message))
        elif source == "system":
            if message:
                steps.append(c.message("system", message))
            steps.extend(_results(obj, where))
        else:
            steps.extend(_agent_step(obj, message, where))
    return task or "", steps


def _agent_step(obj: dict[str, Any], message: str, where: str) -> list[c.StepDict]:
    steps: list[c.StepDict] = []
    reasoning = c.opt_str(obj, "reasoning_content", where)
    if reasoning and reasoning.strip():
        steps.append(c.thought(reasoning))
    actions = _calls(obj, where)
    if actions and c.has_text(message):
        actions[0]["content"] = message
    elif c.has_text(message):
        steps.append(c.message("assistant", message))
    return steps + actions + _results(obj, where)


def _calls(obj: dict[str, Any], where: str) -> list[c.StepDict]:
    extra = c.opt_dict(obj, "extra", where) or {}
    raw_arguments = extra.get("raw_arguments")
    raw_arguments = raw_arguments if isinstance(raw_arguments, dict) else {}
    actions = []
    for j, call in enumerate(c.opt_list(obj, "tool_calls", where) or []):
        call_where = c.path(c.path(where, "tool_calls"), j)
        call_obj = c.as_dict(call, call_where)
        call_id = c.opt_str(call_obj, "tool_call_id", call_where)
        args = c.arguments(call_obj.get("arguments"), c.path(call_where, "arguments"))
        raw = raw_arguments.get(call_id) if call_id is not None else None
        actions.append(
            c.action(
                c.req_str(call_obj, "function_name", call_where),
                raw if isinstance(raw, str) else args,
                call_id,
            )
        )
    return actions


def _results(obj: dict[str, Any], where: str) -> list[c.StepDict]:
    observation = c.opt_dict(obj, "observation", where)
    if observation is None:
        return []
    obs_where = c.path(where, "observation")
    extra = c.opt_dict(obj, "extra", where) or {}
    errors = extra.get("observation_errors")
    exit_codes = _aligned(extra.get("observation_exit_codes"))
    results = []
    for k, result in enumerate(c.req_list(observation, "results", obs_where)):
        result_where = c.path(c.path(obs_where, "results"), k)
        result_obj = c.as_dict(result, result_where)
        content = c.text_content(result_obj.get("content"), c.path(result_where, "content"))
        results.append(
            c.observation(
                c.opt_str(result_obj, "source_call_id", result_where),
                content,
                _error(errors, k, content),
                c.as_exit_code(exit_codes[k]) if k < len(exit_codes) else None,
            )
        )
    return results


def _aligned(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _error(errors: Any, k: int, content: str | None) -> str | None:
    # Our own `observation_errors`, when present, is authoritative (null = succeeded);
    # otherwise the content speaks for itself.
    if isinstance(errors, list) and k < len(errors):
        return errors[k] if isinstance(errors[k], str) and errors[k] else None
    return c.error_from_text(content)


# --- export ------------------------------------------------------------------------


def _hub(trace: Trace) -> dict[str, Any]:
    hub: dict[str, Any] = {"outcome": trace.outcome.model_dump(mode="json", exclude_none=True)}
    if trace.tools is not None:
        hub["tools"] = list(trace.tools)
    if trace.env is not None:
        hub["env"] = trace.env
    if trace.policy_version is not None:
        hub["policy_version"] = trace.policy_version
    return hub


def _step(step_id: int, turn: c.Turn) -> dict[str, Any]:
    if turn.role != "assistant":
        return {"step_id": step_id, "source": turn.role, "message": turn.text or ""}
    step: dict[str, Any] = {"step_id": step_id, "source": "agent", "message": turn.text or ""}
    extra: dict[str, Any] = {}
    if turn.thought is not None:
        step["reasoning_content"] = turn.thought
    if turn.actions:
        step["tool_calls"] = [_call(a, id_, extra) for a, id_ in zip(turn.actions, turn.call_ids)]
    if turn.observations:
        step["observation"] = {"results": _observation_results(turn, extra)}
    if extra:
        step["extra"] = extra
    return step


def _call(action: Step, call_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    args = action.arguments
    if isinstance(args, str):
        # ATIF arguments must be an object; keep the text the agent wrote beside it.
        extra.setdefault("raw_arguments", {})[call_id] = args
    return {
        "tool_call_id": call_id,
        "function_name": action.tool or "",
        "arguments": args if isinstance(args, dict) else {},
    }


def _observation_results(turn: c.Turn, extra: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for obs, call_id in zip(turn.observations, turn.result_ids):
        result: dict[str, Any] = {}
        # Harbor's validator checks that a result names a call of its own step.
        if call_id in turn.call_ids:
            result["source_call_id"] = call_id
        if obs.content is not None:
            result["content"] = obs.content
        results.append(result)
    errors = [o.error for o in turn.observations]
    if any(o.error != c.error_from_text(o.content) for o in turn.observations):
        extra["observation_errors"] = errors
    exit_codes = [o.exit_code for o in turn.observations]
    if any(code is not None for code in exit_codes):
        extra["observation_exit_codes"] = exit_codes
    return results


FORMAT = Format(
    NAME,
    parse,
    looks_like,
    detected_by="'schema_version'",
    step_lists=("steps",),
    exports=(Export(NAME, export),),
)
