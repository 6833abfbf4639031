"""Invalid-trace filters: `environment.invalid_trace_filters`, compiled once at start-up by
`Filters.from_config`, applied to a canonical trace by `find_reject_reasons`.

A trace that any filter matches is stored as rejected, with one reason per matching
filter: its first hit in step order (enough to act on, and stats count traces, not hits).
Filters read only the canonical step list, so every input format is judged alike.

What counts as an agent turn: the steps the agent wrote (thoughts, actions, final
answers and assistant messages) between two steps it did not (observations, user or
system messages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from typing_extensions import TypedDict  # pydantic needs this one on 3.11 (app/api/schemas.py)

from app.domain import StepType, Trace
from app.evaluation.params import BuiltIn, Param, config_error, read_params, show, unknown_name

__all__ = ["Filter", "Filters", "RejectReason", "find_reject_reasons"]

# Enum member lookup is a class attribute lookup each time, and the filters test a type
# per step, so the hot loops read these module-level aliases instead.
_ACTION, _OBSERVATION, _THOUGHT, _MESSAGE = (
    StepType.ACTION,
    StepType.OBSERVATION,
    StepType.THOUGHT,
    StepType.MESSAGE,
)

# Near-duplicate thoughts are looked for among this many recent distinct thoughts, so
# the cost per thought stays bounded however long the trace.
SIMILARITY_WINDOW = 32


class RejectReason(TypedDict):
    """One entry of `reject_reasons`; `step_index` is None when no one step is at fault."""

    filter: str
    detail: str
    step_index: int | None


class _Hit(NamedTuple):
    detail: str
    step_index: int | None


# A filter's test: its first hit in the trace, or None when the trace passes it.
Check = Callable[[Trace], _Hit | None]


@dataclass(frozen=True, slots=True)
class Filter:
    name: str
    check: Check


@dataclass(frozen=True, slots=True)
class Filters:
    filters: tuple[Filter, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.filters)

    @classmethod
    def from_config(
        cls, raw: list[str] | Mapping[str, Mapping[str, Any]], *, file: str = "config.json"
    ) -> Filters:
        """Compiles `environment.invalid_trace_filters`, a list of names or a mapping of
        name -> parameters; raises ConfigError with one line naming the filter and the fix."""
        prefix = f"{file}: environment.invalid_trace_filters"
        return cls(
            tuple(
                _compile_filter(f"{prefix}.{n}", n, params) for n, params in _entries(prefix, raw)
            )
        )


def find_reject_reasons(trace: Trace, filters: Filters) -> list[RejectReason]:
    """Why the trace is invalid, one reason per matching filter; [] = it passes."""
    reasons: list[RejectReason] = []
    for f in filters.filters:
        hit = f.check(trace)
        if hit is not None:
            reasons.append({"filter": f.name, "detail": hit.detail, "step_index": hit.step_index})
    return reasons


# --- the filters ----------------------------------------------------------------------


def _repeated_thought(trace: Trace, max_repeats: int, similarity: float | None) -> _Hit | None:
    """The first thought seen for the `max_repeats`-th time, compared after folding case
    and whitespace, and with `similarity` also counting near-duplicates."""
    counts: dict[str, int] = {}
    recent: list[tuple[frozenset[str], str]] = []
    for index, step in enumerate(trace.steps):
        if step.type is not _THOUGHT or not step.content:
            continue
        text = " ".join(step.content.split()).casefold()
        if not text:
            continue  # an empty thought says nothing; empty turns are empty_action's
        if similarity is not None and text not in counts:
            text = _near_duplicate_of(text, recent, similarity)
        counts[text] = count = counts.get(text, 0) + 1
        if count == max_repeats:
            near = "" if similarity is None else f", near-duplicates at similarity {similarity}"
            return _Hit(
                f"thought repeated {count} times (max_repeats {max_repeats}{near}): "
                f"{_snippet(text)}",
                index,
            )
    return None


def _near_duplicate_of(
    text: str, recent: list[tuple[frozenset[str], str]], threshold: float
) -> str:
    """The earlier thought (among the last SIMILARITY_WINDOW distinct ones) whose word set
    has a Jaccard index >= threshold with this one's, else the thought itself."""
    words = frozenset(text.split())
    for other_words, other in reversed(recent):
        if _jaccard_at_least(words, other_words, threshold):
            return other
    recent.append((words, text))
    if len(recent) > SIMILARITY_WINDOW:
        del recent[0]
    return text


