"""key_decision_extract: deterministic, no model calls.

Always kept whole: the system prompt (unless drop_fields names `system_prompt`), the
task and the first user message, and the final answer (app.compression.invariants).
Preserved, by preserve_fields: `final_action` (the last action with its result, when
the run ends without an answer), `reward_signal` (the outcome, reward and breakdown,
which live in the trace's outcome and metadata, and a user/environment message after
the agent's last step), `error_context` (every tool error with the action that caused
it and the step that reacted to it). Preserved steps are never removed.

Everything else goes in this order, least loss first. Each pass stops the moment the
total reaches the target, so a pass only runs when the ones before were not enough.
Passes 1-4 are the drop_fields (each runs only if listed); 5-7 are the tighter passes
that reach the target when preserved parts leave room, or max_tokens_after otherwise.

1. repeated_observations  an output equal (or equal but for numbers, ids and spacing)
                          to one within the last `dedup_window` steps becomes a
                          one-line pointer to it: nothing is lost.
2. redundant_tool_outputs long outputs, largest first, cut to head and tail (384
                          tokens) with a "[... N tokens cut ...]" marker: the first
                          lines and the verdict survive; the middle of a listing or a
                          file dump is what the agent used least.
3. intermediate_thoughts  thoughts that neither react to an error nor end the run,
                          oldest first: the actions still show what was done.
4. redundant_tool_outputs again, tighter (64 tokens).
5. long_messages          messages and thoughts not preserved, cut to 64 tokens.
6. long_preserved_outputs preserved outputs and reactions (the errors, the final
                          result) cut to head and tail (256 tokens): an error's
                          message sits at one end.
7. exploration_steps      whole actions with their results that nothing preserved
                          depends on, oldest first, then other unpreserved steps; a
                          question goes with its answer.
8. system_prompt          only when drop_fields names it: system messages cut to head
                          and tail (256 tokens), last, since they define the tools
                          every step uses.

Whole steps go only where the conversation stays valid (Ledger.drop_group): when the
target cannot be reached that way, the trace stays over it and the record says by how
much. Trims are sized to land on the target rather than under it; whole-step drops may
not overshoot it by more than 15%; nothing takes the trace under min_tokens_after.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from app.compression.ledger import Budget, Ledger, Links, answer, is_error, is_system
from app.config import CompressionConfig
from app.domain import Step, StepType, Trace

SOFT_KEEP = 384
TIGHT_KEEP = 64
PRESERVED_KEEP = 256
SYSTEM_KEEP = 256

# Near-identical: the same text once numbers, hex ids and runs of spaces are masked
# (timestamps, pids, durations, addresses differ between two runs of one command).
_NOISE = re.compile(r"0x[0-9a-fA-F]+|[0-9a-f]{7,}|\d+(?:\.\d+)?|\s+")
# Outputs shorter than this are not worth a pointer.
_DEDUP_MIN_CHARS = 200


@dataclass
class Shape:
    """What each step is to the strategy: which steps are preserved, which action each
    observation answers."""

    protected: set[int] = field(default_factory=set)
    # Preserved and never cut at all: the instruction and the final answer.
    whole: set[int] = field(default_factory=set)
    owner: dict[int, int] = field(default_factory=dict)  # observation -> its action
    results: dict[int, list[int]] = field(default_factory=dict)  # action -> observations


def shape(
    trace: Trace, policy: CompressionConfig, extra: Iterable[int] = (), links: Links | None = None
) -> Shape:
    steps = trace.steps
    links = links or Links.of(steps)
    found = Shape(protected=set(extra), owner=links.owner, results=links.results)
    preserve = set(policy.preserve_fields)
    # Invariants, whatever preserve_fields says: the first user message (the task,
    # which is never cut, or else the first user step) and the final answer.
    if "user_instruction" in preserve or not trace.task:
        found.whole.update(_first_user(steps))
    found.whole.update(answer(steps))
    if "system_prompt" not in policy.drop_fields:
        found.whole.update(i for i, s in enumerate(steps) if is_system(s))
    if "final_action" in preserve and not answer(steps):
        # The run ends on a call: keep it and its result (which may be cut like any).
        actions = [i for i, s in enumerate(steps) if s.type is StepType.ACTION]
        if actions:
            found.protected.update([actions[-1], *found.results.get(actions[-1], [])])
    if "reward_signal" in preserve:
        found.protected.update(_verdict(steps))
    if "error_context" in preserve:
        found.protected.update(_error_context(steps, found))
    found.protected |= found.whole
    return found


def key_decision_extract(
    ledger: Ledger, policy: CompressionConfig, budget: Budget, extra: Iterable[int] = ()
) -> None:
    """Cut `ledger` toward `budget.aim` in the order the module docstring gives."""
    found = shape(ledger.trace, policy, extra, ledger.links)
    passes = _passes(policy, found)
    while True:
        for run in passes:
            if ledger.total <= budget.aim:
                break
            run(ledger, budget)
        # Long steps were estimated low; once counted, the total may be over again.
        if not ledger.settle() or ledger.total <= budget.aim:
            return


_Pass = Callable[[Ledger, Budget], None]


def _passes(policy: CompressionConfig, found: Shape) -> list[_Pass]:
    drop = set(policy.drop_fields)
    protected = found.protected

    def outputs(kind: str, keep: int, types: set[StepType], preserved: bool) -> _Pass:
        def run(ledger: Ledger, budget: Budget) -> None:
            picked = [
                i
                for i, s in enumerate(ledger.steps)
                if s is not None
                and s.type in types
                and (i in protected) == preserved
                and not is_system(s)
                and i not in found.whole
            ]
            _trim_largest(ledger, picked, keep, kind, budget)

        return run

    passes: list[_Pass] = []
    if "repeated_observations" in drop and policy.dedup_window > 0:
        passes.append(lambda ledger, budget: _dedup(ledger, protected, policy.dedup_window, budget))
    observation = {StepType.OBSERVATION}
    if "redundant_tool_outputs" in drop:
        passes.append(outputs("redundant_tool_outputs", SOFT_KEEP, observation, preserved=False))
    if "intermediate_thoughts" in drop:
        passes.append(lambda ledger, budget: _drop_thoughts(ledger, protected, budget))
    if "redundant_tool_outputs" in drop:
        passes.append(outputs("redundant_tool_outputs", TIGHT_KEEP, observation, preserved=False))
    passes.append(
        outputs("long_messages", TIGHT_KEEP, {StepType.MESSAGE, StepType.THOUGHT}, preserved=False)
    )
    passes.append(
        outputs(
            "long_preserved_outputs",
            PRESERVED_KEEP,
            {StepType.OBSERVATION, StepType.THOUGHT},
            preserved=True,
        )
    )
    passes.append(lambda ledger, budget: _drop_exploration(ledger, found, budget))
    if "system_prompt" in drop:
        passes.append(lambda ledger, budget: _trim_system(ledger, budget))
    return passes


def _dedup(ledger: Ledger, protected: set[int], window: int, budget: Budget) -> None:
    recent: list[_Output] = []
    for i, step in enumerate(ledger.steps):
        if step is None or step.type is not StepType.OBSERVATION or not step.content:
            continue
        if len(step.content) < _DEDUP_MIN_CHARS:
            continue
        recent = [seen for seen in recent if i - seen.index <= window]
        output = _Output(i, step.content)
        match = next((seen for seen in reversed(recent) if seen.same_as(output)), None)
        recent.append(output)
        if match is None or i in protected:
            continue
        # Point at the copy that is still whole, not at another pointer.
        output.origin = match.origin
        how = "identical" if match.text == output.text else "nearly identical (numbers differ)"
        marker = f"[output {how} to the output of step {match.origin} of the original trace]"
        ledger.replace_content(i, marker, "repeated_observations", budget)
        if ledger.total <= budget.aim:
            return


class _Output:
    """An observation's text, with its masked form computed only when compared."""

    def __init__(self, index: int, text: str):
        self.index = index
        self.origin = index  # the step holding this text in full
        self.text = text
        self._masked: str | None = None

    def masked(self) -> str:
        if self._masked is None:
            self._masked = _NOISE.sub(" ", self.text)
        return self._masked

    def same_as(self, other: _Output) -> bool:
        if self.text == other.text:
            return True
        # Masking only changes numbers and spacing, so lengths stay close.
        if abs(len(self.text) - len(other.text)) > 0.2 * len(self.text):
            return False
        return self.masked() == other.masked()


