"""Reflexion ReAct thought logs: plain text, sections `BEGIN CORRECT|INCORRECT|HALTED
AGENTS`, each holding trajectories that start with `Question: ...` and go on with
numbered `Thought N:` / `Action N: Search[...]|Lookup[...]|Finish[...]` /
`Observation N:` blocks (an observation may run over several lines).

The section is the outcome: CORRECT success, INCORRECT failure, HALTED `timeout` (the
step limit was hit before any Finish). `Answer is CORRECT|INCORRECT` is the
environment's verdict, kept as the reason, not a step. The Wikipedia tool's
`Could not find [X]. Similar: [...]` and `No Results` are tool errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from app.domain import Agent, Outcome, Status, Trace
from app.import_sources._common import react_steps

NAME = "reflexion"

_SECTION = re.compile(r"^-+ BEGIN (CORRECT|INCORRECT|HALTED) AGENTS -+\s*$")
_BLOCK = re.compile(r"^(Thought|Action|Observation) \d+:[ \t]?(.*)$")
_TOOL_ERROR = re.compile(r"^(?:Could not find \[|No Results|Invalid Action)")
_VERDICT = re.compile(r"^Answer is (?:CORRECT|INCORRECT)\s*$")
_STATUS = {"CORRECT": Status.SUCCESS, "INCORRECT": Status.FAILURE, "HALTED": Status.TIMEOUT}


def looks_like(obj: Any) -> bool:
    if not isinstance(obj, str):
        return False
    head = obj[:65536]
    return bool(re.search(r"^-+ BEGIN \w+ AGENTS -+", head, re.MULTILINE)) or (
        head.lstrip().startswith("Question:") and "\nThought 1:" in head
    )


def parse(obj: str) -> Iterator[Trace]:
    section: str | None = None
    current: list[str] = []
    index = 0
    for line in obj.splitlines():
        header = _SECTION.match(line)
        if header is not None or line.startswith("Question:"):
            if current:
                yield _trace(current, section, index)
                index += 1
            current = [line] if header is None else []
            section = header.group(1) if header is not None else section
        elif current:
            current.append(line)
    if current:
        yield _trace(current, section, index)


def _trace(lines: list[str], section: str | None, index: int) -> Trace:
    blocks: list[tuple[str, str]] = []
    correct_answer: str | None = None
    for line in lines[1:]:
        block = _BLOCK.match(line)
        if block is not None:
            blocks.append((block.group(1), block.group(2)))
        elif line.startswith("Correct answer:"):
            correct_answer = line.removeprefix("Correct answer:").strip()
        elif blocks:
            kind, text = blocks[-1]
            blocks[-1] = (kind, f"{text}\n{line}")
    steps, verdict = react_steps(
        blocks,
        tool_error=lambda text: text if _TOOL_ERROR.match(text) else None,
        is_verdict=lambda text: bool(_VERDICT.match(text)),
    )
    return Trace(
        task=lines[0].removeprefix("Question:").strip(),
        agent=Agent(name="Reflexion ReAct"),
        steps=steps,
        outcome=_outcome(section, verdict),
        metadata={"section": section, "index": index, "correct_answer": correct_answer},
        source_format=NAME,
    )


def _outcome(section: str | None, verdict: str | None) -> Outcome:
    if section is not None:
        # The section decides: two HALTED agents do carry a late verdict.
        reason = f"{section} section" + (f"; {verdict}" if verdict else "")
        return Outcome(status=_STATUS[section], reason=reason)
    if verdict is not None:
        status = Status.SUCCESS if "INCORRECT" not in verdict else Status.FAILURE
        return Outcome(status=status, reason=verdict)
    return Outcome(status=Status.UNKNOWN)
