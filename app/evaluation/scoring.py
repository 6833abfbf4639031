"""Reward rules: `environment.reward_rules`, compiled once at start-up by
`RewardRules.from_config`, applied to a canonical trace by `score`.

reward = the sum, over the rules that fired, of their points; a per-occurrence rule gives
points x count, the count capped by `max_count`; plus `environment.env_reward.weight` x the
environment's own reward when the trace carries one (`outcome.reward`), on its own
breakdown line `env_reward`. Rules read only the canonical trace, so a trace scores the
same whatever format it arrived in.

Custom rules match text with RE2 patterns (the google-re2 package), not Python's `re`:
RE2 never backtracks and runs in time linear in its input, whereas `re` needs minutes
for an innocent-looking `.*a.*x` on 8 KB of one repeated character, and agents do write
such output. Patterns are also applied to at most the first and the last `MATCH_WINDOW`
characters of a text, so one custom rule costs a bounded time per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import orjson
import re2  # type: ignore[import-untyped,import-not-found,unused-ignore]
from typing_extensions import TypedDict  # pydantic needs this one on 3.11 (app/api/schemas.py)

from app.domain import Status, Step, StepType, Trace
from app.evaluation.params import BuiltIn, Param, config_error, read_params, show, unknown_name

__all__ = ["ENV_REWARD", "MATCH_WINDOW", "RewardRules", "Rule", "RuleResult", "Score", "score"]

# Enum member lookup is a class attribute lookup each time, and the rules test a type
# per step, so the hot loops read these module-level aliases instead.
_ACTION, _OBSERVATION, _THOUGHT, _FINAL = (
    StepType.ACTION,
    StepType.OBSERVATION,
    StepType.THOUGHT,
    StepType.FINAL,
)

# Characters of a text's head and of its tail that a pattern sees; a test summary or a
# traceback sits at one end, and the middle of a 100 KB log is not worth the time.
MATCH_WINDOW = 8192
# The breakdown line of the environment's reward (environment.env_reward, not a rule).
ENV_REWARD = "env_reward"
DEFAULT_ENV_REWARD_WEIGHT = 20.0


class RuleResult(TypedDict):
    """One line of `reward_breakdown`: whether the rule fired, how many times it matched
    (before `max_count`), and the points it added to the reward."""

    fired: bool
    count: int
    points: float


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    breakdown: dict[str, RuleResult]


class _View:
    """What several rules read from one trace, worked out at most once per `score` call."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    @cached_property
    def exchanges(self) -> list[_Exchange]:
        return _pair_exchanges(self.trace.steps)

    @cached_property
    def final(self) -> str | None:
        for step in reversed(self.trace.steps):
            if step.type is _FINAL:
                return step.content or ""
        return None


# How many times a rule matches a trace; 0 = it did not fire.
Occurrences = Callable[[_View], int]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    points: float
    per_occurrence: bool
    max_count: int | None
    count: Occurrences

    def points_for(self, count: int) -> float:
        if count == 0:
            return 0.0
        if not self.per_occurrence:
            return self.points
        return self.points * (count if self.max_count is None else min(count, self.max_count))


@dataclass(frozen=True, slots=True)
class RewardRules:
    rules: tuple[Rule, ...] = ()
    # Points per unit of the environment's reward (environment.env_reward.weight).
    env_reward_weight: float = DEFAULT_ENV_REWARD_WEIGHT

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rule.name for rule in self.rules)

    @classmethod
    def from_config(
        cls,
        raw: Mapping[str, Any],
        *,
        env_reward_weight: float = DEFAULT_ENV_REWARD_WEIGHT,
        file: str = "config.json",
    ) -> RewardRules:
        """Compiles `environment.reward_rules`; raises ConfigError with one line naming
        the rule and the fix."""
        prefix = f"{file}: environment.reward_rules"
        if not isinstance(raw, Mapping):
            raise config_error(
                prefix, f"expected an object of rule name -> points, got {show(raw)}"
            )
        rules = tuple(_compile_rule(prefix, str(name), spec) for name, spec in raw.items())
        return cls(rules, env_reward_weight)


def breakdown_total(breakdown: Mapping[str, RuleResult] | None) -> float | None:
    """The reward a stored breakdown adds up to: the computed reward, whatever a
    reviewer's override has put in `traces.reward` since."""
    if breakdown is None:
        return None
    return float(sum(line["points"] for line in breakdown.values()))


