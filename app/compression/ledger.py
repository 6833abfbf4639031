"""Token bookkeeping for the strategies: one count per step, kept current as steps are
trimmed, replaced or dropped, so no strategy ever re-tokenizes the whole trace.

Counts are exact, except for very long steps, which start as an estimate from a sample
and become exact when they are trimmed or `settle()`d. Tokenizing every long tool
output in full would cost as much as the rest of compression together, and most of it
is cut away anyway. Estimates err low on purpose: settling can then only raise the
total (and the strategy cuts some more), never drop the result under its floor.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from app.domain import Step, StepType, Trace
from app.ingest.tokens import count_parts, count_tokens

# Steps with more text than this are estimated until needed (~300 tokens of code or
# logs). On real agent runs such steps hold 70% of the text.
LONG_CHARS = 1_000
_SAMPLE_CHARS = 400
# Estimates are scaled down so that they err low (tokens per char varies ~10% within
# one tool output).
_ESTIMATE_SCALE = 0.9
# Share of a trimmed text kept at its head; the rest is kept at its tail, where logs
# and compilers print their verdict.
_HEAD_SHARE = 0.6
_MARKER = re.compile(r"\[\.\.\. (\d+) tokens cut \.\.\.\]")


@dataclass(frozen=True)
class Budget:
    """Where a strategy stops.

    aim:   stop once the total is at or under it (the target, or a little over
           min_tokens_after when the target sits on it, to absorb counting slack).
    floor: no operation may take the total under it (min_tokens_after plus slack).
    lower: a whole-step drop that would land under it is skipped; trims are sized to
           land on `aim`, drops cannot be, and may not overshoot by much.
    """

    aim: int
    floor: int
    lower: int


def step_parts(step: Step) -> list[str]:
    # The trace's own definition of counted text, so step counts add up to total_tokens.
    return step.text_parts()


class Ledger:
    """The trace being compressed: each original step's current form (None once
    dropped), its current token count, and the running total."""

    def __init__(
        self, trace: Trace, steps: list[Step | None], tokens: list[int], estimated: list[bool]
    ):
        self.trace = trace
        self.steps = steps
        self.tokens = tokens
        self.estimated = estimated
        # The tool list and the task: counted in total_tokens, never compressed.
        context = trace.context_parts()
        self.fixed = count_parts(context) + 1 if context else 0
        self.total = self.fixed + sum(tokens)
        # Steps affected, per kind of removal (a step trimmed twice counts once).
        self.removed: Counter[str] = Counter()
        self._touched: set[tuple[str, int]] = set()

    @classmethod
    def of(cls, trace: Trace) -> Ledger:
        tokens, estimated = [], []
        for step in trace.steps:
            count, guess = _count(step)
            tokens.append(count)
            estimated.append(guess)
        return cls(trace, list(trace.steps), tokens, estimated)

    def with_span_replaced(self, start: int, end: int, step: Step) -> Ledger:
        """A new ledger over the trace with steps[start:end] replaced by `step` (the
        summary), keeping every other count."""
        assert all(s is not None for s in self.steps), "replace spans before dropping steps"
        steps = [*self.trace.steps[:start], step, *self.trace.steps[end:]]
        count, guess = _count(step)
        return Ledger(
            self.trace.model_copy(update={"steps": steps}),
            list(steps),
            [*self.tokens[:start], count, *self.tokens[end:]],
            [*self.estimated[:start], guess, *self.estimated[end:]],
        )

    def excess(self, budget: Budget) -> int:
        return self.total - budget.aim

    def drop(self, i: int, kind: str, budget: Budget) -> bool:
        """Remove step i, unless that lands under `budget.lower`."""
        if self.steps[i] is None or self.total - self.tokens[i] < budget.lower:
            return False
        self._set(i, None, 0)
        self._note(kind, i)
        return True

    def drop_group(self, indices: list[int], kind: str, budget: Budget) -> bool:
        """Remove steps that only make sense together (an action and its results)."""
        saving = sum(self.tokens[i] for i in indices)
        if self.total - saving < budget.lower:
            return False
        for i in indices:
            self._set(i, None, 0)
            self._note(kind, i)
        return True

    def replace_content(self, i: int, content: str, kind: str, budget: Budget) -> bool:
        """Give step i new content (e.g. a 'same output as step k' marker)."""
        return self._rewrite(i, content, kind, budget)

    def trim(self, i: int, keep: int, kind: str, budget: Budget) -> bool:
        """Cut step i's content to about `keep` tokens of head and tail, with a marker
        saying how much went, but no more than brings the total to `budget.aim`."""
        step = self.steps[i]
        if step is None or not step.content:
            return False
        keep = max(keep, self.tokens[i] - self.excess(budget), 0)
        if keep >= self.tokens[i] * 0.9:
            return False  # a cut this small saves less than it costs to read
        content = _head_tail(step.content, self.tokens[i], keep)
        return content is not None and self._rewrite(i, content, kind, budget)

    def _rewrite(self, i: int, content: str, kind: str, budget: Budget) -> bool:
        """Step i with new content, if that saves tokens without going under the floor."""
        step = self.steps[i]
        assert step is not None
        new = _with_content(step, content)
        count = count_parts(step_parts(new)) + 1
        if count >= self.tokens[i] or self.total - self.tokens[i] + count < budget.floor:
            return False
        self._set(i, new, count)
        self._note(kind, i)
        return True

    def settle(self) -> bool:
        """Count the steps still estimated exactly; True if the total went up."""
        before = self.total
        for i, guess in enumerate(self.estimated):
            step = self.steps[i]
            if guess and step is not None:
                self._set(i, step, count_parts(step_parts(step)) + 1)
        return self.total > before

    def result(self) -> Trace:
        steps = [s for s in self.steps if s is not None]
        return self.trace.model_copy(update={"steps": steps})

    def _note(self, kind: str, i: int) -> None:
        if (kind, i) not in self._touched:
            self._touched.add((kind, i))
            self.removed[kind] += 1

    def _set(self, i: int, step: Step | None, count: int) -> None:
        self.total += count - self.tokens[i]
        self.steps[i] = step
        self.tokens[i] = count
        self.estimated[i] = False


def _count(step: Step) -> tuple[int, bool]:
    """The step's tokens, +1 for the newline that joins it to the text before it; an
    under-estimate from a sample for very long steps (second item True)."""
    parts = step_parts(step)
    chars = sum(len(p) for p in parts) + len(parts)
    if chars <= LONG_CHARS:
        return (count_parts(parts) + 1 if parts else 0), False
    text = "\n".join(parts)
    half = _SAMPLE_CHARS // 2
    sample = count_tokens(text[:half]) + count_tokens(text[-half:])
    return int(sample / _SAMPLE_CHARS * len(text) * _ESTIMATE_SCALE), True


def _with_content(step: Step, content: str) -> Step:
    # An observation's error is often its whole output; trimmed together, it is still
    # counted once (text_parts skips an error equal to the content).
    update: dict[str, object] = {"content": content}
    if step.error is not None and step.error == step.content:
        update["error"] = content
    return step.model_copy(update=update)


def _head_tail(text: str, tokens: int, keep: int) -> str | None:
    """`text` cut to about `keep` tokens: its head and tail, joined by a marker. Cuts
    fall on line breaks near the budget, so no line is cut in half where avoidable."""
    chars_per_token = len(text) / max(tokens, 1)
    head_end = _snap_back(text, int(keep * _HEAD_SHARE * chars_per_token))
    tail_start = _snap_forward(text, len(text) - int(keep * (1 - _HEAD_SHARE) * chars_per_token))
    if tail_start - head_end < 2 * chars_per_token * 8:
        return None  # the cut would be no longer than its marker
    middle = text[head_end:tail_start]
    # A text trimmed before keeps its earlier marker's count in the new one.
    earlier = sum(int(n) for n in _MARKER.findall(middle))
    cut = round(len(_MARKER.sub("", middle)) / chars_per_token) + earlier
    return f"{text[:head_end]}\n[... {cut} tokens cut ...]\n{text[tail_start:]}"


def _snap_back(text: str, at: int) -> int:
    newline = text.rfind("\n", int(at * 0.8), at)
    return newline + 1 if newline > 0 else at


def _snap_forward(text: str, at: int) -> int:
    newline = text.find("\n", at, at + max(int((len(text) - at) * 0.2), 1))
    return newline + 1 if newline >= 0 else at


def is_error(step: Step) -> bool:
    return step.type is StepType.OBSERVATION and (
        step.error is not None or step.exit_code not in (None, 0)
    )
