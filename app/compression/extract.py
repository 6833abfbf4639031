"""key_decision_extract: deterministic, no model calls.

What the model saw and did stays: every tool call with its result, every user turn,
the system prompt, the task and the final answer are never removed or altered. What
may shrink is what the agent can do without: tool outputs (cut, with an explicit
marker, never removed) and thoughts (dropped, the last one before the final answer
kept). Preserved, by preserve_fields: `final_action` (the last call's result, when the
run ends without an answer), `reward_signal` (a user or environment message after the
agent's last step), `error_context` (every tool error with the thought that reacted to
it). Preserved steps are never removed; a preserved output is cut last.

Every cut of an output keeps its head and tail and every line holding a fact
(app.compression.facts) that a later assistant turn states and no earlier turn holds
(the first holder keeps it for all the turns after it); the rest becomes
"[… N tokens of output elided …]".

The passes, least loss first; each stops the moment the total reaches the target, so
a pass only runs when the ones before were not enough. 1-4 run only if drop_fields
lists them:

1. repeated_observations  a call repeated exactly (same tool, arguments and result)
                          within the next `dedup_window` calls collapses into the
                          first, whose result says how many more times it came;
                          then an output equal to one of the last `dedup_window`
                          outputs becomes a one-line reference to the step that
                          showed it.
2. redundant_tool_outputs long outputs, largest first, cut to head and tail (384
                          tokens) and the fact lines.
3. intermediate_thoughts  thoughts that neither react to an error nor come last, oldest
                          first: the calls still show what was done.
4. redundant_tool_outputs again, tighter (64 tokens).
5. long_preserved_outputs preserved outputs (the errors, the final result) cut to head
                          and tail (256 tokens): an error's message sits at one end.

When that is not enough, the trace stays over its target and its compression record
says the ratio it reached. Trims are sized to land on the target rather than under
it; nothing takes the trace under min_tokens_after.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from app.compression.facts import TOKEN, Wanted, candidates, facts, step_text
from app.compression.ledger import Budget, Ledger, Links, answer, is_error, speaker
from app.config import CompressionConfig
from app.domain import Step, StepType, Trace

SOFT_KEEP = 384
TIGHT_KEEP = 24
PRESERVED_KEEP = 256

# Outputs shorter than this are not worth a reference.
_DEDUP_MIN_CHARS = 200
# Kinds of the record (removed, removed_steps): the repeats dropped, and the first
# call's result that now says how many times it came.
COLLAPSED = "repeated_calls"
COUNTED = "repeat_counts"
REFERENCED = "repeated_observations"


@dataclass
class Shape:
    """What each step is to the strategy: which steps are preserved, which action each
    observation answers, and which facts later turns state."""

    protected: set[int] = field(default_factory=set)
    # Preserved and never cut at all: system prompts, user turns, the final answer.
    whole: set[int] = field(default_factory=set)
    owner: dict[int, int] = field(default_factory=dict)  # observation -> its action
    results: dict[int, list[int]] = field(default_factory=dict)  # action -> observations
    # fact -> the last assistant step stating it; fact -> the first step that is not
    # the assistant's holding it (the task: -1), which alone needs to keep it.
    last_use: dict[str, int] = field(default_factory=dict)
    keeper: dict[str, int] = field(default_factory=dict)
    # needed(), by step: made from keeper and last_use at the first call.
    _needed: dict[int, Wanted] | None = field(default=None, repr=False)

    def needed(self, i: int) -> Wanted:
        """The facts in step i's output that must stay: a later assistant turn states
        them, and step i is the first to hold them (an earlier holder keeps them: the
        task, a system prompt or user turn, which never change, or an output that
        keeps them as step i would)."""
        if self._needed is None:
            by_step: dict[int, set[str]] = {}
            last_use = self.last_use
            for fact, holder in self.keeper.items():
                if last_use.get(fact, -1) > holder:
                    by_step.setdefault(holder, set()).add(fact)
            self._needed = {step: Wanted(held) for step, held in by_step.items()}
        return self._needed.get(i, _NOTHING)


_NOTHING = Wanted()


def shape(trace: Trace, policy: CompressionConfig, links: Links | None = None) -> Shape:
    steps = trace.steps
    links = links or Links.of(steps)
    found = Shape(owner=links.owner, results=links.results)
    preserve = set(policy.preserve_fields)
    found.whole.update(answer(steps))
    found.whole.update(i for i, s in enumerate(steps) if _unchangeable(s))
    thoughts = [i for i, s in enumerate(steps) if s.type is StepType.THOUGHT]
    if thoughts:
        # The reasoning that led to the answer (or to the last call).
        found.protected.add(thoughts[-1])
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
    last_use = found.last_use
    for i, step in enumerate(steps):
        if speaker(step) == "assistant":
            last_use.update(dict.fromkeys(facts(step_text(step), parts=False), i))
    # Only what an assistant turn states needs a keeper: the first text other than the
    # assistant's holding it. Each text's tokens are read once, in order, and each
    # distinct token is looked at where it first comes.
    stated = found.last_use
    others = [(-1, trace.task or ""), *((i, step_text(s)) for i, s in enumerate(steps)
                                        if speaker(s) != "assistant")]
    seen: set[str] = set()
    for i, text in others:
        new = set(TOKEN.findall(text)) - seen
        seen |= new
        for fact in {part for token in new for part in candidates(token)} & stated.keys():
            found.keeper.setdefault(fact, i)
    return found


def _unchangeable(step: Step) -> bool:
    """A system prompt or a user turn (the user's, the environment's, a grader's)."""
    return step.type is StepType.MESSAGE and speaker(step) in ("system", "user")


def key_decision_extract(ledger: Ledger, policy: CompressionConfig, budget: Budget) -> None:
    """Cut `ledger` toward `budget.aim` in the order the module docstring gives."""
    found = shape(ledger.trace, policy, ledger.links)
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

    def outputs(kind: str, keep: int, preserved: bool) -> _Pass:
        def run(ledger: Ledger, budget: Budget) -> None:
            picked = [
                i
                for i, s in enumerate(ledger.steps)
                if s is not None
                and s.type is StepType.OBSERVATION
                and (i in protected) == preserved
                and i not in found.whole
            ]
            _trim_largest(ledger, picked, keep, kind, budget, found)

        return run

    passes: list[_Pass] = []
    window = policy.dedup_window
    if "repeated_observations" in drop and window > 0:
        passes.append(lambda ledger, budget: _collapse_repeats(ledger, found, window, budget))
        passes.append(lambda ledger, budget: _dedup(ledger, protected, window, budget))
    if "redundant_tool_outputs" in drop:
        passes.append(outputs("redundant_tool_outputs", SOFT_KEEP, preserved=False))
    if "intermediate_thoughts" in drop:
        passes.append(lambda ledger, budget: _drop_thoughts(ledger, protected, budget))
    if "redundant_tool_outputs" in drop:
        passes.append(outputs("redundant_tool_outputs", TIGHT_KEEP, preserved=False))
    passes.append(outputs("long_preserved_outputs", PRESERVED_KEEP, preserved=True))
    return passes


def _collapse_repeats(ledger: Ledger, found: Shape, window: int, budget: Budget) -> None:
    """A call made again with the same arguments and the same result, within `window`
    calls of the first, goes; the first's result says how many more times it came."""
    steps = ledger.trace.steps
    actions = [i for i, s in enumerate(steps) if s.type is StepType.ACTION]
    first_of: dict[int, int] = {}  # a repeat -> the first call of its run
    repeats: dict[int, list[int]] = {}  # the first call -> its repeats dropped
    keys: dict[int, tuple[object, ...] | None] = {}  # each call's, made once
    arguments: dict[int, str] = {}  # each call's, made once and only when compared

    def key_of(i: int) -> tuple[object, ...] | None:
        if i not in keys:
            keys[i] = _call_key(steps, i, found)
        return keys[i]

    def arguments_of(i: int) -> str:
        if i not in arguments:
            arguments[i] = json.dumps(steps[i].arguments, sort_keys=True)
        return arguments[i]

    for n, i in enumerate(actions):
        key = key_of(i)
        if key is None or i in found.protected:
            continue
        for j in reversed(actions[max(0, n - window):n]):
            if key_of(j) == key and arguments_of(j) == arguments_of(i):
                first = first_of.get(j, j)
                if ledger.drop_group(ledger.together(i), COLLAPSED, budget):
                    first_of[i] = first
                    repeats.setdefault(first, []).append(i)
                break
        if ledger.total <= budget.aim:
            break
    for first, dropped in repeats.items():
        result = found.results[first][-1]
        step = ledger.steps[result]
        if step is None:
            continue
        times = "once more" if len(dropped) == 1 else f"{len(dropped)} more times"
        at = ", ".join(str(k) for k in dropped)
        note = (f"\n[… the same call, with the same result, was made {times} "
                f"(step{'s' if len(dropped) > 1 else ''} {at} of the original trace) …]")
        ledger.annotate(result, note, COUNTED)


def _call_key(steps: list[Step], i: int, found: Shape) -> tuple[object, ...] | None:
    """What makes two calls the same but their arguments (compared apart, as JSON, only
    when all else is): tool, text and every result, whole."""
    results = found.results.get(i)
    if not results:
        return None
    step = steps[i]
    said = [(r, steps[r]) for r in results]
    if any(r in found.protected for r, _ in said):
        return None
    return (step.tool, step.content, *((s.content, s.error, s.exit_code) for _, s in said))


def _dedup(ledger: Ledger, protected: set[int], window: int, budget: Budget) -> None:
    """An output equal to one of the last `window` outputs becomes a reference to the
    step that showed it whole."""
    recent: list[tuple[str, int]] = []  # (text, the step holding it whole)
    for i, step in enumerate(ledger.steps):
        if step is None or step.type is not StepType.OBSERVATION or not step.content:
            continue
        text = ledger.trace.steps[i].content or ""
        origin = next((at for seen, at in reversed(recent) if seen == text), None)
        recent = [*recent, (text, i if origin is None else origin)][-window:]
        if origin is None or i in protected or len(text) < _DEDUP_MIN_CHARS:
            continue
        marker = f"[output identical to the output of step {origin} of the original trace]"
        ledger.replace_content(i, marker, REFERENCED, budget)
        if ledger.total <= budget.aim:
            return


def _trim_largest(
    ledger: Ledger, picked: list[int], keep: int, kind: str, budget: Budget, found: Shape
) -> None:
    for i in sorted(picked, key=lambda i: ledger.tokens[i], reverse=True):
        if ledger.total <= budget.aim or ledger.tokens[i] <= keep:
            return
        ledger.trim(i, keep, kind, budget, found.needed(i))


def _drop_thoughts(ledger: Ledger, protected: set[int], budget: Budget) -> None:
    for i, step in enumerate(ledger.steps):
        if ledger.total <= budget.aim:
            return
        if step is not None and step.type is StepType.THOUGHT and i not in protected:
            ledger.drop(i, "intermediate_thoughts", budget)


# --- what is preserved -------------------------------------------------------------


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