def _jaccard_at_least(a: frozenset[str], b: frozenset[str], threshold: float) -> bool:
    small, large = sorted((len(a), len(b)))
    # |a & b| / |a | b| <= small / large: most unlike pairs stop here, without a set op.
    if small < threshold * large:
        return False
    return len(a & b) >= threshold * len(a | b)


def _empty_action(trace: Trace) -> _Hit | None:
    """An action without a tool name, an agent turn with neither text nor a tool call,
    or a trace in which the agent did nothing at all."""
    if not trace.steps:
        return _Hit("the trace has no steps", None)
    empty_turn: int | None = None  # first step of the current turn while it has no content
    in_turn = seen_agent = False
    for index, step in enumerate(trace.steps):
        kind = step.type
        if kind is _OBSERVATION or (kind is _MESSAGE and step.role != "assistant"):
            if empty_turn is not None:
                break  # the turn is over, and it said nothing
            in_turn = False
            continue
        if kind is _ACTION and (not step.tool or step.tool.isspace()):
            return _Hit("action without a tool name", index)
        if not in_turn:
            in_turn = seen_agent = True
            empty_turn = index
        if empty_turn is not None and (kind is _ACTION or _has_text(step.content)):
            empty_turn = None
    if empty_turn is not None:
        return _Hit("agent turn with neither content nor a tool call", empty_turn)
    if not seen_agent:
        return _Hit("the trace has no step by the agent", None)
    return None


def _tool_error_streak(trace: Trace, max_streak: int) -> _Hit | None:
    """`max_streak` observations in a row with `error` set; steps of other types between
    them do not break the streak, a successful observation does. A non-zero exit code
    alone is not an error: a failing test run is a normal step."""
    streak = 0
    for index, step in enumerate(trace.steps):
        if step.type is not _OBSERVATION:
            continue
        streak = streak + 1 if step.error else 0
        if streak == max_streak:
            return _Hit(
                f"{streak} tool errors in a row (max_streak {max_streak}), the last: "
                f"{_snippet(step.error or '')}",
                index,
            )
    return None


def _has_text(content: str | None) -> bool:
    return bool(content and not content.isspace())


def _snippet(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


_BUILT_INS: dict[str, BuiltIn[Check]] = {
    "repeated_thought": BuiltIn(
        lambda p: partial(
            _repeated_thought, max_repeats=p["max_repeats"], similarity=p["similarity"]
        ),
        {
            "max_repeats": Param(int, 3, minimum=2),
            # Off by default: exact repeats (after normalising) are unambiguous.
            "similarity": Param(float, None, minimum=0.5, maximum=1.0, nullable=True),
        },
    ),
    "empty_action": BuiltIn(lambda _: _empty_action),
    "tool_error_streak": BuiltIn(
        lambda p: partial(_tool_error_streak, max_streak=p["max_streak"]),
        {"max_streak": Param(int, 3, minimum=1)},
    ),
}


# --- compiling the config -------------------------------------------------------------


def _entries(
    prefix: str, raw: list[str] | Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, parameters) pairs from either config form."""
    if isinstance(raw, Mapping):
        for name, params in raw.items():
            if not isinstance(params, Mapping):
                raise config_error(
                    f"{prefix}.{name}", f"expected an object of parameters, got {show(params)}"
                )
        return [(str(name), params) for name, params in raw.items()]
    if isinstance(raw, list):
        for index, name in enumerate(raw):
            if not isinstance(name, str):
                raise config_error(
                    f"{prefix}[{index}]", f"expected a filter name, got {show(name)}"
                )
            if name in raw[:index]:
                raise config_error(f"{prefix}[{index}]", f"{name} is listed twice; list it once")
        return [(name, {}) for name in raw]
    raise config_error(
        prefix,
        f"expected a list of filter names or an object of name -> parameters, got {show(raw)}",
    )


def _compile_filter(where: str, name: str, params: Mapping[str, Any]) -> Filter:
    built_in = _BUILT_INS.get(name)
    if built_in is None:
        raise unknown_name(where, name, "filter", _BUILT_INS, "built-in filters")
    return Filter(name, built_in.make(read_params(where, params, built_in.params)))
