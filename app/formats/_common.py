"""Helpers the four format modules share: typed field readers that raise `Invalid`
with the JSON path at fault, step constructors, the envelope and outcome keys every
format accepts, and `turns()`, which regroups canonical steps into chat turns for
the exports.

Parsers build steps as plain dicts (`StepDict`) and `build()` validates the whole
trace once with pydantic at the end. The readers here check every field first, so
that the client gets an error naming the exact JSON path; the final validation is
the constructor (measured: cheaper than `model_construct`, which resolves defaults
in Python) and a backstop that cannot let a malformed trace through.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

import orjson
from pydantic import ValidationError

from app.domain import MAX_REWARD, Status, Step, StepType, Trace
from app.errors import Invalid

STATUSES = ", ".join(s.value for s in Status)
StepDict = dict[str, Any]  # a step on its way to `Step`; see the module docstring
# Exit codes live in a 64-bit column downstream; anything wider is not an exit code.
_EXIT_CODE_LIMIT = 2**63
_ERROR_PREFIX = re.compile(r"\s*error:", re.IGNORECASE)
_TEXT_PARTS = ("text", "input_text", "output_text")


# --- typed readers ---------------------------------------------------------------


def fail(field: str | None, message: str) -> NoReturn:
    raise Invalid(f"{field}: {message}" if field else message, field=field)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def opt_str(obj: dict[str, Any], key: str, parent: str = "") -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    fail(path(parent, key), f"expected a string, got {type_name(value)}")


def req_str(obj: dict[str, Any], key: str, parent: str = "") -> str:
    value = obj.get(key)
    if isinstance(value, str):
        return value
    if value is None:
        fail(path(parent, key), "required string is missing")
    fail(path(parent, key), f"expected a string, got {type_name(value)}")


def opt_dict(obj: dict[str, Any], key: str, parent: str = "") -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, dict):
        return value
    fail(path(parent, key), f"expected an object, got {type_name(value)}")


def opt_list(obj: dict[str, Any], key: str, parent: str = "") -> list[Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value
    fail(path(parent, key), f"expected an array, got {type_name(value)}")


def req_list(obj: dict[str, Any], key: str, parent: str = "") -> list[Any]:
    value = opt_list(obj, key, parent)
    if value is None:
        fail(path(parent, key), "required array is missing")
    return value


def as_dict(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    fail(where, f"expected an object, got {type_name(value)}")


def opt_bool(obj: dict[str, Any], key: str, parent: str = "") -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    fail(path(parent, key), f"expected true or false, got {type_name(value)}")


def as_exit_code(value: Any) -> int | None:
    """An exit code, or None for anything that is not one."""
    # bool is an int subclass; `true` is not an exit code.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < _EXIT_CODE_LIMIT:
        return value
    return None


def opt_exit_code(obj: dict[str, Any], key: str, parent: str = "") -> int | None:
    value = obj.get(key)
    code = as_exit_code(value)
    if code is None and value is not None:
        fail(path(parent, key), f"expected an integer exit code, got {type_name(value)}")
    return code


def dumps(value: Any, where: str | None = None) -> str:
    """Compact JSON, keys in their given order (so a re-parse gives the same text)."""
    try:
        return orjson.dumps(value).decode()
    except (orjson.JSONEncodeError, TypeError) as exc:
        # orjson refuses nesting deeper than 254, integers wider than 64 bits and lone
        # surrogates; all of those are bad input, not a server fault.
        fail(where, f"cannot be stored as JSON ({exc})")


def loads(text: str) -> Any:
    """Parsed JSON, or the `_NOT_JSON` marker; never raises."""
    try:
        return orjson.loads(text)
    except (orjson.JSONDecodeError, RecursionError):
        return NOT_JSON


NOT_JSON: Any = object()


def check_json(value: Any, where: str) -> Any:
    """Refuse values that downstream JSON columns and token counting cannot encode."""
    if isinstance(value, (dict, list)):
        dumps(value, where)
    return value


# --- shared field semantics ------------------------------------------------------


def arguments(value: Any, where: str) -> Any:
    """Tool-call arguments: a JSON object, or the raw string when it is not one. Other
    JSON values (an array, a number) are kept as sent: an agent that wrote them made an
    invalid tool call, which the `invalid_tool_call` rule scores, not a bad request."""
    if isinstance(value, str):
        parsed = loads(value)
        return check_json(parsed, where) if isinstance(parsed, dict) else value
    return check_json(value, where)


def text_content(value: Any, where: str) -> str | None:
    """Message content: a string, or a list of parts of which the text ones count
    (OpenAI `{"type": "text", "text"}` and its Responses-API `input_text`/`output_text`,
    ATIF v1.6 content parts); images and other media are skipped."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        fail(where, f"expected a string or an array of content parts, got {type_name(value)}")
    texts: list[str] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            texts.append(part)
            continue
        part = as_dict(part, path(where, i))
        text = opt_str(part, "text", path(where, i))
        if text is not None and part.get("type", "text") in _TEXT_PARTS:
            texts.append(text)
    return "\n".join(texts)


