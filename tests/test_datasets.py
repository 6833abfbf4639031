"""Exports that trainers load as they are, on the real corpus (../shared/fixtures/real
stored with `atropos import`): OpenAI and Hermes/ShareGPT records that are valid
chats, a parquet directory that `datasets.load_dataset` loads as it is, and TRL
preference pairs from the tau-bench runs (app/formats/dataset.py, app/cli/export.py)."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import stat
from collections import Counter
from itertools import groupby
from pathlib import Path
from typing import Any

import datasets
import pytest

from app import formats
from app.formats import dataset
from tests.support import REAL, chat_templates
from tests.support.builders import native_trace
from tests.support.hubs import write_config
from tests.support.processes import HubProcess, run_cli
from tests.test_export import check_hermes, check_messages, check_openai, check_sharegpt

SFT_COLUMNS = ["messages", "tools", "reward", "env_reward", "status", "trace_id", "env",
               "model", "source_format"]


@pytest.fixture(scope="module")
def corpus_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database holding the whole real corpus, imported as a user would."""
    directory = tmp_path_factory.mktemp("corpus")
    config = write_config(directory, {"storage_backend": "sqlite",
                                      "db_path": str(directory / "traces.db")})
    done = run_cli("import", "--config", str(config), str(REAL))
    assert done.returncode == 0, done.stderr
    return config


def export(config: Path, out: Path, *args: str) -> str:
    done = run_cli("export", "--config", str(config), "-o", str(out), *args)
    assert done.returncode == 0, done.stderr
    return done.stderr


def lines(path: Path) -> list[dict[str, Any]]:
    # bytes.splitlines: JSON text may hold U+2028 and the like, which str.splitlines splits on.
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def load(directory: Path, cache: Path) -> datasets.DatasetDict:
    return datasets.load_dataset("parquet", data_dir=str(directory), cache_dir=str(cache))