def score(trace: Trace, rules: RewardRules) -> Score:
    """Applies every rule to the trace, then adds the environment's weighted reward;
    the breakdown lists each configured rule, then `env_reward`."""
    view = _View(trace)
    breakdown: dict[str, RuleResult] = {}
    reward = 0.0
    for rule in rules.rules:
        count = rule.count(view)
        points = rule.points_for(count)
        breakdown[rule.name] = {"fired": count > 0, "count": count, "points": points}
        reward += points
    env_reward = trace.outcome.reward
    points = 0.0 if env_reward is None else rules.env_reward_weight * env_reward
    sent = env_reward is not None
    breakdown[ENV_REWARD] = {"fired": sent, "count": int(sent), "points": points}
    return Score(reward=reward + points, breakdown=breakdown)


# --- built-in rules -------------------------------------------------------------------


def _task_success(view: _View) -> int:
    return int(view.trace.outcome.status is Status.SUCCESS)


def _timeout(view: _View) -> int:
    return int(view.trace.outcome.status is Status.TIMEOUT)


def _code_runs_ok(view: _View) -> int:
    said = view.trace.outcome.code_runs_ok
    if said is not None:
        return int(said)
    # The trace does not say: the last command that reported an exit code decides.
    for step in reversed(view.trace.steps):
        if step.type is _OBSERVATION and step.exit_code is not None:
            return int(step.exit_code == 0)
    return 0


def _invalid_tool_calls(view: _View) -> int:
    trace = view.trace
    declared = None if trace.tools is None else frozenset(trace.tools)
    count = 0
    for step in trace.steps:
        tool = step.tool
        # An action without a tool name is empty_action's (a filter), not a call to judge.
        if step.type is not _ACTION or not tool or tool.isspace():
            continue
        if not _is_json_object(step.arguments) or (declared is not None and tool not in declared):
            count += 1
    return count


def _loops(view: _View, threshold: int) -> int:
    """Runs of `threshold` or more identical actions; thoughts and observations between
    them do not break a run, any other step does. A run counts once however long."""
    loops = run = 0
    previous: Step | None = None
    for step in view.trace.steps:
        kind = step.type
        if kind is _ACTION:
            same = (
                previous is not None
                and step.tool == previous.tool
                and _same_arguments(step.arguments, previous.arguments)
            )
            run = run + 1 if same else 1
            previous = step
            if run == threshold:
                loops += 1
        elif kind is not _THOUGHT and kind is not _OBSERVATION:
            previous, run = None, 0
    return loops


def _same_arguments(x: Any, y: Any) -> bool:
    if isinstance(x, str) or isinstance(y, str):
        return _canonical_arguments(x) == _canonical_arguments(y)
    # == on parsed JSON is exact but for true == 1 == 1.0; serialising costs more, so
    # only the rare equal pair is confirmed canonically.
    return bool(x == y) and _canonical_arguments(x) == _canonical_arguments(y)


def _is_json_object(arguments: Any) -> bool:
    # None = the call has no arguments at all, which is how tools without parameters
    # are called; a raw string is what an adapter keeps when the agent's JSON did not parse.
    if arguments is None or type(arguments) is dict:
        return True
    return isinstance(arguments, str) and isinstance(_parse_object(arguments), dict)