def _trim_largest(ledger: Ledger, picked: list[int], keep: int, kind: str, budget: Budget) -> None:
    for i in sorted(picked, key=lambda i: ledger.tokens[i], reverse=True):
        if ledger.total <= budget.aim or ledger.tokens[i] <= keep:
            return
        ledger.trim(i, keep, kind, budget)


def _drop_thoughts(ledger: Ledger, protected: set[int], budget: Budget) -> None:
    for i, step in enumerate(ledger.steps):
        if ledger.total <= budget.aim:
            return
        if step is not None and step.type is StepType.THOUGHT and i not in protected:
            ledger.drop(i, "intermediate_thoughts", budget)


def _drop_exploration(ledger: Ledger, found: Shape, budget: Budget) -> None:
    """Actions with their results, then thoughts, messages (a question with its answer)
    and outputs no action asked for; whatever is preserved stays, with what it needs."""
    for i, step in enumerate(ledger.steps):
        if ledger.total <= budget.aim:
            return
        if step is None or i in found.protected or is_system(step) or i in found.owner:
            continue
        group = ledger.together(i)
        if not found.protected.intersection(group):
            ledger.drop_group(group, "exploration_steps", budget)


def _trim_system(ledger: Ledger, budget: Budget) -> None:
    picked = [i for i, s in enumerate(ledger.steps) if s is not None and is_system(s)]
    _trim_largest(ledger, picked, SYSTEM_KEEP, "system_prompt", budget)


# --- what is preserved -------------------------------------------------------------


def _first_user(steps: list[Step]) -> list[int]:
    for i, step in enumerate(steps):
        if step.type is StepType.MESSAGE and step.role == "user":
            return [i]
    return []


def _verdict(steps: list[Step]) -> list[int]:
    """A user or environment message after the agent's last step: the grader's word."""
    agent = [
        i
        for i, s in enumerate(steps)
        if s.type in (StepType.ACTION, StepType.FINAL, StepType.THOUGHT)
    ]
    start = agent[-1] + 1 if agent else len(steps)
    return [
        i
        for i in range(start, len(steps))
        if steps[i].type is StepType.MESSAGE and steps[i].role not in ("assistant", "system")
    ]


def _error_context(steps: list[Step], found: Shape) -> list[int]:
    kept: list[int] = []
    for i, step in enumerate(steps):
        if not is_error(step):
            continue
        kept.append(i)
        if i in found.owner:
            kept.append(found.owner[i])
        reaction = next(
            (j for j in range(i + 1, len(steps)) if steps[j].type is not StepType.OBSERVATION), None
        )
        if reaction is not None:
            kept.append(reaction)
    return kept
