"""What a trace's page shows, worked out from its record: the steps with their marks
(tool errors, non-zero exits, the reject reasons that name them), long outputs cut
into a shown head and a folded rest, the reward breakdown, and the original and
compressed steps paired side by side (app/compression/alignment.py)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from app.compression.alignment import align
from app.domain import Step
from app.evaluation.scoring import breakdown_total

# An output longer than this is shown folded: its head, and the rest behind a toggle.
FOLD_LINES, FOLD_CHARS = 12, 1500
# In the side-by-side comparison, each side shows less before folding.
COMPARE_LINES, COMPARE_CHARS = 4, 400


@dataclass
class StepView:
    index: int
    type: str
    role: str | None
    tool: str | None
    call_id: str | None
    head: str
    rest: str
    arguments: Any
    error: str | None  # an error text other than the output itself
    tool_error: bool
    exit_code: int | None
    rejections: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rest_lines(self) -> int:
        return self.rest.count("\n") + 1 if self.rest else 0


def fold(text: str, lines: int = FOLD_LINES, chars: int = FOLD_CHARS) -> tuple[str, str]:
    """(head, rest): `text` cut after `lines` lines or `chars` characters, at a line
    break where there is one; rest is empty when nothing needs folding."""
    if len(text) <= chars and text.count("\n") < lines:
        return text, ""
    cut = min(chars, len(text))
    newline = -1
    for _ in range(lines):
        newline = text.find("\n", newline + 1, cut)
        if newline < 0:
            break
    if newline > 0:
        cut = newline + 1
    else:
        at = text.rfind("\n", 0, cut)
        cut = at + 1 if at > chars // 2 else cut
    return text[:cut], text[cut:]


def step_view(index: int, step: dict[str, Any], lines: int = FOLD_LINES,
              chars: int = FOLD_CHARS) -> StepView:
    content = step.get("content") or ""
    error = step.get("error")
    exit_code = step.get("exit_code")
    head, rest = fold(content, lines, chars)
    return StepView(
        index=index,
        type=step.get("type", "message"),
        role=step.get("role"),
        tool=step.get("tool"),
        call_id=step.get("call_id"),
        head=head,
        rest=rest,
        arguments=step.get("arguments"),
        error=error if error and error != content else None,
        tool_error=error is not None,
        exit_code=exit_code if exit_code not in (None, 0) else None,
    )


def trace_view(record: dict[str, Any], compressed: dict[str, Any] | None) -> dict[str, Any]:
    trace = record["trace"] or {}
    raw_steps: list[dict[str, Any]] = trace.get("steps") or []
    steps = [step_view(i, s) for i, s in enumerate(raw_steps)]
    unplaced = []
    for reason in record["reject_reasons"]:
        index = reason.get("step_index")
        if isinstance(index, int) and 0 <= index < len(steps):
            steps[index].rejections.append(reason)
        else:
            unplaced.append(reason)
    breakdown = record["reward_breakdown"] or {}
    computed = breakdown_total(breakdown) if breakdown else None
    final = next((s.get("content") for s in reversed(raw_steps) if s.get("type") == "final"),
                 None)
    return {
        "task": _folded(trace.get("task") or ""),
        "final_answer": None if final is None else _folded(final),
        "outcome": trace.get("outcome") or {},
        "tools": trace.get("tools"),
        "steps": steps,
        "errors": sum(1 for s in steps if s.tool_error or s.exit_code is not None),
        "unplaced": unplaced,
        "breakdown": sorted(breakdown.items(), key=lambda kv: (not kv[1]["fired"], kv[0])),
        "computed": computed,
        "compare": (_compare(raw_steps, compressed, record.get("compression") or {})
                    if compressed is not None else None),
    }


def _folded(text: str) -> dict[str, Any]:
    head, rest = fold(text)
    return {"head": head, "rest": rest, "rest_lines": rest.count("\n") + 1 if rest else 0}


def _compare(original: list[dict[str, Any]], compressed: dict[str, Any],
             record: dict[str, Any]) -> dict[str, Any]:
    kept: list[dict[str, Any]] = compressed.get("steps") or []
    pairs = align([Step.model_validate(s) for s in original],
                  [Step.model_validate(s) for s in kept])
    # A step may be changed more than once (a repeated call's first result, counted,
    # then elided): each change is said.
    kinds: dict[int, list[str]] = {}
    for kind, at in (record.get("removed_steps") or {}).items():
        for i in at:
            kinds.setdefault(i, []).append(kind)
    rows = []
    for pair in pairs:
        after = None if pair.compressed is None else kept[pair.compressed]
        rows.append({
            "change": pair.change,
            "kinds": kinds.get(pair.original, []) if pair.original is not None else [],
            "what": _what(pair.original, after, kinds, original),
            "original": None if pair.original is None else step_view(
                pair.original, original[pair.original], COMPARE_LINES, COMPARE_CHARS),
            "compressed": None if after is None or pair.compressed is None else step_view(
                pair.compressed, after, COMPARE_LINES, COMPARE_CHARS),
        })
    counts = {change: sum(1 for p in pairs if p.change == change)
              for change in ("kept", "rewritten", "removed", "added")}
    how = Counter(kind for changes in kinds.values() for kind in changes)
    said = {"elided": how["redundant_tool_outputs"] + how["long_preserved_outputs"],
            "referenced": how["repeated_observations"],
            "collapsed": sum(1 for i, changes in kinds.items() if "repeated_calls" in changes
                             and original[i].get("type") == "action"),
            "thoughts_dropped": how["intermediate_thoughts"]}
    return {"rows": rows, "counts": counts, "how": said}


_ELIDED = re.compile(r"\[… ([\d,]+) tokens of output elided …\]")


def _what(i: int | None, after: dict[str, Any] | None, kinds: dict[int, list[str]],
          original: list[dict[str, Any]]) -> str | None:
    """What compression did to original step i, in words (None: nothing to say)."""
    if i is None:
        return "summary of the steps it replaces" if after is not None else None
    said = [_change(i, kind, after, kinds, original) for kind in kinds.get(i, [])]
    return "; ".join(s for s in said if s) or None


def _change(i: int, kind: str, after: dict[str, Any] | None, kinds: dict[int, list[str]],
            original: list[dict[str, Any]]) -> str | None:
    """One change of original step i, in words."""
    if kind in ("redundant_tool_outputs", "long_preserved_outputs"):
        elided = sum(int(n.replace(",", "")) for n in _ELIDED.findall(
            (after or {}).get("content") or ""))
        return f"output elided: {elided:,} tokens, marked where they were"
    if kind == "repeated_observations":
        return "the same output as an earlier step: a reference to it"
    if kind == "repeat_counts":
        return "the first of a repeated call: says how many times it came"
    if kind == "repeated_calls":
        step = original[i]
        call = i if step.get("type") == "action" else next(
            (j for j in range(i - 1, -1, -1) if original[j].get("type") == "action"), i)
        first = next((j for j in range(call - 1, -1, -1)
                      if "repeated_calls" not in kinds.get(j, [])
                      and original[j].get("type") == "action"
                      and original[j].get("tool") == original[call].get("tool")
                      and original[j].get("arguments") == original[call].get("arguments")), None)
        return ("exact repeat, collapsed into the first" if first is None
                else f"exact repeat of step {first}, collapsed into it")
    if kind == "intermediate_thoughts":
        return "thought dropped"
    if kind == "summarized_steps":
        return "summarized"
    return None
