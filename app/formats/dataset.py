"""Training datasets from canonical traces, for `atropos export --format parquet|dpo`:
the rows Hugging Face `datasets` loads as they are, TRL's preference pairs, and what
selects them (the task a run belongs to, the train/eval split, duplicates, overlap
with an evaluation set).

Parquet rows hold the OpenAI record (`openai.export`) with every tool call list and
tool schema list as a JSON string: Arrow gives a list of structs one schema for all
rows, so nested schemas that differ between rows (tool parameters, arguments) would
come back with nulls inserted; as text they come back byte for byte.
`json.loads(row["tools"])` and `json.loads(message["tool_calls"])` restore them.

Rows of the `messages` export (`openai.export_messages`) keep the tool calls as a
list of structs and store what varies between rows, each call's `arguments` and each
tool schema, as Arrow's JSON type: `datasets` (4.8 and later) loads those as objects
(its `Json` feature), byte for byte, so a row goes to `apply_chat_template` as it is.
DPO pairs are conversations of that shape too (`prompt`, `chosen`, `rejected`): TRL
renders each with the model's chat template.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from app.domain import Trace
from app.formats import _common as c
from app.formats import openai


def sft_schema() -> Any:
    """The parquet export's columns (pyarrow is imported only by what writes them)."""
    import pyarrow as pa

    return pa.schema([("messages", _conversation()), ("tools", pa.string()), *_score_columns()])


def messages_schema() -> Any:
    """The `messages` export's columns: tool calls as structs, arguments and tool
    schemas as JSON."""
    import pyarrow as pa

    return pa.schema([("messages", _template_conversation()), ("tools", _template_tools()),
                      *_score_columns()])


def _template_conversation() -> Any:
    """Messages as chat templates take them: tool calls as structs, each call's
    arguments as JSON."""
    import pyarrow as pa

    call = pa.struct([
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.json_())])),
    ])
    message = pa.struct([
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(call)),
        ("tool_call_id", pa.string()),
    ])
    return pa.list_(message)


def _template_tools() -> Any:
    """Tool schemas, each as JSON: their parameters differ from tool to tool."""
    import pyarrow as pa

    return pa.list_(pa.json_())


def storage_schema(schema: Any) -> Any:
    """`schema` with each extension type (JSON) replaced by the type it is stored as."""
    import pyarrow as pa

    def stored(kind: Any) -> Any:
        if isinstance(kind, pa.BaseExtensionType):
            return kind.storage_type
        if pa.types.is_list(kind):
            return pa.list_(kind.value_field.with_type(stored(kind.value_type)))
        if pa.types.is_struct(kind):
            return pa.struct([f.with_type(stored(f.type)) for f in kind])
        return kind

    return pa.schema([f.with_type(stored(f.type)) for f in schema])


def _score_columns() -> list[tuple[str, Any]]:
    import pyarrow as pa

    return [
        ("reward", pa.float64()),
        ("env_reward", pa.float64()),
        ("status", pa.string()),
        ("trace_id", pa.string()),
        ("env", pa.string()),
        ("model", pa.string()),
        ("source_format", pa.string()),
    ]


def dpo_schema() -> Any:
    """The `dpo` export's columns: three conversations as the `messages` export's."""
    import pyarrow as pa

    return pa.schema(
        [
            ("prompt", _template_conversation()),
            ("chosen", _template_conversation()),
            ("rejected", _template_conversation()),
            ("tools", _template_tools()),
            ("chosen_reward", pa.float64()),
            ("rejected_reward", pa.float64()),
            ("chosen_trace_id", pa.string()),
            ("rejected_trace_id", pa.string()),
        ]
    )


def _conversation() -> Any:
    """A list of messages: the OpenAI keys, tool calls as JSON text."""
    import pyarrow as pa

    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("reasoning_content", pa.string()),
            ("tool_calls", pa.string()),
            ("tool_call_id", pa.string()),
        ]
    )
    return pa.list_(message)