@pytest.mark.process
@pytest.mark.corpus
def test_chat_exports_of_the_real_corpus_are_valid_chats(corpus_config: Path, tmp_path: Path) -> None:
    said = export(corpus_config, tmp_path / "openai.jsonl", "--format", "openai", "--all")
    records = lines(tmp_path / "openai.jsonl")
    assert len(records) > 850 and "left out: none" in said
    for record in records:
        check_openai(record)  # no "" tool_call_id; ends on the assistant; one system message
    with_calls = [r for r in records if any("tool_calls" in m for m in r["messages"])]
    assert all(r.get("tools") for r in with_calls)  # implied by the calls when not declared

    export(corpus_config, tmp_path / "hermes.jsonl", "--format", "hermes", "--all")
    export(corpus_config, tmp_path / "sharegpt.jsonl", "--format", "sharegpt", "--all")
    hermes, sharegpt = lines(tmp_path / "hermes.jsonl"), lines(tmp_path / "sharegpt.jsonl")
    assert len(hermes) == len(sharegpt) == len(records)
    undeclared_calls = 0
    for record in hermes:
        check_hermes(record)
        turns = record["conversations"]
        assert [t["from"] for t in turns].count("system") == 1
        declared = re.search(r"<tools>\n(.*?)\n</tools>", turns[0]["value"], re.S)
        assert declared is not None
        tools = json.loads(declared[1])
        called = {json.loads(c).get("name") for t in turns[1:] if t["from"] == "gpt"
                  for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", t["value"], re.S)}
        assert tools or not called  # never an empty list beside calls
        # Calls to tools the trace did not declare (ToolBench's hallucinated ones) are
        # not listed; a trace that declared none gets the tools its calls imply.
        undeclared_calls += not called <= {tool["name"] for tool in tools}
        formats.parse(record, "hermes")  # and the hub reads it back
    assert undeclared_calls <= 7  # the ToolBench runs, which declare their tools
    for record in sharegpt:
        check_sharegpt(record)
        assert [t["from"] for t in record["conversations"]].count("system") <= 1


@pytest.mark.process
def test_the_agents_system_prompt_survives_the_one_hermes_system_turn(
    corpus_config: Path, tmp_path: Path
) -> None:
    export(corpus_config, tmp_path / "hermes.jsonl", "--format", "hermes", "--all")
    tau = [r for r in lines(tmp_path / "hermes.jsonl")
           if "\n\n# Airline Agent Policy" in r["conversations"][0]["value"]]
    assert len(tau) == 200
    again = formats.parse(tau[0], "hermes")
    assert again.steps[0].role == "system"
    assert again.steps[0].content and again.steps[0].content.startswith("# Airline Agent Policy")


@pytest.mark.process
def test_parquet_loads_as_it_is_and_arguments_round_trip(
    corpus_config: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dataset"
    said = export(corpus_config, out, "--format", "parquet", "--all", "--eval-fraction", "0.2")
    loaded = load(out, tmp_path / "cache")
    assert set(loaded) == {"train", "test"}
    assert loaded["train"].column_names == SFT_COLUMNS
    rows = [*loaded["train"], *loaded["test"]]
    export(corpus_config, tmp_path / "openai.jsonl", "--format", "openai", "--all")
    by_id = {r["trace_id"]: r for r in rows}
    records = lines(tmp_path / "openai.jsonl")
    assert len(by_id) == len(records) == len(rows)
    assert f"({len(loaded['train'])} train, {len(loaded['test'])} test)" in said
    assert 0.1 < len(loaded["test"]) / len(rows) < 0.3

    # The parquet messages are the OpenAI records; tool calls and schemas come back
    # byte for byte from their JSON text (Arrow never saw them as nested structs).
    jsonl_calls = sorted(
        c["function"]["arguments"] for r in records for m in r["messages"]
        for c in m.get("tool_calls", []))
    parquet_calls = sorted(
        c["function"]["arguments"] for r in rows for m in r["messages"] if m["tool_calls"]
        for c in json.loads(m["tool_calls"]))
    assert parquet_calls == jsonl_calls and len(parquet_calls) > 1000
    assert sorted(r["tools"] for r in rows) == sorted(
        json.dumps(r.get("tools", []), separators=(",", ":"), ensure_ascii=False)
        for r in records)
    # The environment's own reward as stored (tau-bench's verdicts), null where none.
    with sqlite3.connect(corpus_config.parent / "traces.db") as db:
        stored = dict(db.execute("SELECT trace_id, env_reward FROM traces"))
    assert {t: r["env_reward"] for t, r in by_id.items()} == {t: stored[t] for t in by_id}
    assert {v is None for v in stored.values()} == {True, False}

    # Runs of one tau-bench task (4 trials, each phrased differently) share a split.
    task_of = {}
    for location, trace in _tau_traces():
        task_of[trace.trace_id] = trace.metadata["task_id"], location
    splits: dict[Any, set[str]] = {}
    for split in ("train", "test"):
        for row in loaded[split]:
            if row["trace_id"] in task_of:
                splits.setdefault(task_of[row["trace_id"]][0], set()).add(split)
    assert len(splits) == 50 and all(len(s) == 1 for s in splits.values())

    card = (out / "README.md").read_text()
    assert "| train |" in card and "| test |" in card and "fingerprint" in card
    assert re.search(r"Exported \d{4}-\d\d-\d\dT", card)
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "test-00000-of-00001.parquet", "train-00000-of-00001.parquet"]

    # Again without an eval split: the old test file goes, the directory loads as one split.
    export(corpus_config, out, "--format", "parquet", "--all")
    assert set(load(out, tmp_path / "cache2")) == {"train"}


@pytest.mark.process
def test_messages_export_renders_with_real_chat_templates(
    corpus_config: Path, tmp_path: Path
) -> None:
    """Every record of the real corpus, loaded from parquet as it is, renders with the
    Qwen2.5, Qwen3.6, Llama 3.2 and gpt-oss templates; each call's arguments are written once, as
    the object the model wrote (not its JSON text encoded again)."""
    export(corpus_config, tmp_path / "messages.jsonl", "--format", "messages", "--all")
    records = lines(tmp_path / "messages.jsonl")
    said = export(corpus_config, tmp_path / "dataset", "--format", "messages", "--all")
    assert "left out: none" in said
    rows = list(load(tmp_path / "dataset", tmp_path / "cache")["train"])
    assert len(rows) == len(records) > 850
    for row, record in zip(rows, records):  # both oldest first
        check_messages(record)
        assert [_set_keys(m) for m in row["messages"]] == record["messages"]
        assert row["tools"] == record.get("tools", [])

    tokenizer = chat_templates.renderer()
    rendered_calls = 0
    for name, written in (("qwen2_5", _qwen2_5_call), ("qwen3_6", _qwen3_6_call),
                          ("llama3_2", _llama3_2_call), ("gptoss", None)):
        template = chat_templates.template(name)
        for row in rows:
            text = tokenizer.apply_chat_template(row["messages"], tools=row["tools"],
                                                 tokenize=False, chat_template=template)
            if written is None:
                continue
            calls = Counter(written(c["function"]) for m in row["messages"]
                            for c in m["tool_calls"] or [])
            for call, times in calls.items():
                assert text.count(call) == times, (name, row["trace_id"], call)
            rendered_calls += sum(calls.values())
    assert rendered_calls > 3000


@pytest.mark.process
@pytest.mark.training
def test_one_sft_step_on_the_messages_export(corpus_config: Path, tmp_path: Path) -> None:
    """TRL's SFTTrainer takes the `messages` export as `datasets` loads it, from JSONL
    and from parquet (the same sequences and labels), and runs one step on a tiny
    random Qwen2 model with Qwen2.5's template and assistant-only loss: the loss is
    finite, and it covers exactly what the model wrote (each assistant turn, its calls
    and its end-of-turn token), nothing the model was given. Runs of several agents,
    each its shortest with calls."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    from tests.support.chat_tokenizer import chat_tokenizer

    export(corpus_config, tmp_path / "messages.jsonl", "--format", "messages", "--all")
    export(corpus_config, tmp_path / "dataset", "--format", "messages", "--all")
    from_parquet = load(tmp_path / "dataset", tmp_path / "cache")["train"]
    from_jsonl = datasets.load_dataset("json", data_files=str(tmp_path / "messages.jsonl"),
                                       cache_dir=str(tmp_path / "cache"))["train"]
    picked = _shortest_runs_with_calls(lines(tmp_path / "messages.jsonl"), from_parquet)
    assert len(picked) >= 4

    # Qwen2.5's template as its tokenizer has it: TRL swaps in its training variant
    # (the same template with generation markers) for assistant-only loss.
    tokenizer = AutoTokenizer.from_pretrained(
        chat_tokenizer(tmp_path / "tokenizer", chat_templates.template("qwen2_5")))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8192, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    models: Any = AutoModelForCausalLM  # from_config is untyped
    trainers: dict[str, Any] = {}
    for name, loaded in (("jsonl", from_jsonl), ("parquet", from_parquet)):
        torch.manual_seed(0)
        rows = loaded.select(picked)
        args = SFTConfig(output_dir=str(tmp_path / name), max_steps=1, report_to="none",
                         use_cpu=True, assistant_only_loss=True, max_length=None,
                         per_device_train_batch_size=1, gradient_accumulation_steps=len(rows),
                         save_strategy="no", activation_checkpointing=False, disable_tqdm=True)
        trainers[name] = SFTTrainer(model=models.from_config(config), args=args,
                                    train_dataset=rows, processing_class=tokenizer)
        for i, row, tokens in zip(picked, rows, trainers[name].train_dataset):
            trained = [tokenizer.decode([t for t, _ in run]) for taken, run in
                       groupby(zip(tokens["input_ids"], tokens["labels"]),
                               key=lambda pair: pair[1] != -100) if taken]
            assert trained == _assistant_output(row["messages"]), (name, i)
    # Whichever file, the same sequences and labels: one step on either is the same step.
    sequences = [trainer.train_dataset.select_columns(["input_ids", "labels"]).to_list()
                 for trainer in trainers.values()]
    assert sequences[0] == sequences[1]
    done = trainers["parquet"].train()
    assert done.global_step == 1 and math.isfinite(done.training_loss)


def _shortest_runs_with_calls(records: list[dict[str, Any]],
                              rows: datasets.Dataset) -> list[int]:
    """Per agent source, the row of its shortest record (under 4,000 characters) that
    calls a tool and has more than one assistant turn."""
    shortest: dict[str, tuple[int, int]] = {}
    for i, (record, source) in enumerate(zip(records, rows["source_format"])):
        size = len(json.dumps(record))
        turns = [m for m in record["messages"] if m["role"] == "assistant"]
        if size < 4000 and len(turns) > 1 and any("tool_calls" in m for m in turns):
            shortest[source] = min(shortest.get(source, (size, i)), (size, i))
    return sorted(i for _, i in shortest.values())


def _assistant_output(messages: list[dict[str, Any]]) -> list[str]:
    """What Qwen2.5's template writes inside each assistant turn: the model's output."""
    said = []
    for m in messages:
        if m["role"] == "assistant":
            content = f"\n{m['content']}" if m.get("content") or not m.get("tool_calls") else ""
            calls = "".join(f"\n{_qwen2_5_call(c['function'])}" for c in m.get("tool_calls") or [])
            said.append(f"{content}{calls}<|im_end|>\n")
    return said


def _set_keys(message: dict[str, Any]) -> dict[str, Any]:
    """A parquet message as the JSONL record has it: Arrow gives every row every key."""
    return {k: v for k, v in message.items() if v is not None}


def _qwen2_5_call(function: dict[str, Any]) -> str:
    arguments = json.dumps(function["arguments"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def _llama3_2_call(function: dict[str, Any]) -> str:
    arguments = json.dumps(function["arguments"], ensure_ascii=False)
    return f'{{"name": "{function["name"]}", "parameters": {arguments}}}'


def _qwen3_6_call(function: dict[str, Any]) -> str:
    parameters = "".join(
        f"<parameter={key}>\n"
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
        "\n</parameter>\n"
        for key, value in function["arguments"].items())
    return f"<function={function['name']}>\n{parameters}</function>"


def _tau_traces() -> list[tuple[str, Any]]:
    from app.import_sources import Parsed, read_path

    return [(r.location, r.trace) for r in read_path(REAL / "tau-bench")
            if isinstance(r, Parsed)]


@pytest.mark.process
def test_default_selection_is_what_training_gets_and_says_what_it_left_out(
    corpus_config: Path, tmp_path: Path
) -> None:
    said = export(corpus_config, tmp_path / "default", "--format", "parquet")
    rows = load(tmp_path / "default", tmp_path / "cache")["train"]
    assert all(r["reward"] >= 5 for r in rows)  # the distributor's threshold (default 5)
    left = re.search(r"left out (\d+): (.*)", said)
    assert left is not None and "reward under 5" in left[2]
    everything = export(corpus_config, tmp_path / "all.jsonl", "--format", "openai", "--all")
    total = int(re.search(r"exported (\d+) traces", everything)[1])  # type: ignore[index]
    assert len(rows) + int(left[1]) == total


@pytest.mark.process
@pytest.mark.corpus
def test_decontaminate_drops_tasks_that_share_a_13_gram(corpus_config: Path, tmp_path: Path) -> None:
    tasks = {trace.task for _, trace in _tau_traces()}
    task = next(t for t in sorted(tasks) if len(re.findall(r"\w+", t)) >= 16)
    evaluation = tmp_path / "eval.txt"
    # Another case and punctuation, and words around it: still the same 13 words.
    evaluation.write_text(f"short line\nQ: {task.upper().replace(',', ' ;')} -- end\n")
    said = export(corpus_config, tmp_path / "clean.jsonl", "--format", "openai", "--all",
                  "--decontaminate", str(evaluation))
    left = re.search(r"(\d+) task overlaps the --decontaminate set", said)
    assert left is not None and int(left[1]) >= 1
    kept = lines(tmp_path / "clean.jsonl")
    assert not any(m.get("content") == task for r in kept for m in r["messages"])


@pytest.mark.process
@pytest.mark.corpus
def test_dpo_pairs_from_the_tau_bench_runs(corpus_config: Path, tmp_path: Path) -> None:
    said = export(corpus_config, tmp_path / "pairs.jsonl", "--format", "dpo")
    pairs = lines(tmp_path / "pairs.jsonl")
    tau = {trace.trace_id: trace for _, trace in _tau_traces()}
    tau_pairs = [p for p in pairs if p["chosen_trace_id"] in tau]
    assert len(tau_pairs) >= 20  # 26 of the 50 tasks have runs that differ
    used = Counter(i for p in pairs for i in (p["chosen_trace_id"], p["rejected_trace_id"]))
    assert max(used.values()) == 1  # --max-pairs-per-run 1
    for pair in tau_pairs:
        chosen, rejected = tau[pair["chosen_trace_id"]], tau[pair["rejected_trace_id"]]
        assert chosen.metadata["task_id"] == rejected.metadata["task_id"]
        assert pair["chosen_reward"] - pair["rejected_reward"] >= 1.0
        # TRL's conversational form: a prompt ending on the user, answers from the assistant.
        assert [m["role"] for m in pair["prompt"]] == ["system", "user"]
        assert pair["chosen"][0]["role"] == pair["rejected"][0]["role"] == "assistant"
        assert pair["chosen"][-1]["role"] == pair["rejected"][-1]["role"] == "assistant"
        # The shape chat templates take: arguments as objects, tools with descriptions.
        check_messages({"messages": pair["prompt"] + pair["chosen"], "tools": pair.get("tools", [])})
        check_messages({"messages": pair["prompt"] + pair["rejected"], "tools": pair.get("tools", [])})
    assert f"exported {len(pairs)} pairs" in said and "in no pair" in said

    more = export(corpus_config, tmp_path / "more.jsonl", "--format", "dpo",
                  "--max-pairs-per-run", "2", "--margin", "5")
    wider = lines(tmp_path / "more.jsonl")
    used = Counter(i for p in wider for i in (p["chosen_trace_id"], p["rejected_trace_id"]))
    assert len(wider) > len(pairs) and max(used.values()) == 2 and "pairs" in more
    assert all(p["chosen_reward"] - p["rejected_reward"] >= 5 for p in wider)

    export(corpus_config, tmp_path / "dpo", "--format", "dpo", "--eval-fraction", "0.3")
    loaded = load(tmp_path / "dpo", tmp_path / "cache")
    assert set(loaded) == {"train", "test"}
    rows = [*loaded["train"], *loaded["test"]]
    assert len(rows) == len(pairs)
    # Parquet holds the JSONL pairs, structured: calls and tool schemas load as objects.
    by_chosen = {p["chosen_trace_id"]: p for p in pairs}
    for row in rows:
        pair = by_chosen[row["chosen_trace_id"]]
        for side in ("prompt", "chosen", "rejected"):
            assert [_set_keys(m) for m in row[side]] == pair[side]
        assert row["tools"] == pair.get("tools", [])
    _render_preferences(rows)


def _render_preferences(rows: list[dict[str, Any]]) -> None:
    """Each pair as TRL's DPOTrainer renders it (`trl.apply_chat_template`), with
    Qwen2.5's template: the prompt ends where both answers begin, and each call of an
    answer is written once, its arguments the object the model wrote."""
    from trl.data_utils import apply_chat_template

    tokenizer, template = chat_templates.renderer(), chat_templates.template("qwen2_5")
    rendered_calls = 0
    for row in rows:
        example = {side: row[side] for side in ("prompt", "chosen", "rejected")}
        text = apply_chat_template(example, tokenizer, tools=row["tools"],
                                   chat_template=template)
        assert text["prompt"].endswith("<|im_start|>assistant\n")
        for side in ("chosen", "rejected"):
            calls = Counter(_qwen2_5_call(c["function"]) for m in row[side]
                            for c in m["tool_calls"] or [])
            for call, times in calls.items():
                assert text[side].count(call) == times, (row["chosen_trace_id"], call)
            rendered_calls += sum(calls.values())
    assert rendered_calls > 100


def test_preference_pairs_take_the_clearest_first() -> None:
    runs = [dataset.Attempt(f"r{i}", "task", reward) for i, reward in enumerate([0, 1, 5, 9, 9.5])]
    pairs = dataset.preference_pairs(runs, margin=1.0, max_per_run=1)
    assert [(a.trace_id, b.trace_id) for a, b in pairs] == [("r4", "r0"), ("r3", "r1")]
    assert dataset.preference_pairs(runs, margin=10, max_per_run=1) == []
    other = [*runs, dataset.Attempt("x", "other", 0.0)]
    assert len(dataset.preference_pairs(other, margin=1.0, max_per_run=3)) == 7


@pytest.mark.process
def test_dedup_and_arguments_from_the_agent_byte_for_byte(
    start_hub: Any, tmp_path: Path
) -> None:
    server = {"storage_backend": "sqlite", "db_path": str(tmp_path / "traces.db")}
    hub: HubProcess = start_hub(server, "--no-workers")
    arguments = '{"path":"/tmp/übung.txt","opts":{"n":[1,2.5,{"x":null}],"flag":true}}'
    chat = {"messages": [
        {"role": "user", "content": "Read the file."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "k1", "type": "function",
             "function": {"name": "read", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "k1", "content": "hello"},
        {"role": "assistant", "content": "It says hello."}], "status": "success"}
    with hub.client() as client:
        for trace_id in ("a", "b"):  # the same content twice
            assert client.post("/v1/traces", json={**chat, "trace_id": trace_id}).status_code == 202
        assert client.post("/v1/traces", json=native_trace(trace_id="c")).status_code == 202
    said = export(hub.config, tmp_path / "out", "--format", "parquet", "--dedup")
    rows = load(tmp_path / "out", tmp_path / "cache")["train"]
    assert sorted(r["trace_id"] for r in rows) == ["a", "c"]
    assert "1 duplicate of an older trace" in said
    [row] = [r for r in rows if r["trace_id"] == "a"]
    [call] = json.loads(row["messages"][1]["tool_calls"])
    assert call["function"]["arguments"] == arguments
    assert json.loads(row["tools"])[0]["function"]["parameters"]["properties"] == {
        "path": {"type": "string"}, "opts": {"type": "object"}}


@pytest.mark.process
@pytest.mark.parametrize(("args", "said"), [
    (["--format", "openai", "--eval-fraction", "0.1", "-o", "x.jsonl"], "needs a dataset directory"),
    (["--format", "parquet", "-o", "-"], "-o DIR, not -"),
    (["--format", "parquet", "--eval-fraction", "1", "-o", "d"], "under 1"),
    (["--format", "dpo", "--margin", "0", "-o", "p.jsonl"], "above 0"),
])
def test_bad_export_options_are_refused_with_one_line(
    tmp_path: Path, args: list[str], said: str
) -> None:
    config = write_config(tmp_path, {"storage_backend": "sqlite",
                                     "db_path": str(tmp_path / "traces.db")})
    done = run_cli("export", "--config", str(config), *args)
    assert done.returncode == 2 and said in done.stderr
    assert "Traceback" not in done.stderr
