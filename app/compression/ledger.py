"""Token bookkeeping for the strategies: one count per step, kept current as steps are
trimmed, replaced or dropped, so no strategy ever re-tokenizes the whole trace.

Counts are exact, except for very long steps, which start as an estimate from a sample
and become exact when they are trimmed or `settle()`d. Tokenizing every long tool
output in full would cost as much as the rest of compression together, and most of it
is cut away anyway. Estimates err low on purpose: settling can then only raise the
total (and the strategy cuts some more), never drop the result under its floor.

The ledger also knows the trace as a conversation (`Links`): which action each result
answers and which user message answers which assistant question. A removal that
would leave the conversation invalid (two user turns in a row, a result without its
call, a question without its answer) is refused, so strategies cut around what the
invariants (app.compression.invariants) require. Every step removed or changed is
listed by its index in the original trace (`listed`), for the compression record.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from app.compression.facts import TOKEN as _FACT_TOKEN
from app.compression.facts import Wanted, candidates, holds
from app.domain import Step, StepType, Trace
from app.tokens import count_parts, count_tokens

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
# The mark of an elision, in the text it shortened: how much went, in tokens.
MARKER = "[… {} tokens of output elided …]"
_MARKER = re.compile(r"\[… ([\d,]+) tokens of output elided …\]")
_MARKED = " tokens of output elided …]"  # in every text _MARKER matches
# A line longer than this that holds a fact keeps only the fact with some context on
# either side (a minified JSON document is one line).
# Before a fact sits what names it (a JSON key, a label), after it less.
_LONG_LINE, _BEFORE, _AFTER = 240, 20, 4
_TOKEN_CHAR = re.compile(r"[\w$./:\-@#]")
# A gap of fewer tokens is kept: its marker would be as long.
_SMALLEST_GAP = 12


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


Speaker = Literal["system", "user", "assistant", "tool"]


def speaker(step: Step) -> Speaker:
    """Who says the step in the chat the exports write: a user's, the environment's
    or a grader's message is the user side; thoughts, calls and answers the assistant's."""
    if step.type is StepType.OBSERVATION:
        return "tool"
    if step.type is StepType.MESSAGE and step.role != "assistant":
        return "system" if step.role == "system" else "user"
    return "assistant"


@dataclass(frozen=True)
class Links:
    """What only makes sense together: `owner` (result -> the action it answers),
    `results` (action -> its results), `partner` (an assistant question <-> the user
    message that answers it)."""

    owner: dict[int, int]
    results: dict[int, list[int]]
    partner: dict[int, int]

    @classmethod
    def of(cls, steps: list[Step]) -> Links:
        owner: dict[int, int] = {}
        results: dict[int, list[int]] = {}
        partner: dict[int, int] = {}
        by_call: dict[str, int] = {}
        chain: int | None = None  # the action a result without an id answers
        for i, step in enumerate(steps):
            if step.type is StepType.ACTION:
                chain = i
                if step.call_id:
                    by_call[step.call_id] = i
            elif step.type is StepType.OBSERVATION:
                action = by_call.get(step.call_id, chain) if step.call_id else chain
                if action is not None:
                    owner[i] = action
                    results.setdefault(action, []).append(i)
            else:
                # A result after anything but calls and results answers no call.
                chain = None
            if i and is_question(steps[i - 1]) and speaker(step) == "user":
                partner[i - 1], partner[i] = i, i - 1
        return cls(owner, results, partner)


def answer(steps: list[Step]) -> list[int]:
    """The final answer: the final steps, else the last assistant message after the
    last call."""
    finals = [i for i, s in enumerate(steps) if s.type is StepType.FINAL]
    if finals:
        return finals
    for i in range(len(steps) - 1, -1, -1):
        if steps[i].type is StepType.ACTION:
            return []
        if steps[i].type is StepType.MESSAGE and steps[i].role == "assistant":
            return [i]
    return []


def is_question(step: Step) -> bool:
    """Assistant text without a call: what a user message right after it answers."""
    return step.type is StepType.FINAL or (
        step.type is StepType.MESSAGE and step.role == "assistant"
    )


def step_parts(step: Step) -> list[str]:
    # The trace's own definition of counted text, so step counts add up to total_tokens.
    return step.text_parts()


class Ledger:
    """The trace being compressed: each original step's current form (None once
    dropped), its current token count, and the running total."""

    def __init__(
        self,
        trace: Trace,
        steps: list[Step | None],
        tokens: list[int],
        estimated: list[bool],
        origin: list[int | None] | None = None,
    ):
        self.trace = trace
        self.steps = steps
        self.tokens = tokens
        self.estimated = estimated
        # Each step's index in the trace as it arrived (None: a summary written here).
        self.origin: list[int | None] = list(origin or range(len(steps)))
        self.links = Links.of(trace.steps)
        # The tool list and the task: counted in total_tokens, never compressed.
        context = trace.context_parts()
        self.fixed = count_parts(context) + 1 if context else 0
        self.total = self.fixed + sum(tokens)
        # Steps affected, per kind of removal (a step trimmed twice counts once), and
        # their indices in the original trace.
        self.removed: Counter[str] = Counter()
        self.listed: dict[str, list[int]] = {}
        self._touched: set[tuple[str, int]] = set()
        self._crossed: list[bool] | None = None  # per boundary, for can_replace
        # What a step says of steps that went with it (`annotate`): it stays whole
        # through any later cut of the step.
        self.notes: dict[int, str] = {}

    @classmethod
    def of(cls, trace: Trace) -> Ledger:
        tokens, estimated = [], []
        for step in trace.steps:
            count, guess = _count(step)
            tokens.append(count)
            estimated.append(guess)
        return cls(trace, list(trace.steps), tokens, estimated)

    def with_span_replaced(self, start: int, end: int, step: Step, kind: str) -> Ledger:
        """A new ledger over the trace with steps[start:end] replaced by `step` (the
        summary), keeping every other count; the span is noted as `kind`."""
        assert all(s is not None for s in self.steps), "replace spans before dropping steps"
        assert self.origin == list(range(len(self.steps))), "replace spans of the original"
        steps = [*self.trace.steps[:start], step, *self.trace.steps[end:]]
        count, guess = _count(step)
        replaced = Ledger(
            self.trace.model_copy(update={"steps": steps}),
            list(steps),
            [*self.tokens[:start], count, *self.tokens[end:]],
            [*self.estimated[:start], guess, *self.estimated[end:]],
            [*range(start), None, *range(end, len(self.steps))],
        )
        replaced.removed[kind] = end - start
        replaced.listed[kind] = list(range(start, end))
        return replaced

    def can_replace(self, start: int, end: int) -> bool:
        """Whether steps[start:end] may become one user message (a summary): a span
        no link crosses (a call and its result, a question and its answer), after
        which the summary meets neither a user turn nor a result. Both ends are
        independent, so a search can test each once (`opens_span`, `closes_span`)."""
        return start < end and self.opens_span(start) and self.closes_span(end)

    def opens_span(self, start: int) -> bool:
        return self._uncut(start) and _may_follow(self._said_before(start, set()), "user")

    def closes_span(self, end: int) -> bool:
        return self._uncut(end) and _may_follow("user", self._said_after(end - 1, set()))

    def _uncut(self, boundary: int) -> bool:
        """No link joins a step before `boundary` to one at or after it (spans are cut
        from the trace as it arrived, before any drop)."""
        if self._crossed is None:
            depth = [0] * (len(self.steps) + 2)
            links = self.links
            pairs = [*links.owner.items(), *links.partner.items()]
            for i, j in pairs:
                low, high = min(i, j), max(i, j)
                depth[low + 1] += 1
                depth[high + 1] -= 1
            running, self._crossed = 0, []
            for d in depth[: len(self.steps) + 1]:
                running += d
                self._crossed.append(running > 0)
        return not self._crossed[boundary]

    def excess(self, budget: Budget) -> int:
        return self.total - budget.aim

    def drop(self, i: int, kind: str, budget: Budget) -> bool:
        """Remove step i, unless that lands under `budget.lower` or breaks the
        conversation."""
        return self.drop_group([i], kind, budget)

    def drop_group(self, indices: list[int], kind: str, budget: Budget) -> bool:
        """Remove steps that only make sense together (an action and its results, a
        question and its answer), unless that lands under `budget.lower` or leaves
        the conversation invalid."""
        alive = [i for i in indices if self.steps[i] is not None]
        saving = sum(self.tokens[i] for i in alive)
        if not alive or self.total - saving < budget.lower or not self.can_drop(alive):
            return False
        for i in alive:
            self._set(i, None, 0)
            self._note(kind, i)
        return True

    def can_drop(self, indices: list[int]) -> bool:
        """Whether removing these steps leaves the conversation valid."""
        return self._keeps_conversation({i for i in indices if self.steps[i] is not None})

    def together(self, i: int) -> list[int]:
        """Step i and what must go with it: an action's results, a question's answer
        (and the reverse)."""
        links = self.links
        group = {i, *links.results.get(i, [])}
        if i in links.owner:
            group |= {links.owner[i], *links.results[links.owner[i]]}
        for j in list(group):
            if j in links.partner:
                group.add(links.partner[j])
        return sorted(group)

    def _keeps_conversation(self, group: set[int]) -> bool:
        """Whether removing `group` leaves a valid chat: nothing it needs left behind,
        and no bad seam."""
        links = self.links
        for i in group:
            needed = [links.partner.get(i), links.owner.get(i), *links.results.get(i, [])]
            if any(j is not None and j not in group and self.steps[j] is not None
                   for j in needed):
                return False
        # The seams: the steps that would meet where each run of removed steps was.
        seams: list[tuple[int, int]] = []
        for i in sorted(group):
            if seams and all(self.steps[j] is None for j in range(seams[-1][1] + 1, i)):
                seams[-1] = (seams[-1][0], i)
            else:
                seams.append((i, i))
        return all(
            _may_follow(self._said_before(first, group), self._said_after(last, group))
            for first, last in seams
        )

    def _said_before(self, i: int, group: set[int]) -> str | None:
        """Who speaks last before step i once `group` is gone ("action" for a call);
        the task is the user turn before the first step that is not a system message."""
        j = i - 1
        while j >= 0 and (self.steps[j] is None or j in group):
            j -= 1
        k = j
        while k >= 0 and (self.steps[k] is None or k in group or is_system(self.steps[k])):
            k -= 1
        if k < 0 and self.trace.task:
            return "user"
        step = self.steps[j] if j >= 0 else None
        if step is None:
            return None
        return "action" if step.type is StepType.ACTION else speaker(step)

    def _said_after(self, i: int, group: set[int]) -> str | None:
        j = i + 1
        while j < len(self.steps) and (self.steps[j] is None or j in group):
            j += 1
        step = self.steps[j] if j < len(self.steps) else None
        return None if step is None else speaker(step)

    def replace_content(self, i: int, content: str, kind: str, budget: Budget) -> bool:
        """Give step i new content (e.g. a 'same output as step k' marker), its note
        kept."""
        return self._rewrite(i, content + self.notes.get(i, ""), kind, budget)

    def trim(
        self, i: int, keep: int, kind: str, budget: Budget,
        needed: Callable[[str], bool] | None = None,
    ) -> bool:
        """Cut step i's content to about `keep` tokens of head and tail, and the lines
        holding a fact `needed` says must stay, with a marker where text went; but no
        more than brings the total to `budget.aim`."""
        step = self.steps[i]
        if step is None or not step.content:
            return False
        note = self.notes.get(i, "")
        text = step.content.removesuffix(note)
        keep = max(keep, self.tokens[i] - self.excess(budget), 0)
        for _ in range(3):
            if keep >= self.tokens[i] * 0.9:
                return False  # a cut this small saves less than it costs to read
            content = elide(text, self.tokens[i], keep, needed)
            if content is None:
                return False
            new = _with_content(step, content + note)
            count = _tokens(step_parts(new))
            # Cuts land near `keep`, not on it: one under the floor keeps a little more.
            short = budget.floor - (self.total - self.tokens[i] + count)
            if short <= 0:
                return self._rewritten(i, new, count, kind, budget)
            keep += short + 8
        return False

    def annotate(self, i: int, note: str, kind: str) -> None:
        """Add to step i's content a note of what went with it (it may grow); later
        cuts of the step keep the note."""
        step = self.steps[i]
        assert step is not None
        self.notes[i] = self.notes.get(i, "") + note
        new = _with_content(step, (step.content or "") + note)
        self._set(i, new, _tokens(step_parts(new)))
        self._note(kind, i)

    def _rewrite(self, i: int, content: str, kind: str, budget: Budget) -> bool:
        """Step i with new content, if that saves tokens without going under the floor."""
        step = self.steps[i]
        assert step is not None
        new = _with_content(step, content)
        return self._rewritten(i, new, _tokens(step_parts(new)), kind, budget)

    def _rewritten(self, i: int, new: Step, count: int, kind: str, budget: Budget) -> bool:
        """Step i as `new` (of `count` tokens), if that saves tokens without going
        under the floor."""
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
                self._set(i, step, _tokens(step_parts(step)))
        return self.total > before

    def result(self) -> Trace:
        steps = [s for s in self.steps if s is not None]
        return self.trace.model_copy(update={"steps": steps})

    def _note(self, kind: str, i: int) -> None:
        if (kind, i) not in self._touched:
            self._touched.add((kind, i))
            self.removed[kind] += 1
            origin = self.origin[i]
            if origin is not None:
                self.listed.setdefault(kind, []).append(origin)

    def _set(self, i: int, step: Step | None, count: int) -> None:
        self.total += count - self.tokens[i]
        self.steps[i] = step
        self.tokens[i] = count
        self.estimated[i] = False


def _may_follow(before: str | None, after: str | None) -> bool:
    """Two steps may meet: no two user turns in a row; a result only after a call or
    another result."""
    if before == "user" and after == "user":
        return False
    return after != "tool" or before in ("action", "tool")


def is_system(step: Step | None) -> bool:
    return step is not None and step.type is StepType.MESSAGE and step.role == "system"


def _count(step: Step) -> tuple[int, bool]:
    """The step's tokens, +1 for the newline that joins it to the text before it; an
    under-estimate from a sample for very long steps (second item True)."""
    parts = step_parts(step)
    chars = sum(len(p) for p in parts) + len(parts)
    if chars <= LONG_CHARS:
        return _tokens(parts), False
    text = "\n".join(parts)
    half = _SAMPLE_CHARS // 2
    sample = count_tokens(text[:half]) + count_tokens(text[-half:])
    return int(sample / _SAMPLE_CHARS * len(text) * _ESTIMATE_SCALE), True


def _tokens(parts: list[str]) -> int:
    """A step's tokens in the joined trace: its own, and the newline that joins it to
    the text before it (which merges into the newline a text before it ends with: one
    token either way, so it is counted on this side)."""
    if not parts:
        return 0
    return count_parts(parts) + (0 if parts[-1].endswith("\n") else 1)


def _with_content(step: Step, content: str) -> Step:
    # An observation's error is often its whole output; trimmed together, it is still
    # counted once (text_parts skips an error equal to the content).
    update: dict[str, object] = {"content": content}
    if step.error is not None and step.error == step.content:
        update["error"] = content
    return step.model_copy(update=update)


def elide(
    text: str, tokens: int, keep: int, needed: Callable[[str], bool] | None = None
) -> str | None:
    """`text` cut to about `keep` tokens of head and tail, plus every line of the
    middle holding a fact `needed` wants, each gap marked with the tokens it held.
    Cuts fall on line breaks near the budget, so no line is cut in half where
    avoidable. None when the cut would be no longer than its marker."""
    chars_per_token = len(text) / max(tokens, 1)
    head_end = _snap_back(text, int(keep * _HEAD_SHARE * chars_per_token))
    tail_start = _snap_forward(text, len(text) - int(keep * (1 - _HEAD_SHARE) * chars_per_token))
    if tail_start - head_end < 2 * chars_per_token * 8:
        return None
    pieces: list[str | tuple[float, str]] = []  # kept text, or (tokens, text) elided
    middle = text[head_end:tail_start]
    if isinstance(needed, Wanted):
        needed = needed.within(middle)
    for line in middle.splitlines(keepends=True):
        if needed is None or _MARKER.search(line) and not _holds(line, needed):
            pieces.append(_elided(line, chars_per_token))
        elif len(line) <= _LONG_LINE:
            pieces.append(line if _holds(line, needed) else _elided(line, chars_per_token))
        else:
            pieces += _fragments(line, needed, chars_per_token)
    out, gap, held = [text[:head_end]], 0.0, ""
    for piece in [*pieces, ""]:
        if not isinstance(piece, str):
            gap, held = gap + piece[0], held + piece[1]
            continue
        if gap >= _SMALLEST_GAP:
            at_line = not out[-1] or out[-1].endswith("\n")
            mark = MARKER.format(f"{round(gap):,}")
            out.append(f"{mark}\n" if at_line else f" {mark} ")
        else:
            out.append(held)  # shorter than its marker: kept
        gap, held = 0.0, ""
        out.append(piece)
    out.append(text[tail_start:])
    return "".join(out)


def _holds(line: str, needed: Callable[[str], bool]) -> bool:
    return holds(line, needed)


def _elided(text: str, chars_per_token: float) -> tuple[float, str]:
    """A piece of text to elide, with the tokens it stands for: its own, and those
    earlier marks in it say."""
    if _MARKED not in text:
        return len(text) / chars_per_token, text
    earlier = sum(int(n.replace(",", "")) for n in _MARKER.findall(text))
    return len(_MARKER.sub("", text)) / chars_per_token + earlier, text


def _fragments(
    line: str, needed: Callable[[str], bool], chars_per_token: float
) -> list[str | tuple[float, str]]:
    """A long line as the facts it holds, each with some context, and the gaps."""
    # Its distinct tokens that hold one, read at once: then each place a token comes is
    # a lookup (a minified document repeats its keys), and a line with none is not read
    # again.
    holding = {token for token in set(_FACT_TOKEN.findall(line))
               if any(needed(p) for p in candidates(token))}
    spans: list[list[int]] = []
    for match in _FACT_TOKEN.finditer(line) if holding else ():
        if match.group() in holding:
            start, end = max(0, match.start() - _BEFORE), min(len(line), match.end() + _AFTER)
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
    out: list[str | tuple[float, str]] = []
    at = 0
    for start, end in spans:
        if start > at:
            out.append(_elided(line[at:start], chars_per_token))
        out.append(line[start:end])
        at = end
    rest = line[at:]
    if rest.endswith("\n"):
        out += [_elided(rest[:-1], chars_per_token), "\n"]
    elif rest:
        out.append(_elided(rest, chars_per_token))
    return out


def _snap_back(text: str, at: int) -> int:
    newline = text.rfind("\n", int(at * 0.5), at)
    if newline > 0:
        return newline + 1
    # A head that is all one token keeps that token whole rather than nothing.
    return _token_start(text, at) or _token_end(text, at)


def _snap_forward(text: str, at: int) -> int:
    reach = max(int((len(text) - at) * 0.2), 1)
    newline = text.find("\n", at, at + reach)
    if newline < 0:
        newline = text.rfind("\n", at - reach, at)
    return newline + 1 if newline >= 0 else _token_start(text, at)


def _token_start(text: str, at: int) -> int:
    """`at`, moved back to the start of the token it falls in, so that a cut in the
    middle of a line leaves every fact whole on one side (a token longer than a
    paragraph is cut where it is)."""
    start = at
    while start > 0 and at - start < 400 and _TOKEN_CHAR.match(text, start - 1):
        start -= 1
    return start if at - start < 400 else at


def _token_end(text: str, at: int) -> int:
    end = at
    while end < len(text) and end - at < 400 and _TOKEN_CHAR.match(text, end):
        end += 1
    return end if end - at < 400 else at


def is_error(step: Step) -> bool:
    return step.type is StepType.OBSERVATION and (
        step.error is not None or step.exit_code not in (None, 0)
    )