Messages = list[dict[str, Any]]
# Decontamination compares word 13-grams, as GPT-3's and lm-evaluation-harness' do.
NGRAM = 13
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Scores:
    """What the database says of a trace, beside its payload."""

    trace_id: str
    reward: float | None
    env_reward: float | None
    status: str
    env: str | None
    model: str | None
    source_format: str


def sft_row(record: dict[str, Any], scores: Scores) -> dict[str, Any]:
    """One parquet row: an OpenAI record (from `openai.export`) and its scores."""
    return {
        "messages": [_message(m) for m in record["messages"]],
        "tools": _json_text(record.get("tools", [])),
        **_scores(scores),
    }


def messages_row(record: dict[str, Any], scores: Scores) -> dict[str, Any]:
    """One row of the `messages` dataset (a record of `openai.export_messages`), on
    `storage_schema(messages_schema())`: the JSON columns as their text."""
    return {
        "messages": _template_messages(record["messages"]),
        "tools": _template_tool_texts(record),
        **_scores(scores),
    }


def _template_messages(messages: Messages) -> list[dict[str, Any]]:
    """Messages on `storage_schema(_template_conversation())`: arguments as JSON text."""
    return [_message(m, _stored_calls) for m in messages]


def _template_tool_texts(record: dict[str, Any]) -> list[str]:
    return [_json_text(tool) for tool in record.get("tools", [])]


def _scores(scores: Scores) -> dict[str, Any]:
    return {
        "reward": scores.reward,
        "env_reward": scores.env_reward,
        "status": scores.status,
        "trace_id": scores.trace_id,
        "env": scores.env,
        "model": scores.model,
        "source_format": scores.source_format,
    }


def _message(message: dict[str, Any],
             calls_as: Callable[[list[Any]], Any] | None = None) -> dict[str, Any]:
    calls = message.get("tool_calls")
    return {
        "role": message["role"],
        "content": message.get("content"),
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": None if calls is None else (calls_as or _json_text)(calls),
        "tool_call_id": message.get("tool_call_id"),
    }


def _stored_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**call, "function": {**call["function"],
                              "arguments": _json_text(call["function"]["arguments"])}}
        for call in calls
    ]


@dataclass(frozen=True)
class SftDataset:
    """What a supervised fine-tuning dataset's rows hold: the records of the export
    `record`, as rows of `schema`."""

    record: str
    schema: Callable[[], Any]
    row: Callable[[dict[str, Any], Scores], dict[str, Any]]


# By `atropos export --format`.
SFT = {
    "parquet": SftDataset("openai", sft_schema, sft_row),
    "messages": SftDataset("messages", messages_schema, messages_row),
}


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


# --- which task a run belongs to -----------------------------------------------------


def task_text(trace: Trace) -> str:
    """The task as the agent was given it: the task, else the first user message."""
    if trace.task:
        return trace.task
    return next((t.text or "" for t in c.turns(trace) if t.role == "user"), "")


def task_key(trace: Trace) -> str:
    """Runs of the same task share this key: the same `task_id` (benchmarks such as
    tau-bench carry one in metadata, and phrase the task differently in every run)
    under the same environment and system prompt, else the same task text."""
    task_id = trace.metadata.get("task_id")
    if task_id is None:
        parts: list[Any] = ["text", task_text(trace)]
    else:
        system = next((s.content for s in trace.steps if s.role == "system"), None)
        parts = ["id", trace.env, trace.source_format, system, task_id]
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()


def split_of(key: str, eval_fraction: float) -> str:
    """`train`, or `test` for the eval split (the name `datasets` gives a file named
    eval or test, and `train_test_split` gives its held-out part), by the task key's
    hash: deterministic, and every run of a task lands in the same split."""
    return "test" if int(key[:12], 16) / 16**12 < eval_fraction else "train"


