"""Which step of a compressed trace came from which step of the original, for showing
the two side by side: `align(original, compressed)`.

Compression keeps the steps in order and only drops steps, rewrites a step's content
(a trim, a "same output as step k" marker) or replaces a span with one summary message
(app/compression), so one forward pass pairs them: each compressed step is matched to
the first original step at or after the last match that it can have come from; the
original steps passed over were removed, and a compressed step that matches none was
added (a summary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.domain import Step

Change = Literal["kept", "rewritten", "removed", "added"]
# A rewritten thought or message keeps its head (trims keep the first 60%).
_SAME_HEAD = 40


@dataclass(frozen=True, slots=True)
class Pair:
    original: int | None  # index into the original steps
    compressed: int | None  # index into the compressed steps
    change: Change


def align(original: list[Step], compressed: list[Step]) -> list[Pair]:
    pairs: list[Pair] = []
    start = 0
    for j, step in enumerate(compressed):
        match = next((i for i in range(start, len(original))
                      if _came_from(step, original[i])), None)
        if match is None:
            pairs.append(Pair(None, j, "added"))
            continue
        pairs += [Pair(i, None, "removed") for i in range(start, match)]
        same = original[match] == step
        pairs.append(Pair(match, j, "kept" if same else "rewritten"))
        start = match + 1
    pairs += [Pair(i, None, "removed") for i in range(start, len(original))]
    return pairs


def _came_from(step: Step, source: Step) -> bool:
    if (step.type, step.tool, step.call_id, step.role) != (
        source.type, source.tool, source.call_id, source.role
    ):
        return False
    if step.content == source.content or step.call_id is not None:
        return True
    head = min(_SAME_HEAD, len(source.content or ""))
    return (step.content or "")[:head] == (source.content or "")[:head]