def error_text(value: Any, where: str) -> str | None:
    """Observation `error`: text, or a boolean (true means an unnamed error)."""
    if value is None or value is False or value == "":
        return None
    if value is True:
        return "error"
    if isinstance(value, str):
        return value
    fail(where, f"expected a string or a boolean, got {type_name(value)}")


def error_from_text(content: str | None) -> str | None:
    """Tool output that announces its own failure ("Error: ..."), as OpenAI-style
    agents and Hermes' batch_runner both write it."""
    if content and _ERROR_PREFIX.match(content):
        return content
    return None


def split_think(text: str) -> tuple[list[str], str]:
    """(non-empty <think> blocks, the rest). Hermes pads every gpt turn with an empty
    think block, so an empty one says nothing and is dropped. A block left open runs
    to the end of the text (the model was cut off while thinking)."""
    if "<think>" not in text:
        return [], text
    blocks, rest = tag_blocks(text, "<think>", "</think>", open_to_end=True)
    thoughts = [block.strip() for block in blocks]
    return [t for t in thoughts if t], rest


def tag_blocks(
    text: str, open_tag: str, close_tag: str, *, open_to_end: bool = False
) -> tuple[list[str], str]:
    """The text inside each `open_tag`...`close_tag` block, in order, and the text
    with the blocks taken out. A block ends at the first `close_tag` after it opens;
    one never closed runs to the end of the text when `open_to_end`, else it is left
    in the text as written.

    str.find, in linear time: a lazy regex would be retried from every opening tag to
    the end of the text, quadratic on a turn of many unclosed tags."""
    inside: list[str] = []
    outside: list[str] = []
    position = 0
    while (start := text.find(open_tag, position)) != -1:
        body = start + len(open_tag)
        end = text.find(close_tag, body)
        if end == -1:
            if open_to_end:
                inside.append(text[body:])
                outside.append(text[position:start])
                position = len(text)
            break  # no later block can close either
        inside.append(text[body:end])
        outside.append(text[position:start])
        position = end + len(close_tag)
    outside.append(text[position:])
    return inside, "".join(outside)