def content_key(trace: Trace) -> str:
    """Equal for traces with identical content (whatever their ids and scores)."""
    body = [trace.task, [s.model_dump(mode="json") for s in trace.steps], trace.tools]
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Contamination:
    """The word 13-grams of an evaluation set (one text per line); a task that shares
    any of them is contaminated. Words are lowercased runs of letters and digits, so
    punctuation and spacing do not hide a copy; a line under 13 words has no 13-gram."""

    def __init__(self, lines: Iterable[str]):
        self._grams = {gram for line in lines for gram in _grams(line)}

    def __len__(self) -> int:
        return len(self._grams)

    def touches(self, text: str) -> bool:
        return any(gram in self._grams for gram in _grams(text))


def _grams(text: str) -> Iterator[int]:
    words = _WORD.findall(text.lower())
    for i in range(len(words) - NGRAM + 1):
        yield hash(tuple(words[i : i + NGRAM]))


# --- preference pairs ----------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One trace's attempt at a task, as preference pairs compare them."""

    trace_id: str
    task: str  # task_key
    reward: float
    agent: str | None = None  # the agent's name: runs of two agents are not one task's


def pairable(trace: Trace) -> bool:
    """A run with no task has no prompt a preference could be about: never paired."""
    return bool(task_text(trace).strip())


def pairing_attempt(trace_id: str, trace: Trace, reward: float) -> Attempt:
    return Attempt(trace_id, task_key(trace), reward, trace.agent.name)


def preference_pairs(runs: Iterable[Attempt], margin: float, max_per_run: int, *,
                     across_agents: bool = False) -> list[tuple[Attempt, Attempt]]:
    """(chosen, rejected) pairs of runs of the same task (and, unless `across_agents`,
    the same agent) whose rewards differ by at least `margin`, each run in at most
    `max_per_run` pairs. Per task, the best runs are paired with the worst first (the
    clearest preference); ties break by id, so the same database gives the same pairs."""
    tasks: dict[tuple[str, str | None], list[Attempt]] = {}
    for run in runs:
        tasks.setdefault((run.task, None if across_agents else run.agent), []).append(run)
    pairs: list[tuple[Attempt, Attempt]] = []
    for group in tasks.values():
        best = sorted(group, key=lambda r: (-r.reward, r.trace_id))
        used = dict.fromkeys((r.trace_id for r in group), 0)
        for high in best:
            for low in reversed(best):
                if used[high.trace_id] >= max_per_run:
                    break
                if high.reward - low.reward < margin:
                    break  # the rest of the lows are higher still
                if used[low.trace_id] < max_per_run:
                    pairs.append((high, low))
                    used[high.trace_id] += 1
                    used[low.trace_id] += 1
    return pairs


def dpo_record(chosen: Trace, rejected: Trace) -> dict[str, Any]:
    """TRL's conversational preference form: the prompt (the chosen run's system and
    user messages up to its first assistant turn), and each run's messages from its
    first assistant turn on, in the shape chat templates take (`openai.export_messages`).
    Raises Unexportable for a run that has no such record."""
    good, bad = openai.export_messages(chosen), openai.export_messages(rejected)
    prompt, chosen_turns = _split_prompt(good["messages"])
    _, rejected_turns = _split_prompt(bad["messages"])
    record: dict[str, Any] = {"prompt": prompt, "chosen": chosen_turns, "rejected": rejected_turns}
    if "tools" in good:
        record["tools"] = good["tools"]
    return record


def pair_scores(chosen: Attempt, rejected: Attempt) -> dict[str, Any]:
    """Which runs a pair holds and their rewards, beside TRL's columns."""
    return {
        "chosen_reward": chosen.reward,
        "rejected_reward": rejected.reward,
        "chosen_trace_id": chosen.trace_id,
        "rejected_trace_id": rejected.trace_id,
    }


def dpo_row(record: dict[str, Any], chosen: Attempt, rejected: Attempt) -> dict[str, Any]:
    """One parquet row of a pair, on `storage_schema(dpo_schema())`."""
    return {
        "prompt": _template_messages(record["prompt"]),
        "chosen": _template_messages(record["chosen"]),
        "rejected": _template_messages(record["rejected"]),
        "tools": _template_tool_texts(record),
        **pair_scores(chosen, rejected),
    }


def _split_prompt(messages: Messages) -> tuple[Messages, Messages]:
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first], messages[first:]