def _parse_object(text: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _canonical_arguments(arguments: Any) -> str:
    """Arguments as sorted compact JSON, so key order and spacing never make two calls
    differ; a string that parses as a JSON object counts as that object."""
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        parsed = _parse_object(arguments)
        if parsed is None:
            return arguments
        arguments = parsed
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()


_BUILT_INS: dict[str, BuiltIn[Occurrences]] = {
    "task_success": BuiltIn(lambda _: _task_success),
    "code_runs_ok": BuiltIn(lambda _: _code_runs_ok),
    # Each bad call is its own mistake, so this one counts per occurrence by default.
    "invalid_tool_call": BuiltIn(
        lambda _: _invalid_tool_calls, {"per_occurrence": Param(bool, True)}
    ),
    "loop_detected": BuiltIn(
        lambda p: partial(_loops, threshold=p["loop_threshold"]),
        {"loop_threshold": Param(int, 3, minimum=2)},
    ),
    "timeout": BuiltIn(lambda _: _timeout),
}

# Keys every long-form rule takes; a rule's own params may override a default.
_COMMON_PARAMS: dict[str, Param] = {
    "points": Param(float, required=True),
    "per_occurrence": Param(bool, False),
    "max_count": Param(int, minimum=1, nullable=True),
}


# --- custom rules ---------------------------------------------------------------------


class _Pattern:
    """An RE2 pattern, compiled at start-up, that sees at most the first and the last
    MATCH_WINDOW characters of a text."""

    __slots__ = ("_regex", "source")

    _OPTIONS = re2.Options()
    _OPTIONS.log_errors = False  # a bad pattern is reported once, as a ConfigError
    _OPTIONS.never_capture = True  # only "does it occur" matters, and it is faster

    def __init__(self, where: str, source: Any) -> None:
        if not isinstance(source, str) or not source:
            raise config_error(
                where, f"expected a pattern (a non-empty string), got {show(source)}"
            )
        try:
            self._regex = re2.compile(source, self._OPTIONS)
        except re2.error as exc:
            reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
            raise config_error(
                where,
                f"invalid pattern {show(source)}: {reason}; patterns use RE2 syntax "
                "(no backreferences or lookaround)",
            ) from None
        self.source = source

    def search(self, text: str) -> bool:
        if len(text) <= 2 * MATCH_WINDOW:
            return self._found(text)
        return self._found(text[:MATCH_WINDOW]) or self._found(text[-MATCH_WINDOW:])

    def _found(self, text: str) -> bool:
        # Bytes skip the wrapper's str offset bookkeeping; RE2 reads them as UTF-8 anyway.
        return self._regex.search(text.encode()) is not None


class _Exchange:
    """A tool call and the observation that answered it; either may be missing."""

    __slots__ = ("action", "observation")

    def __init__(self, action: Step | None, observation: Step | None = None) -> None:
        self.action = action
        self.observation = observation


def _pair_exchanges(steps: list[Step]) -> list[_Exchange]:
    """Pairs each observation with its action: by call_id when it has a known one, else
    with the oldest action still unanswered (parallel calls are answered in order)."""
    exchanges: list[_Exchange] = []
    by_call_id: dict[str, _Exchange] = {}
    unanswered: deque[_Exchange] = deque()
    for step in steps:
        if step.type is _ACTION:
            exchange = _Exchange(step)
            exchanges.append(exchange)
            unanswered.append(exchange)
            if step.call_id:
                by_call_id[step.call_id] = exchange
        elif step.type is _OBSERVATION:
            answered = _answered_exchange(step, by_call_id, unanswered)
            if answered is None:
                exchanges.append(_Exchange(None, step))
            else:
                answered.observation = step
    return exchanges


def _answered_exchange(
    observation: Step, by_call_id: dict[str, _Exchange], unanswered: deque[_Exchange]
) -> _Exchange | None:
    if observation.call_id:
        exchange = by_call_id.pop(observation.call_id, None)
        if exchange is not None and exchange.observation is None:
            return exchange
    while unanswered and unanswered[0].observation is not None:
        unanswered.popleft()
    return unanswered.popleft() if unanswered else None


_MISSING = object()


@dataclass(frozen=True, slots=True)
class _Matcher:
    """A custom rule's `match`: every condition given must hold. Conditions on a tool
    call (tool, arguments, observation, error, exit_code) are tested on each exchange and
    the rule matches once per matching exchange; the others are tested on the trace."""

    tools: frozenset[str] | None = None
    arguments: _Pattern | None = None
    observation: _Pattern | None = None
    error: bool | _Pattern | None = None
    exit_code: int | None = None
    final: _Pattern | None = None
    statuses: frozenset[Status] | None = None
    metadata: tuple[tuple[str, Any], ...] = ()

    def __call__(self, view: _View) -> int:
        if not self._trace_matches(view):
            return 0
        if not self._on_calls and not self._on_observations:
            return 1
        return sum(1 for exchange in view.exchanges if self._exchange_matches(exchange))

    @property
    def _on_calls(self) -> bool:
        return self.tools is not None or self.arguments is not None

    @property
    def _on_observations(self) -> bool:
        return not (self.observation is None and self.error is None and self.exit_code is None)

    def _trace_matches(self, view: _View) -> bool:
        trace = view.trace
        if self.statuses is not None and trace.outcome.status not in self.statuses:
            return False
        if self.final is not None and (view.final is None or not self.final.search(view.final)):
            return False
        return all(
            _same_json(trace.metadata.get(key, _MISSING), value) for key, value in self.metadata
        )

    def _exchange_matches(self, exchange: _Exchange) -> bool:
        action, observation = exchange.action, exchange.observation
        if self._on_calls:
            if action is None or (self.tools is not None and action.tool not in self.tools):
                return False
            if self.arguments is not None and not self.arguments.search(
                _canonical_arguments(action.arguments)
            ):
                return False
        if not self._on_observations:
            return True
        return observation is not None and self._observation_matches(observation)

    def _observation_matches(self, observation: Step) -> bool:
        # The cheap tests first: a pattern search costs microseconds, a comparison nanoseconds.
        if self.exit_code is not None and observation.exit_code != self.exit_code:
            return False
        if isinstance(self.error, bool):
            if bool(observation.error) is not self.error:
                return False
        elif self.error is not None and not (
            observation.error and self.error.search(observation.error)
        ):
            return False
        return self.observation is None or self.observation.search(observation.content or "")


def _same_json(actual: Any, expected: Any) -> bool:
    # Python says True == 1; a JSON `true` in the config must not match a metadata 1.
    return isinstance(actual, bool) is isinstance(expected, bool) and actual == expected


_MATCH_KEYS = (
    "tool",
    "arguments",
    "observation",
    "error",
    "exit_code",
    "final",
    "status",
    "metadata",
)


def _compile_match(where: str, spec: Any) -> _Matcher:
    if not isinstance(spec, dict) or not spec:
        raise config_error(
            where,
            f"expected an object with one or more of {', '.join(_MATCH_KEYS)}, got {show(spec)}",
        )
    for key in spec:
        if key not in _MATCH_KEYS:
            raise unknown_name(f"{where}.{key}", key, "match key", _MATCH_KEYS, "match keys")
    at = partial(_at, where, spec)
    return _Matcher(
        tools=at("tool", _names),
        arguments=at("arguments", _Pattern),
        observation=at("observation", _Pattern),
        error=at("error", _error_condition),
        exit_code=at("exit_code", _exit_code),
        final=at("final", _Pattern),
        statuses=at("status", _statuses),
        metadata=at("metadata", _metadata) or (),
    )


def _at(where: str, spec: dict[str, Any], key: str, read: Callable[[str, Any], Any]) -> Any:
    return read(f"{where}.{key}", spec[key]) if key in spec else None


def _names(where: str, value: Any) -> frozenset[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise config_error(
            where, f"expected a tool name or a non-empty list of tool names, got {show(value)}"
        )
    return frozenset(names)


def _statuses(where: str, value: Any) -> frozenset[Status]:
    names = [value] if isinstance(value, str) else value
    known = [status.value for status in Status]
    if not isinstance(names, list) or not names or not all(n in known for n in names):
        raise config_error(
            where, f"expected one of {', '.join(known)} or a list of them, got {show(value)}"
        )
    return frozenset(Status(name) for name in names)


def _error_condition(where: str, value: Any) -> bool | _Pattern:
    # true/false test whether the tool reported an error; a string is a pattern on it.
    return value if isinstance(value, bool) else _Pattern(where, value)


def _exit_code(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(where, f"expected an integer exit code, got {show(value)}")
    return value


def _metadata(where: str, value: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(value, dict) or not value:
        raise config_error(where, f"expected an object of metadata key -> value, got {show(value)}")
    return tuple(value.items())


# --- compiling the config -------------------------------------------------------------

_CUSTOM_HINT = '; a custom rule needs the long form with "match"'


def _compile_rule(prefix: str, name: str, spec: Any) -> Rule:
    where = f"{prefix}.{name}"
    if name == ENV_REWARD:
        raise config_error(
            where,
            'is not a rule: the environment\'s reward is weighted by environment.env_reward '
            '({"weight": W}); give a custom rule another name',
        )
    if _is_points(spec):
        spec = {"points": spec}
    elif not isinstance(spec, dict):
        raise config_error(
            where, f'expected points (a number) or an object with "points", got {show(spec)}'
        )
    built_in = _BUILT_INS.get(name)
    if "match" in spec:
        if built_in is not None:
            raise config_error(
                where,
                'is a built-in rule; "match" is for custom rules: give this rule its own name',
            )
        return _custom_rule(where, name, spec)
    if built_in is None:
        raise unknown_name(where, name, "rule", _BUILT_INS, "built-in rules", _CUSTOM_HINT)
    values = read_params(where, spec, {**_COMMON_PARAMS, **built_in.params})
    return _rule(where, name, values, built_in.make(values))


def _custom_rule(where: str, name: str, spec: dict[str, Any]) -> Rule:
    matcher = _compile_match(f"{where}.match", spec["match"])
    others = {key: value for key, value in spec.items() if key != "match"}
    return _rule(where, name, read_params(where, others, _COMMON_PARAMS), matcher)


def _rule(where: str, name: str, values: dict[str, Any], count: Occurrences) -> Rule:
    per_occurrence: bool = values["per_occurrence"]
    if values["max_count"] is not None and not per_occurrence:
        raise config_error(
            f"{where}.max_count",
            'caps per-occurrence rules only; add "per_occurrence": true or drop max_count',
        )
    return Rule(name, values["points"], per_occurrence, values["max_count"], count)


def _is_points(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
