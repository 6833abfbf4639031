"""app.import_sources over the real corpus in ../shared/fixtures/real (facts from its
SOURCES.md), plus the reader's edge cases on small files of our own."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.domain import Status, StepType, Trace
from app.import_sources import ADAPTERS, Parsed, Record, Unreadable, detect, formats, read_path
from tests.support import REAL

pytestmark = [
    pytest.mark.corpus,
    pytest.mark.skipif(not REAL.is_dir(), reason=f"real corpus not found at {REAL}"),
]


@pytest.fixture(scope="module")
def corpus() -> list[Record]:
    return list(read_path(REAL))


def _traces(corpus: list[Record], folder: str, name: str = "") -> list[Trace]:
    prefix = str(REAL / folder / name)
    return [r.trace for r in corpus if isinstance(r, Parsed) and r.location.startswith(prefix)]


def _statuses(traces: list[Trace]) -> Counter[Status]:
    return Counter(t.outcome.status for t in traces)


def _errors(trace: Trace) -> list[str]:
    return [s.error for s in trace.steps if s.type is StepType.OBSERVATION and s.error]


def _longest_repeat(trace: Trace) -> int:
    """The longest run of identical consecutive actions (tool and arguments)."""
    best = run = 0
    previous: Any = None
    for step in (s for s in trace.steps if s.type is StepType.ACTION):
        current = (step.tool, orjson.dumps(step.arguments, option=orjson.OPT_SORT_KEYS))
        run = run + 1 if current == previous else 1
        best, previous = max(best, run), current
    return best


# -- the whole corpus --------------------------------------------------------------


def test_every_record_is_parsed_or_unreadable_with_a_reason(corpus: list[Record]) -> None:
    assert all(isinstance(r, Parsed | Unreadable) for r in corpus)
    assert all(r.reason.strip() for r in corpus if isinstance(r, Unreadable))
    parsed = [r for r in corpus if isinstance(r, Parsed)]
    # 908 trajectories and 22 AgentBench records without one; the Hermes line counts
    # as unreadable until app.formats is there to read it.
    assert len(corpus) == 930
    assert len(parsed) in (907, 908)
    assert all(r.trace.steps and r.trace.trace_id for r in parsed)


def test_every_file_yields_a_record(corpus: list[Record]) -> None:
    data = {p for p in REAL.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    assert len(data) == 31
    assert {Path(re.sub(r"(:\d+)?(#\d+)?$", "", r.location)) for r in corpus} == data


def test_the_whole_corpus_reads_quickly() -> None:
    started = time.perf_counter()
    count = sum(1 for _ in read_path(REAL))
    assert count == 930
    assert time.perf_counter() - started < 10


def test_trace_ids_are_stable_and_unique(corpus: list[Record]) -> None:
    ids = [r.trace.trace_id for r in corpus if isinstance(r, Parsed)]
    assert len(set(ids)) == len(ids)
    again = [r.trace.trace_id for r in read_path(REAL / "atropos") if isinstance(r, Parsed)]
    assert again == [i for i in ids if i and i.startswith("atropos_group-")]


def test_locations_name_the_line_or_index(corpus: list[Record]) -> None:
    locations = {r.location for r in corpus}
    assert str(REAL / "tau-bench/gpt-4o-airline.json#199") in locations
    assert str(REAL / "fireact/hotpotqa.jsonl:500") in locations
    assert str(REAL / "reflexion/base_react_thought_log.txt#101") in locations
    assert str(REAL / "atropos/rubiks_process_results_32_line3.jsonl:1#3") in locations


# -- per source --------------------------------------------------------------------


def test_tau_bench(corpus: list[Record]) -> None:
    traces = _traces(corpus, "tau-bench")
    assert len(traces) == 200
    # `reward` is the environment's reward; it makes no status.
    assert _statuses(traces) == {Status.UNKNOWN: 200}
    assert Counter(t.outcome.reward for t in traces) == {1.0: 84, 0.0: 116}
    assert sum(len(_errors(t)) for t in traces) == 73
    assert all(e.startswith("Error:") for t in traces for e in _errors(t))
    # `think` calls are thoughts, not tool calls.
    assert not any(s.tool == "think" for t in traces for s in t.steps)
    ended = Counter(t.metadata["ended_by"] for t in traces)
    assert ended["user"] == 149 and ended["transfer_to_human_agents"] == 48
    for trace in traces:  # every result still answers its own call
        calls = [s.call_id for s in trace.steps if s.type is StepType.ACTION]
        assert calls == [s.call_id for s in trace.steps if s.type is StepType.OBSERVATION]


def test_toolbench(corpus: list[Record]) -> None:
    assert len(_traces(corpus, "toolbench")) == 7
    wins = {
        r.location.rsplit("/", 1)[1][:12]
        for r in corpus
        if isinstance(r, Parsed)
        and r.trace.source_format == "toolbench"
        and r.trace.outcome.status is Status.SUCCESS
    }
    assert wins == {"G1_answer_10", "G1_answer_57", "G3_answer_15"}
    [g1_57] = _traces(corpus, "toolbench", "G1_answer_57")
    assert _errors(g1_57) == ["Message error..."]
    # The model's last act is its Finish call, kept as it wrote it: no result (the
    # search stops there) and no assistant text it never wrote.
    finish = g1_57.steps[-1]
    assert finish.type is StepType.ACTION and finish.tool == "Finish"
    assert finish.arguments["return_type"] == "give_answer"
    assert finish.arguments["final_answer"].startswith("I found a phone case")
    assert not any(s.type is StepType.FINAL for s in g1_57.steps)
    assert g1_57.tools is not None and "Finish" in g1_57.tools
    [g1_69] = _traces(corpus, "toolbench", "G1_answer_69")
    assert g1_69.outcome.status is Status.FAILURE and g1_69.metadata["from"] == "tree"
    assert any(s.type is StepType.ACTION for s in g1_69.steps)
    [g2_10] = _traces(corpus, "toolbench", "G2_answer_10")
    assert g2_10.metadata["finish_type"] == "give_up"
    assert not any(s.type is StepType.FINAL for s in g2_10.steps)
    assert g2_10.steps[-1].arguments == {"return_type": "give_up_and_restart"}


def test_swe_agent(corpus: list[Record]) -> None:
    traces = _traces(corpus, "swe-agent")
    steps = sorted(sum(s.type is StepType.ACTION for s in t.steps) for t in traces)
    assert steps == [5, 5, 12, 13, 14, 21]  # the table in SOURCES.md
    # `submitted` is the agent's claim, not a resolved issue.
    assert all(t.outcome.status is Status.UNKNOWN for t in traces)
    assert all(t.outcome.reason == "submitted" for t in traces)
    [pydicom] = _traces(corpus, "swe-agent", "pydicom")
    assert len(_errors(pydicom)) == 3  # three rejected edits
    assert pydicom.metadata["submission"].lstrip().startswith("diff --git")
    [function_calling] = _traces(corpus, "swe-agent", "marshmallow")
    assert {s.tool for s in function_calling.steps if s.tool} >= {"bash", "open", "edit"}
    [ctf] = _traces(corpus, "swe-agent", "ctf_crypto_eps")
    assert _longest_repeat(ctf) >= 3


def test_mini_swe_agent(corpus: list[Record]) -> None:
    [trace] = _traces(corpus, "mini-swe-agent")
    failed = [s for s in trace.steps if s.type is StepType.OBSERVATION and s.exit_code == 1]
    assert len(failed) == 2 and all(s.error for s in failed)
    assert len(_errors(trace)) == 2
    assert trace.outcome.status is Status.UNKNOWN


def test_openhands(corpus: list[Record]) -> None:
    [ponyc_4588] = _traces(corpus, "openhands", "multi_swe_bench_ponylang__ponyc-4588")
    assert ponyc_4588.outcome.status is Status.TIMEOUT
    assert "maximum iteration" in (ponyc_4588.outcome.reason or "")
    for name in ("ponyc-4593", "ponyc-4588"):
        [trace] = _traces(corpus, "openhands", f"multi_swe_bench_ponylang__{name}")
        assert any(e.startswith("Parameter 'command'") for e in _errors(trace))
    # Non-zero exit codes are kept, and are not errors by themselves.
    runs = [s for s in ponyc_4588.steps if s.type is StepType.OBSERVATION and s.exit_code]
    assert {s.exit_code for s in runs} >= {1, 2, 100}
    assert not any(s.error for s in runs)
    [ponyc_4595] = _traces(corpus, "openhands", "multi_swe_bench_ponylang__ponyc-4595")
    assert ponyc_4595.outcome.status is Status.UNKNOWN
    assert ponyc_4595.steps[-1].type is StepType.FINAL
    resolver = _traces(corpus, "openhands", "resolver_mock_output")
    assert _statuses(resolver) == {Status.SUCCESS: 2}
    runtime = _traces(corpus, "openhands", "runtime_trajs")
    assert len(runtime) == 2 and all(t.task for t in runtime)


def test_fireact(corpus: list[Record]) -> None:
    traces = _traces(corpus, "fireact")
    assert len(traces) == 500
    # "Episode finished, reward = True": the environment's reward, not a status.
    assert _statuses(traces) == {Status.UNKNOWN: 500}
    assert {t.outcome.reward for t in traces} == {1.0}
    assert all(t.steps[-1].type is StepType.FINAL for t in traces)


def test_reflexion(corpus: list[Record]) -> None:
    traces = _traces(corpus, "reflexion")
    assert len(traces) == 102
    assert _statuses(traces) == {Status.SUCCESS: 33, Status.FAILURE: 57, Status.TIMEOUT: 12}
    halted = [t for t in traces if t.outcome.status is Status.TIMEOUT]
    assert all(e.startswith(("Could not find", "No Results")) for t in traces for e in _errors(t))
    assert any(_longest_repeat(t) >= 3 for t in halted)  # the loops SOURCES.md describes


def test_knowagent(corpus: list[Record]) -> None:
    traces = _traces(corpus, "knowagent")
    assert len(traces) == 60
    assert _statuses(traces) == {Status.SUCCESS: 17, Status.FAILURE: 43}
    [line_4] = [
        r.trace
        for r in corpus
        if r.location.endswith(".lines-1-60.jsonl:4") and isinstance(r, Parsed)
    ]
    # One action, then the same action 46 more times, each answered "Nothing happens.".
    assert _longest_repeat(line_4) == 47
    assert _errors(line_4) == ["Nothing happens."] * 47


def test_smolagents(corpus: list[Record]) -> None:
    code = {
        r.location.rsplit(":", 1)[1]: r.trace
        for r in corpus
        if isinstance(r, Parsed) and "smolagents/gpt-4o__code__" in r.location
    }
    tool_calling = _traces(corpus, "smolagents", "gpt-4o__tool-calling")
    # The subset keeps code lines 1, 2, 21, 26, 31 as lines 1..5 of the file.
    line = dict(zip(("1", "2", "21", "26", "31"), (code[str(i)] for i in range(1, 6)), strict=True))
    assert {n for n, t in line.items() if t.outcome.status is Status.TIMEOUT} == {"21", "26"}
    assert {n for n, t in line.items() if t.outcome.status is Status.SUCCESS} == {"2"}
    assert len(_errors(line["1"])) == 5
    assert [t.outcome.status for t in tool_calling] == [
        Status.SUCCESS,
        Status.FAILURE,
        Status.SUCCESS,
    ]
    assert tool_calling[0].tools == [
        "web_search",
        "visit_webpage",
        "python_interpreter",
        "final_answer",
    ]


def test_agentbench(corpus: list[Record]) -> None:
    runs = _traces(corpus, "agentbench-medagentbench")
    assert Counter(t.metadata["status"] for t in runs) == {
        "completed": 4,
        "agent invalid action": 4,
    }
    assert _statuses(runs) == {Status.UNKNOWN: 4, Status.FAILURE: 4}
    assert any(e == "Invalid POST request" for t in runs for e in _errors(t))
    failed = [r for r in corpus if isinstance(r, Unreadable) and "gemini-2.0_error" in r.location]
    assert len(failed) == 22
    assert all("no history" in r.reason and "AGENT_FAILED" in r.reason for r in failed)


def test_atropos_groups(corpus: list[Record]) -> None:
    rollouts = _traces(corpus, "atropos")
    assert len(rollouts) == 8
    assert all(t.tools == ["apply_move"] for t in rollouts)
    line_3 = _traces(corpus, "atropos", "rubiks_process_results_32_line3")
    # The scores are the environment's rewards; none makes a status.
    assert _statuses(rollouts) == {Status.UNKNOWN: 8}
    rewards = [t.outcome.reward for t in line_3]
    assert all(r is not None and r < 0 for r in rewards)
    assert all(t.metadata["parsed_action"] is None for t in line_3)
    # The last agent turn is a bare "<think>": an empty assistant turn.
    assert all(t.steps[-1].type is StepType.MESSAGE and t.steps[-1].content == "" for t in line_3)
    [best] = [t for t in rollouts if (t.outcome.reward or 0) > 0]
    assert best.metadata["parsed_action"] == "U"


def test_hermes_through_app_formats(corpus: list[Record]) -> None:
    pytest.importorskip("app.formats")
    [record] = [r for r in corpus if "hermes-agent" in r.location]
    assert isinstance(record, Parsed), record
    assert record.trace.steps


# -- the reader --------------------------------------------------------------------


def _write(path: Path, *lines: Any) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else orjson.dumps(x) for x in lines))
    return path


_TAU = {"task_id": 1, "trial": 0, "reward": 1.0, "info": {}, "traj": [
    {"role": "user", "content": "book it"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "book", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "book", "content": "Error: no seats"},
]}  # fmt: skip


def test_a_bad_line_is_unreadable_and_reading_goes_on(tmp_path: Path) -> None:
    file = _write(tmp_path / "runs.jsonl", _TAU, b"{not json", {"what": "ever"}, _TAU)
    records = list(read_path(file))
    match records:
        case [Parsed(trace), Unreadable(bad_json, why_json), Unreadable(_, why_unknown), Parsed()]:
            pass
        case _:
            pytest.fail(f"unexpected records: {records}")
    assert bad_json.endswith("runs.jsonl:2") and "invalid JSON" in why_json
    assert "no adapter recognises" in why_unknown and "what" in why_unknown
    assert trace.outcome.status is Status.UNKNOWN and trace.outcome.reward == 1.0
    assert _errors(trace) == ["Error: no seats"]
    assert trace.steps[0].arguments == {"x": 1}


def test_a_json_list_is_a_list_of_records_unless_one_adapter_takes_it(tmp_path: Path) -> None:
    records = list(read_path(_write(tmp_path / "all.json", [_TAU, _TAU])))
    assert [r.location.rsplit("/", 1)[1] for r in records] == ["all.json#0", "all.json#1"]
    events = [
        {"id": 1, "source": "user", "action": "message", "args": {"content": "hi"}},
        {"id": 2, "source": "agent", "action": "run", "args": {"command": "ls"}},
        {"id": 3, "source": "agent", "observation": "run", "cause": 2, "content": "a",
         "extras": {"metadata": {"exit_code": 2}}},
    ]  # fmt: skip
    [one] = list(read_path(_write(tmp_path / "events.json", events)))
    assert isinstance(one, Parsed) and one.trace.source_format == "openhands"
    assert one.trace.task == "hi"
    assert one.trace.steps[-1].exit_code == 2 and one.trace.steps[-1].error is None


def test_a_named_format_skips_detection(tmp_path: Path) -> None:
    file = _write(tmp_path / "x.jsonl", _TAU)
    [forced] = list(read_path(file, fmt="knowagent"))
    assert isinstance(forced, Unreadable) and forced.reason.startswith("knowagent:")
    [named] = list(read_path(file, fmt="tau_bench"))
    assert isinstance(named, Parsed)


def test_an_unknown_format_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="unknown format 'nope'"):
        read_path(REAL, fmt="nope")
    assert {"auto", "tau_bench", "openhands", "sharegpt", "openai"} <= set(formats())


def test_a_directory_skips_what_is_not_data(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# notes")
    _write(tmp_path / "b.jsonl", _TAU)
    records = list(read_path(tmp_path))
    assert len(records) == 1 and isinstance(records[0], Parsed)


def test_json_lines_under_a_json_name(tmp_path: Path) -> None:
    records = list(read_path(_write(tmp_path / "lines.json", _TAU, _TAU)))
    assert [r.location.rsplit("/", 1)[1] for r in records] == ["lines.json:1", "lines.json:2"]


def test_an_error_inside_a_multi_trace_record_keeps_the_traces_before_it(tmp_path: Path) -> None:
    group = {"tokens": [[1], [2]], "scores": [0.5, -1.0], "messages": [
        [{"role": "environment", "content": "state"}, {"role": "agent", "content": "<think>x</think>"}],
        "not a chat",
    ]}  # fmt: skip
    records = list(read_path(_write(tmp_path / "g.jsonl", group)))
    assert [type(r) for r in records] == [Parsed, Unreadable]
    assert records[0].location.endswith("g.jsonl:1#0")
    assert records[1].location.endswith("g.jsonl:1#1")


def test_generic_formats_go_to_app_formats(tmp_path: Path) -> None:
    hermes = {"conversations": [{"from": "human", "value": "hi"}], "completed": True}
    [auto] = list(read_path(_write(tmp_path / "h.jsonl", hermes)))
    assert isinstance(auto, Parsed) and auto.trace.source_format == "sharegpt"
    assert auto.trace.task == "hi"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    [named] = list(read_path(_write(tmp_path / "o.jsonl", chat), fmt="openai"))
    assert isinstance(named, Parsed) and named.trace.source_format == "openai"
    # A named format reads every record as that format, with its own precise error.
    [refused] = list(read_path(_write(tmp_path / "n.jsonl", hermes), fmt="openai"))
    assert isinstance(refused, Unreadable) and refused.reason.startswith("openai: ")
    assert "messages" in refused.reason


def test_every_registered_format_can_be_named() -> None:
    from app import formats as registry

    assert set(registry.FORMATS) <= set(formats())


def test_detection_is_by_content() -> None:
    assert detect({"traj": [], "reward": 0, "task_id": 3}) is not None
    assert detect({"unrelated": True}) is None
    assert len({adapter.NAME for adapter in ADAPTERS}) == len(ADAPTERS)


def _swe(exit_status: str) -> dict[str, Any]:
    return {"trajectory": [], "history": [], "info": {"exit_status": exit_status}}


def _agentbench(status: str, error: str | None = None) -> dict[str, Any]:
    return {"index": 1, "error": error, "output": {"status": status, "history": []}}


def _mini(exit_status: str) -> dict[str, Any]:
    messages = [
        {"role": "user", "content": "fix"},
        {"role": "user", "content": "<returncode>0</returncode>"},
    ]
    return {"info": {"exit_status": exit_status}, "messages": messages}


# Limits and errors the corpus does not show, mapped from each source's vocabulary.
@pytest.mark.parametrize(
    ("record", "status"),
    [
        (_swe("exit_cost"), Status.TIMEOUT),
        (_swe("submitted (exit_context)"), Status.TIMEOUT),
        (_swe("exit_error"), Status.ERROR),
        (_swe("exit_format"), Status.FAILURE),
        (_agentbench("task limit reached"), Status.TIMEOUT),
        (_agentbench("agent context limit"), Status.TIMEOUT),
        (_agentbench("task error"), Status.ERROR),
        (_agentbench("running", "AGENT_FAILED"), Status.ERROR),
        (_mini("LimitsExceeded"), Status.TIMEOUT),
        (_mini("Submitted"), Status.UNKNOWN),
        (_mini("RuntimeError"), Status.ERROR),
        ({"history": [{"action": "run"}], "error": "Agent reached maximum budget"}, Status.TIMEOUT),
        ({"history": [{"action": "run"}], "error": "RuntimeError: boom"}, Status.ERROR),
        ({"name": "x", "result": 0, "traj": "Your task is to: y\n> look"}, Status.FAILURE),
    ],
)
def test_status_vocabularies(record: dict[str, Any], status: Status) -> None:
    adapter = detect(record)
    assert adapter is not None
    [trace] = adapter.parse(record)
    assert trace.outcome.status is status
    assert trace.outcome.reason