def tools(value: Any, where: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Tool names and schemas from a list of names, OpenAI tool schemas
    (`{"type": "function", "function": {...}}`) or Hermes/legacy ones (`{"name", ...}`).
    Schemas come back in OpenAI form, the one the exports start from."""
    if not isinstance(value, list):
        fail(where, f"expected an array of tool names or schemas, got {type_name(value)}")
    names: list[str] = []
    schemas: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        if isinstance(tool, str):
            names.append(tool)
            continue
        spec = as_dict(tool, path(where, i))
        inner = spec.get("function")
        if isinstance(inner, dict):
            spec = inner
        name = req_str(spec, "name", path(where, i))
        names.append(name)
        schema = {k: v for k, v in spec.items() if k in ("name", "description", "parameters")}
        schemas.append({"type": "function", "function": check_json(schema, path(where, i))})
    return names, schemas


def tool_schemas(trace: Trace) -> dict[str, dict[str, Any]]:
    """name -> OpenAI schema, from `metadata["tool_schemas"]` where parsing kept them."""
    found: dict[str, dict[str, Any]] = {}
    raw = trace.metadata.get("tool_schemas")
    for schema in raw if isinstance(raw, list) else []:
        inner = schema.get("function") if isinstance(schema, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("name"), str):
            found[inner["name"]] = inner
    return found


def openai_tools(trace: Trace) -> list[dict[str, Any]]:
    """The trace's tools as OpenAI schemas: those it carried; for a tool known only by
    name, or when the trace declared no tools at all, the schema its calls imply (the
    name, and each argument key with its JSON type when every call agrees on one). A
    tool never called and never described gets an empty parameter object, which is
    valid and claims nothing."""
    known = tool_schemas(trace)
    implied = _implied_schemas(trace)
    names = trace.tools if trace.tools is not None else list(implied)
    empty = {"type": "object", "properties": {}}
    return [
        {
            "type": "function",
            "function": known.get(name) or implied.get(name) or {"name": name, "parameters": empty},
        }
        for name in names
    ]


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def _implied_schemas(trace: Trace) -> dict[str, dict[str, Any]]:
    """name -> the schema the trace's calls imply, in the order tools were first called."""
    seen: dict[str, dict[str, set[str]]] = {}
    for step in trace.steps:
        if step.type is not StepType.ACTION or not step.tool:
            continue
        keys = seen.setdefault(step.tool, {})
        if isinstance(step.arguments, dict):
            for key, value in step.arguments.items():
                json_type = next((t for kind, t in _JSON_TYPES if isinstance(value, kind)), None)
                keys.setdefault(key, set()).add(json_type or "null")
    return {
        name: {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {
                    key: {"type": types.pop()} if len(types) == 1 and "null" not in types else {}
                    for key, types in keys.items()
                },
            },
        }
        for name, keys in seen.items()
    }


def status(value: Any, where: str) -> Status:
    if isinstance(value, str):
        try:
            return Status(value.strip().lower())
        except ValueError:
            pass
    fail(where, f"expected one of {STATUSES}, got {value!r}"[:300])


def outcome_object(value: Any, where: str) -> dict[str, Any]:
    obj = as_dict(value, where)
    raw = obj.get("status")
    reward = obj.get("reward")
    return {
        "status": Status.UNKNOWN if raw is None else status(raw, path(where, "status")),
        "code_runs_ok": opt_bool(obj, "code_runs_ok", where),
        "reason": opt_str(obj, "reason", where),
        "reward": None if reward is None else reward_value(reward, path(where, "reward")),
    }


