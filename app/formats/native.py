"""The hub's own format, in the seed documents' vocabulary:

    {"trace_id"?, "task", "agent"?: {"name", "model"}, "env"?, "policy_version"?,
     "tools"?, "steps": [{"type": ..., ...}], "outcome"?: {"status", "code_runs_ok"?,
     "reason"?, "reward"?}, "reward"?, "metadata"?}

Decisions:
- `task` is required and must be a non-empty string: native traces are written by
  the agent's own harness, which knows its task, and every reward rule reads it.
- `steps` is required (it may be empty). Step keys are those of `app.domain.Step`;
  an unknown top-level or step key is refused, so a typo such as "outcom" cannot
  silently drop the outcome that drives the reward.
- A `message` step without `role` is the assistant speaking; roles are system,
  user, assistant.
- Observation `error` may be a string or a boolean: true becomes the text "error",
  false/""/null mean success. `content` may be a JSON object or array, kept as its
  compact JSON text.
- `outcome.reward` (or a top-level `reward`) is the environment's own scalar reward;
  it never sets the status, which stays `unknown` unless `outcome.status` says.
- `tools` is a list of tool names or of tool schemas (OpenAI or Hermes style);
  schemas are kept in `metadata["tool_schemas"]` for the exports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from app.domain import Step, StepType, Trace
from app.formats import _common as c
from app.formats.spec import Export, Format

NAME = "native"
_TOP_KEYS = frozenset(
    {
        "format",
        "trace_id",
        "task",
        "agent",
        "env",
        "policy_version",
        "tools",
        "steps",
        "outcome",
        "reward",
        "metadata",
    }
)
_STEP_KEYS = frozenset(Step.model_fields)
_ROLES = ("system", "user", "assistant")
_TYPES = ", ".join(t.value for t in StepType)


def looks_like(item: dict[str, Any]) -> bool:
    # ATIF has `steps` too; its `schema_version` tells them apart.
    return ("steps" in item or "task" in item) and "schema_version" not in item


def parse(item: dict[str, Any]) -> Trace:
    if not item.keys() <= _TOP_KEYS:  # the common case, checked as one set operation
        _refuse_unknown_key(item, _TOP_KEYS, "", "a native trace")
    env = c.envelope(item)
    task = c.req_str(item, "task")
    if not task.strip():
        c.fail("task", "must not be empty")
    names: list[str] | None = None
    if item.get("tools") is not None:
        names, schemas = c.tools(item["tools"], "tools")
        if schemas:
            env.metadata["tool_schemas"] = schemas
    return c.build(
        env,
        task=task,
        steps=[_step(raw, i) for i, raw in enumerate(c.req_list(item, "steps"))],
        source_format=NAME,
        tools=names,
        outcome=c.reported_outcome(item),
    )


def export(trace: Trace) -> dict[str, Any]:
    body = trace.model_dump(mode="json", exclude_none=True, exclude={"source_format"})
    if not body.get("metadata"):
        body.pop("metadata", None)
    if not body.get("agent"):
        body.pop("agent", None)
    return body


def _step(raw: Any, i: int) -> c.StepDict:
    where = f"steps[{i}]"
    obj = c.as_dict(raw, where)
    if not obj.keys() <= _STEP_KEYS:
        _refuse_unknown_key(obj, _STEP_KEYS, where, "a step")
    kind = obj.get("type")
    if kind is None:
        c.fail(c.path(where, "type"), f"required; one of {_TYPES}")
    reader = _READERS.get(kind) if isinstance(kind, str) else None
    if reader is None:
        c.fail(c.path(where, "type"), f"unknown step type {kind!r}; one of {_TYPES}"[:300])
    return reader(obj, where)


def _refuse_unknown_key(
    obj: dict[str, Any], known: frozenset[str], where: str, what: str
) -> NoReturn:
    key = next(k for k in obj if k not in known)
    c.fail(c.path(where, key), f"unknown key; {what} has {', '.join(sorted(known))}"[:400])


def _thought(obj: dict[str, Any], where: str) -> c.StepDict:
    return c.thought(c.opt_str(obj, "content", where) or "")


def _final(obj: dict[str, Any], where: str) -> c.StepDict:
    return c.final(c.opt_str(obj, "content", where) or "")


def _message(obj: dict[str, Any], where: str) -> c.StepDict:
    role = c.opt_str(obj, "role", where) or "assistant"
    if role not in _ROLES:
        c.fail(c.path(where, "role"), f"unknown role {role!r}; one of {', '.join(_ROLES)}")
    return c.message(role, c.opt_str(obj, "content", where) or "")


def _action(obj: dict[str, Any], where: str) -> c.StepDict:
    tool = c.req_str(obj, "tool", where)
    return c.action(
        tool,
        c.arguments(obj.get("arguments"), c.path(where, "arguments")),
        c.opt_str(obj, "call_id", where),
        c.opt_str(obj, "content", where),
    )


def _observation(obj: dict[str, Any], where: str) -> c.StepDict:
    content = obj.get("content")
    if isinstance(content, (dict, list)):
        content = c.dumps(content, c.path(where, "content"))
    elif content is not None and not isinstance(content, str):
        c.fail(c.path(where, "content"), f"expected a string, got {c.type_name(content)}")
    error = obj.get("error")
    return c.observation(
        c.opt_str(obj, "call_id", where),
        content,
        None if error is None else c.error_text(error, c.path(where, "error")),
        c.opt_exit_code(obj, "exit_code", where),
    )


_READERS: dict[str, Callable[[dict[str, Any], str], c.StepDict]] = {
    StepType.THOUGHT.value: _thought,
    StepType.FINAL.value: _final,
    StepType.MESSAGE.value: _message,
    StepType.ACTION.value: _action,
    StepType.OBSERVATION.value: _observation,
}


FORMAT = Format(
    NAME,
    parse,
    looks_like,
    detected_by="'steps' and 'task'",
    step_lists=("steps",),
    # The hub's own record, not one a trainer takes.
    exports=(Export(NAME, export, training=False),),
)
