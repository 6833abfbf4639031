"""summarize_middle: Hermes Agent's trajectory_compressor, on canonical steps.

Steps are grouped into turns the way Hermes' conversations have them: system, human
(user messages), gpt (thoughts, actions, final answers, assistant messages) and tool
(observations). The head (the first turn of each of those four roles) and the last
`protect_last_n_turns` turns are kept. From the first turn after the head, turns are
taken until replacing them with one summary saves enough to reach the target, and they
become one user message starting "[CONTEXT SUMMARY]:". As in Hermes' newer version
(`_snap_boundary`), a region boundary never falls between a gpt turn and the tool
turn that answers it: it moves forward past the tool turn, or back before the call.
Beyond Hermes, the summary (a user turn) never meets another user turn and never
separates a question from its answer (Ledger.can_replace): the end moves the same
way, then the start moves forward, until the span keeps the conversation valid.

Hermes also appends a notice to the system turn; it is left out here, so the system
prompt of a compressed trace stays the one the agent ran with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.compression.ledger import Budget, Ledger, speaker, step_parts
from app.config import CompressionConfig, TinkerConfig
from app.domain import Step, StepType
from app.llm import LLMError, chat

if TYPE_CHECKING:
    import httpx

PREFIX = "[CONTEXT SUMMARY]:"
# Hermes sends each turn whole up to this size, else its head and tail.
_TURN_CHARS, _TURN_HEAD, _TURN_TAIL = 3000, 1500, 500
_PROMPT = """Summarize the following agent conversation turns concisely. This summary will replace these turns in the conversation history.

Write the summary from a neutral perspective describing what the assistant did and learned. Include:
1. What actions the assistant took (tool calls, searches, file operations)
2. Key information or results obtained
3. Any important decisions or findings
4. Relevant data, file names, values, or outputs

Keep the summary factual and informative. Target approximately {tokens} tokens.

---
TURNS TO SUMMARIZE:
{turns}
---

Write only the summary, starting with "[CONTEXT SUMMARY]:" prefix."""


class Summarizer(Protocol):
    """Writes the summary for a prompt; raises app.llm.LLMError when it cannot."""

    async def __call__(self, prompt: str, *, max_tokens: int) -> str: ...


class ModelSummarizer:
    """A Summarizer backed by the model endpoint tinker.json names (through app.llm)."""

    def __init__(
        self, client: httpx.AsyncClient, tinker: TinkerConfig, *, temperature: float = 0.3
    ):
        self.client = client
        self.tinker = tinker
        self.temperature = temperature

    @property
    def url(self) -> str:
        return self.tinker.base_url

    async def __call__(self, prompt: str, *, max_tokens: int) -> str:
        messages = [{"role": "user", "content": prompt}]
        result = await chat(
            self.client, self.tinker, messages, max_tokens=max_tokens, temperature=self.temperature
        )
        return result.text


@dataclass(frozen=True)
class _Turn:
    role: str  # system | human | gpt | tool
    start: int  # step indices [start, end)
    end: int


class SummaryRefused(LLMError):
    """The model answered, but with no summary to use: an empty one, or one that makes
    the trace no shorter. A model failure like any other (retried, then
    compression_failed or key_decision_extract by compression.on_model_failure)."""


async def summarize_middle(
    ledger: Ledger, policy: CompressionConfig, budget: Budget, summarizer: Summarizer | None
) -> Ledger | str:
    """The ledger with one middle span summarized; or why there is nothing to
    summarize (the caller then falls back to key_decision_extract). Raises LLMError
    when the model fails or its summary cannot be used: whether to retry or fall back
    is the caller's."""
    if summarizer is None:
        return "no summarizer: summarize_middle needs the model endpoint from tinker.json"
    steps = ledger.trace.steps
    turns = _turns(steps)
    span = _span(turns, ledger, ledger.total - budget.aim + policy.summary_target_tokens, policy)
    if span is None:
        return "nothing to summarize between the protected head and tail turns"
    start, end = span
    prompt = _PROMPT.format(
        tokens=policy.summary_target_tokens, turns=_render(steps, turns, start, end)
    )
    text = (await summarizer(prompt, max_tokens=2 * policy.summary_target_tokens)).strip()
    url = getattr(summarizer, "url", "")
    if not text or text == PREFIX:
        raise SummaryRefused("the summary model returned an empty summary", url=url)
    if not text.startswith(PREFIX):
        text = f"{PREFIX} {text}"
    summary = Step(type=StepType.MESSAGE, role="user", content=text)
    summarized = ledger.with_span_replaced(start, end, summary, "summarized_steps")
    if summarized.total >= ledger.total:
        raise SummaryRefused(
            f"the summary model's summary ({len(text)} characters) makes the trace no "
            f"shorter ({ledger.total} -> {summarized.total} tokens)", url=url,
        )
    if summarized.total < budget.floor:
        return (
            f"the summary left {summarized.total} tokens, under min_tokens_after "
            f"{policy.min_tokens_after}"
        )
    return summarized


# Hermes' names for who speaks a turn.
_HERMES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def _role(step: Step) -> str:
    return _HERMES[speaker(step)]


def _turns(steps: list[Step]) -> list[_Turn]:
    turns: list[_Turn] = []
    for i, step in enumerate(steps):
        role = _role(step)
        if turns and turns[-1].role == role:
            turns[-1] = _Turn(role, turns[-1].start, i + 1)
        else:
            turns.append(_Turn(role, i, i + 1))
    return turns


def _span(
    turns: list[_Turn], ledger: Ledger, need: int, policy: CompressionConfig
) -> tuple[int, int] | None:
    """Step indices [start, end) of the fewest middle turns that save `need` tokens
    (all of the middle when it saves less), on boundaries that keep the conversation
    valid."""
    n = len(turns)
    firsts = {
        next((t for t, turn in enumerate(turns) if turn.role == role), None)
        for role in ("system", "human", "gpt", "tool")
    }
    last = set(range(max(n - policy.protect_last_n_turns, 0), n))
    protected = {t for t in firsts | last if t is not None}
    head = [t for t in protected if t < n // 2]
    tail = [t for t in protected if t >= n // 2]
    lo, hi = (max(head) + 1 if head else 0), (min(tail) if tail else n)
    closes = [t for t in range(lo + 1, hi + 1) if ledger.closes_span(turns[t - 1].end)]
    for start in range(lo, hi):
        if not ledger.opens_span(turns[start].start):
            continue
        taken, end = 0, start
        while end < hi and taken < need:
            turn = turns[end]
            taken += sum(ledger.tokens[turn.start : turn.end])
            end += 1
        # The nearest valid end: forward first (a call's results go with it), then back.
        ahead = [t for t in closes if t >= end]
        behind = [t for t in closes if start < t < end]
        for stop in ahead[:1] or behind[-1:]:
            return turns[start].start, turns[stop - 1].end
    return None


def _render(steps: list[Step], turns: list[_Turn], start: int, end: int) -> str:
    """The turns in [start, end) as Hermes feeds them to the summarizer."""
    blocks = []
    for t, turn in enumerate(turns):
        if turn.start < start or turn.end > end:
            continue
        value = "\n".join("\n".join(step_parts(s)) for s in steps[turn.start : turn.end])
        if len(value) > _TURN_CHARS:
            value = f"{value[:_TURN_HEAD]}\n...[truncated]...\n{value[-_TURN_TAIL:]}"
        blocks.append(f"[Turn {t} - {turn.role.upper()}]:\n{value}")
    return "\n\n".join(blocks)
