"""What every compression strategy keeps, checked in one place: by the tests on every
compressed trace of the real corpus, and by compress() on every result it returns.

    faults = violations(original, compressed, policy)   # [] when all hold

1. The system prompt, the first user message (the task) and the final answer
   verbatim. Only what a strategy may change is changed (`_MAY_CHANGE`): a thought
   dropped, a tool output rewritten (cut, or a reference to an earlier copy), an exact
   repeat of a call dropped with its result, and one contiguous span summarized. So no
   tool call and no user turn goes, but for a repeat or a summary.
2. A valid chat, as the exports write it (app.formats._common.turns): no two user
   turns in a row, every tool result in the assistant turn whose call it answers, no
   call without its result, no empty assistant turn (`conversation_faults`); and an
   assistant question and the user message answering it kept or removed together.
   A fault the original already has (a run that ended on a call that got no result)
   is not the strategy's: conversation faults are compared, kind by kind, with the
   original's.
3. Every step removed or changed is listed in the compression record
   (`removed_steps`, indices into the original), and nothing else changed.

The strategies keep these as they go (Ledger.drop_group, Ledger.can_replace refuse a
removal that would break them); when the target cannot be reached within them, the
trace stays over it and the record says how far it got.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from app.compression.ledger import Links, answer, is_system
from app.compression.summarize import PREFIX
from app.config import CompressionConfig
from app.domain import Step, StepType, Trace
from app.formats._common import Turn, turns

# Kinds of removal that take whole steps out (the others change a step's content).
DROPPING = frozenset({"intermediate_thoughts", "repeated_calls", "summarized_steps"})
# The steps each kind may touch (absent: any, in one contiguous span); every other
# kind rewrites a tool output's content.
_MAY_CHANGE: dict[str, frozenset[StepType]] = {
    "intermediate_thoughts": frozenset({StepType.THOUGHT}),
    "repeated_calls": frozenset({StepType.ACTION, StepType.OBSERVATION}),
}
_OUTPUT = frozenset({StepType.OBSERVATION})

# What a cut of a tool output leaves as it was: every field of the step but its text.
_BEYOND_CONTENT = tuple(name for name in Step.model_fields if name not in ("content", "error"))

TWO_USER_TURNS = "two user turns in a row"
RESULT_WITHOUT_CALL = "a tool result that answers no call of the assistant turn before it"
CALL_WITHOUT_RESULT = "a tool call without its result"
EMPTY_ASSISTANT_TURN = "an empty assistant turn"


def conversation_faults(trace: Trace) -> list[tuple[str, int]]:
    """(fault, turn index) for each way the trace, as a chat, is not a valid one."""
    return _chat_faults(turns(trace))


def _chat_faults(chat: list[Turn]) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for k, turn in enumerate(chat):
        if turn.role == "user" and k and chat[k - 1].role == "user":
            found.append((TWO_USER_TURNS, k))
        if turn.role != "assistant":
            continue
        said = (turn.thought or "").strip() or (turn.text or "").strip()
        if not said and not turn.actions:
            found.append((EMPTY_ASSISTANT_TURN, k))
        found += [(RESULT_WITHOUT_CALL, k) for r in turn.result_ids if r not in turn.call_ids]
        found += [(CALL_WITHOUT_RESULT, k) for c in turn.call_ids if c not in turn.result_ids]
    return found


def violations(
    original: Trace, compressed: Trace, policy: CompressionConfig, links: Links | None = None
) -> list[str]:
    """How `compressed` (with its record in metadata["compression"]) breaks the
    invariants of the module docstring; empty when it keeps them all. `links`: the
    original's, when the caller has them."""
    faults: list[str] = []
    chat_before, chat_after = turns(original), turns(compressed)
    if _system(original) != _system(compressed):
        faults.append("the system prompt changed")
    if _first_user(chat_before) != _first_user(chat_after):
        faults.append("the first user message changed")
    if _answer(original) != _answer(compressed):
        faults.append("the final answer changed")
    before = Counter(kind for kind, _ in _chat_faults(chat_before))
    for kind, at in _chat_faults(chat_after):
        before[kind] -= 1
        if before[kind] < 0:
            faults.append(f"turn {at}: {kind}")
    record = compressed.metadata.get("compression") or {}
    listed: Mapping[str, Sequence[int]] = record.get("removed_steps") or {}
    faults += _record_faults(original, compressed, listed, record.get("removed") or {})
    faults += _kind_faults(original, listed)
    gone = {i for kind in DROPPING for i in listed.get(kind, ())}
    for question, reply in (links or Links.of(original.steps)).partner.items():
        if (question in gone) != (reply in gone):
            faults.append(f"step {question} or {reply} removed without the other "
                          "(a question and its answer)")
    return faults


def _kind_faults(original: Trace, listed: Mapping[str, Sequence[int]]) -> list[str]:
    """Each kind of removal touched only the steps it may."""
    faults = []
    for kind, at in listed.items():
        if kind == "summarized_steps":
            if sorted(at) != list(range(min(at, default=0), max(at, default=-1) + 1)):
                faults.append("the summarized steps are not one contiguous span")
            continue
        allowed = _MAY_CHANGE.get(kind, _OUTPUT)
        faults += [f"step {i} ({original.steps[i].type.value}) changed as {kind}"
                   for i in at if original.steps[i].type not in allowed]
    return faults


def _record_faults(
    original: Trace, compressed: Trace, listed: Mapping[str, Sequence[int]],
    counts: Mapping[str, Any],
) -> list[str]:
    """The original with the listed removals applied must be the compressed trace."""
    faults = [f"removed[{kind!r}] is {counts.get(kind)}, but {len(at)} steps are listed"
              for kind, at in listed.items() if counts.get(kind) != len(at)]
    summarized = set(listed.get("summarized_steps", ()))
    gone = {i for kind in DROPPING for i in listed.get(kind, ())}
    changed = {i for kind, at in listed.items() if kind not in DROPPING for i in at}
    expected: list[tuple[int, Step] | None] = []  # None: the summary
    for i, step in enumerate(original.steps):
        if i in summarized and i == min(summarized):
            expected.append(None)
        elif i not in gone:
            expected.append((i, step))
    if original.task != compressed.task:
        faults.append("the task changed")
    if len(expected) != len(compressed.steps):
        return [*faults, f"{len(original.steps) - len(compressed.steps)} steps are gone, "
                         f"but the record lists {len(gone)} removed"]
    for kept, got in zip(expected, compressed.steps):
        if kept is None:
            if not (got.type is StepType.MESSAGE and (got.content or "").startswith(PREFIX)):
                faults.append("the summary is not where the record says")
            continue
        i, step = kept
        if i in changed:
            if any(getattr(got, name) != getattr(step, name) for name in _BEYOND_CONTENT):
                faults.append(f"step {i} changed beyond its content")
        elif got is not step and got != step:
            faults.append(f"step {i} changed but is not listed in the record")
    return faults


def _system(trace: Trace) -> list[str | None]:
    return [s.content for s in trace.steps if is_system(s)]


def _first_user(chat: list[Turn]) -> str | None:
    return next((t.text for t in chat if t.role == "user"), None)


def _answer(trace: Trace) -> list[str | None]:
    return [trace.steps[i].content for i in answer(trace.steps)]