def reward_value(value: Any, where: str) -> float:
    """An environment's reward: a finite number (a boolean is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(where, f"expected a number, got {type_name(value)}")
    try:
        number = float(value)
    except OverflowError:
        fail(where, "number out of range")
    if not math.isfinite(number):
        fail(where, "expected a finite number")
    if abs(number) > MAX_REWARD:
        fail(where, f"{number:g} is out of range: a reward is at most {MAX_REWARD:g} in "
             "magnitude")
    return number


def env_reward(*places: tuple[str, Any]) -> float | None:
    """The environment's reward from whichever of `places` ((JSON path, value), None
    where absent) carry it. Several may, with the same number; two different numbers
    are refused rather than one silently chosen."""
    found: tuple[str, float] | None = None
    for where, value in places:
        if value is None:
            continue
        number = reward_value(value, where)
        if found is None:
            found = (where, number)
        elif number != found[1]:
            fail(where, f"{number!r} differs from {found[0]} ({found[1]!r}); the trace must "
                 "carry one environment reward")
    return None if found is None else found[1]


def reported_outcome(
    obj: dict[str, Any], parent: str = "", *also: tuple[str, Any]
) -> dict[str, Any]:
    """The outcome keys every format accepts beside its own: `outcome` (as in native),
    a top-level `status`, and the environment's reward as `outcome.reward` or a
    top-level `reward` (`also`: the format's own places for it). The status is only
    what the trace reported: a reward never makes one, so without one it is unknown."""
    outcome: dict[str, Any] = {"status": Status.UNKNOWN, "reward": None}
    if obj.get("outcome") is not None:
        outcome = outcome_object(obj["outcome"], path(parent, "outcome"))
    if obj.get("status") is not None and outcome["status"] is Status.UNKNOWN:
        outcome["status"] = status(obj["status"], path(parent, "status"))
    outcome["reward"] = env_reward(
        (path(path(parent, "outcome"), "reward"), outcome["reward"]),
        (path(parent, "reward"), obj.get("reward")),
        *also,
    )
    return outcome


@dataclass(slots=True)
class Envelope:
    """The keys every format accepts at the top level, beside its own."""

    trace_id: str | None
    env: str | None
    policy_version: str | None
    agent: dict[str, str | None]  # name, model
    metadata: dict[str, Any]


def envelope(item: dict[str, Any]) -> Envelope:
    agent = opt_dict(item, "agent")
    metadata = opt_dict(item, "metadata")
    return Envelope(
        trace_id=opt_str(item, "trace_id"),
        env=opt_str(item, "env"),
        policy_version=opt_str(item, "policy_version"),
        agent={"name": opt_str(agent, "name", "agent"), "model": opt_str(agent, "model", "agent")}
        if agent is not None
        else {"name": None, "model": None},
        metadata=dict(check_json(metadata, "metadata")) if metadata else {},
    )


# --- step construction -------------------------------------------------------------


def thought(content: str) -> StepDict:
    return {"type": "thought", "content": content}


def message(role: str, content: str) -> StepDict:
    return {"type": "message", "role": role, "content": content}


def final(content: str) -> StepDict:
    return {"type": "final", "content": content}


def action(
    tool: str | None, args: Any, call_id: str | None, content: str | None = None
) -> StepDict:
    return {
        "type": "action",
        "tool": tool,
        "arguments": args,
        "call_id": call_id,
        "content": content,
    }


def observation(
    call_id: str | None,
    content: str | None,
    error: str | None = None,
    exit_code: int | None = None,
) -> StepDict:
    return {
        "type": "observation",
        "call_id": call_id,
        "content": content,
        "error": error,
        "exit_code": exit_code,
    }


def has_text(text: str | None) -> bool:
    return bool(text and text.strip())


def promote_final(steps: list[StepDict]) -> None:
    """Chat formats have no "final" marker: the last assistant turn, when it calls no
    tool, is the answer. Thoughts are skipped because they precede the text of the
    same turn."""
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if step["type"] in ("action", "final"):
            return
        if step["type"] == "message" and step["role"] == "assistant":
            steps[i] = final(step["content"])
            return


def build(
    env: Envelope,
    *,
    task: str,
    steps: list[StepDict],
    source_format: str,
    tools: list[str] | None = None,
    outcome: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    trace_id: str | None = None,
) -> Trace:
    try:
        return Trace.model_validate(
            {
                "trace_id": env.trace_id if env.trace_id is not None else trace_id,
                "task": task,
                "agent": env.agent,
                "env": env.env,
                "policy_version": env.policy_version,
                "tools": tools,
                "steps": steps,
                "outcome": outcome or {},
                "metadata": env.metadata if metadata is None else metadata,
                "source_format": source_format,
            }
        )
    except ValidationError as exc:
        # The readers above should have caught this with a better message; if one
        # missed a case, still answer 422 with the path pydantic found.
        first = exc.errors()[0]
        where = ""
        for part in first["loc"]:
            where = path(where, part)
        fail(where or None, first["msg"])


# --- exports: canonical steps back into chat turns ----------------------------------


@dataclass(slots=True)
class Turn:
    """One chat turn. For `role == "assistant"`: optional reasoning, text, the tool
    calls it made and the results that came back for them; otherwise a plain
    system/user message in `text`."""

    role: str
    text: str | None = None
    thought: str | None = None
    actions: list[Step] = field(default_factory=list)
    observations: list[Step] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    result_ids: list[str | None] = field(default_factory=list)

    def tool_of(self, call_id: str | None) -> str | None:
        for action_, id_ in zip(self.actions, self.call_ids):
            if id_ == call_id:
                return action_.tool
        return None


def turns(trace: Trace) -> list[Turn]:
    """Group canonical steps into turns: a thought opens an assistant turn; text, tool
    calls and their results join it in that order; anything out of that order opens
    the next one. The task becomes the first user turn, after any leading system
    messages. Tool calls without an id get `call_N`, and results without one are
    matched to calls by position, so every export can link results to calls."""
    out: list[Turn] = []
    current: Turn | None = None
    task_pending = bool(trace.task)
    for step in trace.steps:
        if task_pending and not (step.type is StepType.MESSAGE and step.role == "system"):
            out.append(Turn("user", trace.task))
            task_pending = False
        if step.type is StepType.MESSAGE and step.role != "assistant":
            out.append(Turn(step.role or "user", step.content or ""))
            current = None
            continue
        if current is None or _opens_turn(current, step):
            current = Turn("assistant")
            out.append(current)
        _add(current, step)
    if task_pending:
        out.append(Turn("user", trace.task))
    _link_ids(out)
    return out


def chat(trace: Trace) -> list[Turn]:
    """`turns()` as a chat template or a trainer accepts it, for the training exports:
    - one system turn, first: the leading system messages joined; a system message
      later in the run is the environment speaking, so a user turn;
    - a tool result that answers no call of its assistant turn (smolagents' and
      OpenHands' reply to output that made no valid call) is a user turn after it;
    - an assistant turn with nothing in it (no text, reasoning or call) is left out;
    - user turns that end up next to each other are joined into one."""
    out: list[Turn] = []
    for turn in turns(trace):
        if turn.role == "assistant":
            answered = [i for i, r in enumerate(turn.result_ids) if r in turn.call_ids]
            stray = [obs for i, obs in enumerate(turn.observations) if i not in answered]
            turn.observations = [turn.observations[i] for i in answered]
            turn.result_ids = [turn.result_ids[i] for i in answered]
            said = has_text(turn.thought) or has_text(turn.text) or bool(turn.actions)
            if said:
                out.append(turn)
            if stray:
                _add_user(out, "\n\n".join(result_text(obs) for obs in stray))
        elif turn.role == "system" and all(t.role == "system" for t in out):
            if out:
                out[0].text = f"{out[0].text}\n\n{turn.text or ''}"
            else:
                out.append(Turn("system", turn.text or ""))
        else:
            _add_user(out, turn.text or "")
    return out


def _add_user(out: list[Turn], text: str) -> None:
    if out and out[-1].role == "user":
        out[-1].text = f"{out[-1].text}\n\n{text}"
    else:
        out.append(Turn("user", text))


def result_text(obs: Step) -> str:
    """A tool result as the model reads it. Chat formats have no error flag: the error
    is said in the content, the way agents write it ("Error: ..."), so the model still
    sees that the call failed."""
    content = obs.content or ""
    if obs.error is None or error_from_text(content) or obs.error == content:
        return content
    return f"Error: {obs.error}" + (f"\n{content}" if content else "")


def _opens_turn(turn: Turn, step: Step) -> bool:
    if step.type is StepType.THOUGHT:
        return True
    if step.type is StepType.ACTION:
        said = bool(step.content) and (turn.text is not None or bool(turn.actions))
        return bool(turn.observations) or said
    if step.type is StepType.OBSERVATION:
        return False
    return turn.text is not None or bool(turn.actions) or bool(turn.observations)


def _add(turn: Turn, step: Step) -> None:
    if step.type is StepType.THOUGHT:
        turn.thought = step.content or ""
    elif step.type is StepType.ACTION:
        if step.content:
            turn.text = step.content
        turn.actions.append(step)
    elif step.type is StepType.OBSERVATION:
        turn.observations.append(step)
    else:
        turn.text = step.content or ""


def _link_ids(out: list[Turn]) -> None:
    taken = {a.call_id for turn in out for a in turn.actions if a.call_id is not None}
    counter = 0
    for turn in out:
        for action_ in turn.actions:
            call_id = action_.call_id
            if call_id is None:
                counter += 1
                while f"call_{counter}" in taken:  # never reuse an id the agent chose
                    counter += 1
                call_id = f"call_{counter}"
            turn.call_ids.append(call_id)
        unclaimed = [id_ for a, id_ in zip(turn.actions, turn.call_ids) if a.call_id is None]
        for obs in turn.observations:
            if obs.call_id is None and unclaimed:
                turn.result_ids.append(unclaimed.pop(0))
            else:
                turn.result_ids.append(obs.call_id)
