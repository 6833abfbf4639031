from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from app.domain import Outcome, Status, Step, StepType, Trace
from app.errors import ConfigError
from app.evaluation.filters import Filters, find_reject_reasons
from app.evaluation.scoring import MATCH_WINDOW, RewardRules, RuleResult, score
from tests.support import checks
from tests.support.builders import action, final, observation, thought, trace

DEFAULT_RULES = {
    "task_success": 20,
    "code_runs_ok": 10,
    "invalid_tool_call": -5,
    "loop_detected": -10,
    "timeout": -15,
}


def result(t: Trace, rules: dict[str, Any], name: str | None = None) -> RuleResult:
    breakdown = score(t, RewardRules.from_config(rules)).breakdown
    return breakdown[name or next(iter(rules))]


def config_error(rules: Any) -> str:
    return checks.config_error(RewardRules.from_config, rules)


# --- the score --------------------------------------------------------------------------


def test_reward_is_the_sum_of_fired_rules_and_breakdown_lists_every_rule() -> None:
    t = trace(action(arguments="not json"), observation(exit_code=0), status=Status.SUCCESS)
    s = score(t, RewardRules.from_config(DEFAULT_RULES))
    assert s.reward == 20 + 10 - 5
    assert s.breakdown == {
        "task_success": {"fired": True, "count": 1, "points": 20.0},
        "code_runs_ok": {"fired": True, "count": 1, "points": 10.0},
        "invalid_tool_call": {"fired": True, "count": 1, "points": -5.0},
        "loop_detected": {"fired": False, "count": 0, "points": 0.0},
        "timeout": {"fired": False, "count": 0, "points": 0.0},
        "env_reward": {"fired": False, "count": 0, "points": 0.0},
    }
    assert orjson.loads(orjson.dumps(s.breakdown)) == s.breakdown


def test_no_rules_give_zero() -> None:
    s = score(trace(), RewardRules.from_config({}))
    assert (s.reward, s.breakdown) == (0.0, {"env_reward": {"fired": False, "count": 0,
                                                             "points": 0.0}})


# --- the environment's own reward ---------------------------------------------------------


def test_env_reward_adds_weight_times_the_value_on_its_own_line() -> None:
    t = Trace(task="t", outcome=Outcome(reward=0.01))
    s = score(t, RewardRules.from_config(DEFAULT_RULES))
    # The seed example: 0.01 x 20 and nothing else (no status was reported).
    assert s.reward == pytest.approx(0.2)
    assert s.breakdown["env_reward"] == {"fired": True, "count": 1, "points": pytest.approx(0.2)}
    assert s.breakdown["task_success"]["fired"] is False
    negative = score(Trace(task="t", outcome=Outcome(reward=-0.5)),
                     RewardRules.from_config({}, env_reward_weight=4))
    assert negative.reward == -2.0 and negative.breakdown["env_reward"]["points"] == -2.0


def test_env_reward_and_a_reported_success_both_count() -> None:
    t = Trace(task="t", outcome=Outcome(status=Status.SUCCESS, reward=1.0))
    s = score(t, RewardRules.from_config({"task_success": 20}, env_reward_weight=10))
    assert s.reward == 30.0


def test_a_rule_cannot_take_the_env_reward_name() -> None:
    message = config_error({"env_reward": {"points": 1, "match": {"status": "success"}}})
    assert "environment.reward_rules.env_reward" in message
    assert "environment.env_reward" in message


def test_long_form_equals_short_form_and_takes_fractions() -> None:
    t = trace(status=Status.SUCCESS)
    assert result(t, {"task_success": {"points": 20}}) == result(t, {"task_success": 20})
    assert result(t, {"task_success": 0.5})["points"] == 0.5


# --- task_success and timeout -----------------------------------------------------------


@pytest.mark.parametrize("status", list(Status))
def test_task_success_fires_on_success_only(status: Status) -> None:
    fired = result(trace(status=status), {"task_success": 20})["fired"]
    assert fired is (status is Status.SUCCESS)


@pytest.mark.parametrize("status", list(Status))
def test_timeout_fires_on_timeout_only(status: Status) -> None:
    r = result(trace(status=status), {"timeout": -15})
    assert r["fired"] is (status is Status.TIMEOUT)
    assert r["points"] == (-15.0 if status is Status.TIMEOUT else 0.0)


# --- code_runs_ok -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "said", "fired"),
    [
        ([observation(exit_code=1)], True, True),  # the outcome's word wins
        ([observation(exit_code=0)], False, False),
        ([observation(exit_code=1), observation(exit_code=0)], None, True),
        ([observation(exit_code=0), observation(exit_code=2)], None, False),  # the last exit code decides
        ([observation(exit_code=0), observation("no code"), thought()], None, True),  # ...of those with one
        ([observation("no code")], None, False),
        ([], None, False),
    ],
)
def test_code_runs_ok(steps: list[Step], said: bool | None, fired: bool) -> None:
    assert result(trace(*steps, code_runs_ok=said), {"code_runs_ok": 10})["fired"] is fired


# --- invalid_tool_call ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "invalid"),
    [
        (action(arguments={"cmd": "ls"}), False),
        (action(arguments={}), False),
        (action(arguments=None), False),  # a call without arguments
        (action(arguments='{"cmd": "ls"}'), False),  # a string that parses as an object
        (action(arguments='{"cmd": "ls"'), True),
        (action(arguments="ls -la"), True),
        (action(arguments=""), True),
        (action(arguments="[1, 2]"), True),  # JSON, but not an object
        (action(arguments=[1, 2]), True),
        (action(arguments=3), True),
        (action(tool=None, arguments="x"), False),  # no tool name: empty_action's
        (action(tool=" ", arguments="x"), False),
    ],
)
def test_invalid_tool_call_arguments(step: Step, invalid: bool) -> None:
    assert result(trace(step), {"invalid_tool_call": -5})["count"] == int(invalid)


def test_invalid_tool_call_checks_the_declared_tool_list_only_when_there_is_one() -> None:
    steps = (action("bash", {}), action("browse", {}))
    assert result(trace(*steps, tools=["bash"]), {"invalid_tool_call": -5})["count"] == 1
    assert result(trace(*steps, tools=[]), {"invalid_tool_call": -5})["count"] == 2
    assert result(trace(*steps, tools=None), {"invalid_tool_call": -5})["count"] == 0


def test_invalid_tool_call_counts_once_per_call_even_when_both_wrong() -> None:
    t = trace(action("browse", "x"), tools=["bash"])
    assert result(t, {"invalid_tool_call": -5})["count"] == 1


def test_invalid_tool_call_counts_per_occurrence_by_default() -> None:
    t = trace(action(arguments="a"), observation(), action(arguments="b"), action(arguments={}), action(arguments="c"))
    assert result(t, {"invalid_tool_call": -5}) == {"fired": True, "count": 3, "points": -15.0}


@pytest.mark.parametrize(("max_count", "points"), [(1, -5.0), (2, -10.0), (3, -15.0), (4, -15.0)])
def test_max_count_caps_the_points_not_the_count(max_count: int, points: float) -> None:
    t = trace(action(arguments="a"), action(arguments="b"), action(arguments="c"))
    rules = {"invalid_tool_call": {"points": -5, "max_count": max_count}}
    assert result(t, rules) == {"fired": True, "count": 3, "points": points}


def test_per_occurrence_can_be_turned_off() -> None:
    t = trace(action(arguments="a"), action(arguments="b"))
    rules = {"invalid_tool_call": {"points": -5, "per_occurrence": False}}
    assert result(t, rules) == {"fired": True, "count": 2, "points": -5.0}


# --- loop_detected ----------------------------------------------------------------------


def repeat(n: int, step: Step, *between: Step) -> list[Step]:
    return [s for _ in range(n) for s in (step, *between)]


@pytest.mark.parametrize(("n", "fired"), [(2, False), (3, True), (46, True)])
def test_loop_detected_at_the_default_threshold(n: int, fired: bool) -> None:
    t = trace(*repeat(n, action("go", {"to": "shelf 8"}), observation("Nothing happens.")))
    assert result(t, {"loop_detected": -10}) == {
        "fired": fired,
        "count": int(fired),  # one run, however long
        "points": -10.0 if fired else 0.0,
    }


@pytest.mark.parametrize(("n", "fired"), [(4, False), (5, True)])
def test_loop_threshold_parameter(n: int, fired: bool) -> None:
    rules = {"loop_detected": {"points": -10, "loop_threshold": 5}}
    assert result(trace(*repeat(n, action("go", {"x": 1}))), rules)["fired"] is fired


def test_thoughts_and_observations_do_not_break_a_run() -> None:
    t = trace(*repeat(3, action("go", {"x": 1}), thought("hmm"), observation(error="boom"), thought("again")))
    assert result(t, {"loop_detected": -10})["fired"]


@pytest.mark.parametrize(
    "breaker",
    [
        action("go", {"x": 2}),
        action("look", {"x": 1}),
        final("done"),
        Step(type=StepType.MESSAGE, role="user", content="try again"),
    ],
)
def test_other_steps_break_a_run(breaker: Step) -> None:
    same = action("go", {"x": 1})
    t = trace(same, same, breaker, same, same)
    assert not result(t, {"loop_detected": -10})["fired"]


def test_arguments_compare_canonically() -> None:
    t = trace(action("go", {"a": 1, "b": 2}), action("go", {"b": 2, "a": 1}), action("go", '{"a":1, "b":2}'))
    assert result(t, {"loop_detected": -10})["fired"]


def test_true_and_one_are_different_arguments() -> None:
    t = trace(action("go", {"a": 1}), action("go", {"a": True}), action("go", {"a": 1}))
    assert not result(t, {"loop_detected": -10})["fired"]


def test_loop_fires_once_per_trace_unless_per_occurrence() -> None:
    steps = [*repeat(3, action("go", {"x": 1})), action("look", {}), *repeat(4, action("go", {"x": 2}))]
    assert result(trace(*steps), {"loop_detected": -10}) == {
        "fired": True,
        "count": 2,
        "points": -10.0,
    }
    per_run = {"loop_detected": {"points": -10, "per_occurrence": True}}
    assert result(trace(*steps), per_run)["points"] == -20.0


# --- custom rules -----------------------------------------------------------------------


def test_custom_tool_and_observation_counts_matching_calls() -> None:
    t = trace(
        action("run_tests", {}, "a"),
        observation("3 passed", call_id="a"),
        action("run_tests", {}, "b"),
        observation("1 failed, 2 passed", call_id="b"),
        action("bash", {}, "c"),
        observation("5 passed", call_id="c"),  # another tool's output
        action("run_tests", {}, "d"),
        observation("collected 0 items", call_id="d"),
    )
    match = {"tool": "run_tests", "observation": r"\d+ passed"}
    assert result(t, {"tests": {"points": 5, "match": match}}) == {
        "fired": True,
        "count": 2,
        "points": 5.0,  # once, unless per_occurrence
    }
    per_call = {"tests": {"points": 5, "per_occurrence": True, "max_count": 5, "match": match}}
    assert result(t, per_call)["points"] == 10.0


def test_observations_pair_with_their_call_by_id_then_in_order() -> None:
    by_id = trace(
        action("run_tests", {}, "a"),
        action("bash", {}, "b"),
        observation("boom", call_id="b"),
        observation("ok", call_id="a"),
    )
    in_order = trace(action("run_tests"), action("bash"), observation("ok"), observation("boom"))
    rules = {"r": {"points": 1, "match": {"tool": "run_tests", "observation": "^ok$"}}}
    assert result(by_id, rules)["fired"]
    assert result(in_order, rules)["fired"]


def test_a_call_without_observation_never_matches_observation_conditions() -> None:
    rules = {"r": {"points": 1, "match": {"tool": "bash", "exit_code": 0}}}
    assert not result(trace(action("bash"), thought()), rules)["fired"]
    assert result(trace(action("bash"), observation(exit_code=0)), rules)["fired"]


def test_observation_pattern_without_tool_matches_any_observation() -> None:
    t = trace(observation("Traceback (most recent call last):"), action("bash"), observation("Traceback again"))
    rules = {"r": {"points": -1, "per_occurrence": True, "match": {"observation": "^Traceback"}}}
    assert result(t, rules)["count"] == 2


@pytest.mark.parametrize(
    ("error", "count"), [(True, 2), (False, 1), ("not found", 1), ("^Error", 1), ("nothing", 0)]
)
def test_custom_error_condition(error: Any, count: int) -> None:
    t = trace(observation(error="Error: seat not found"), observation("fine"), observation(error="timeout"))
    rules = {"r": {"points": 1, "per_occurrence": True, "match": {"error": error}}}
    assert result(t, rules)["count"] == count


def test_custom_arguments_pattern_sees_canonical_json() -> None:
    t = trace(action("bash", {"timeout": 5, "cmd": "pytest -x"}), action("bash", "rm -rf /"))
    rules = {
        "r": {"points": 1, "per_occurrence": True, "match": {"arguments": r'^\{"cmd":"pytest'}}
    }
    assert result(t, rules)["count"] == 1
    raw = {"r": {"points": -9, "match": {"tool": ["bash", "sh"], "arguments": "rm -rf"}}}
    assert result(t, raw)["fired"]


@pytest.mark.parametrize(
    ("steps", "fired"),
    [
        ([final("draft"), final("The answer is 42")], True),
        ([final("The answer is 42"), final("no idea")], False),  # the last final counts
        ([thought("The answer is 42")], False),
    ],
)
def test_custom_final_pattern(steps: list[Step], fired: bool) -> None:
    rules = {"r": {"points": 2, "match": {"final": r"(?i)answer is \d+"}}}
    assert result(trace(*steps), rules)["fired"] is fired


@pytest.mark.parametrize(
    ("status", "fired"), [("failure", True), (["failure", "error"], True), ("success", False)]
)
def test_custom_status(status: Any, fired: bool) -> None:
    rules = {"r": {"points": -3, "match": {"status": status}}}
    assert result(trace(status=Status.FAILURE), rules)["fired"] is fired


@pytest.mark.parametrize(
    ("metadata", "fired"),
    [
        ({"difficulty": "hard", "n": 1}, True),
        ({"difficulty": "easy", "n": 1}, False),
        ({"n": 1}, False),
        ({"difficulty": "hard", "n": True}, False),  # JSON true is not 1
    ],
)
def test_custom_metadata(metadata: dict[str, Any], fired: bool) -> None:
    rules = {"r": {"points": 3, "match": {"metadata": {"difficulty": "hard", "n": 1}}}}
    assert result(trace(metadata=metadata), rules)["fired"] is fired


def test_trace_conditions_gate_call_conditions() -> None:
    t = trace(action("run_tests"), observation("5 passed"), status=Status.FAILURE)
    match: dict[str, Any] = {"tool": "run_tests", "observation": "passed"}
    assert result(t, {"r": {"points": 1, "match": {**match, "status": "failure"}}})["fired"]
    assert not result(t, {"r": {"points": 1, "match": {**match, "status": "success"}}})["fired"]


def test_patterns_see_the_head_and_the_tail_of_long_texts() -> None:
    filler = "x" * (2 * MATCH_WINDOW)
    rules = {"r": {"points": 1, "match": {"observation": "NEEDLE"}}}
    assert result(trace(observation("NEEDLE" + filler)), rules)["fired"]
    assert result(trace(observation(filler + "NEEDLE")), rules)["fired"]
    assert not result(trace(observation(filler[:MATCH_WINDOW] + "NEEDLE" + filler)), rules)["fired"]


def test_patterns_run_in_linear_time_on_hostile_output() -> None:
    # Python's re needs minutes for this pattern on this text; RE2 microseconds.
    rules = RewardRules.from_config({"r": {"points": 1, "match": {"observation": ".*a.*a.*x"}}})
    t = trace(observation("a" * 3 * MATCH_WINDOW))
    started = time.perf_counter()
    assert not score(t, rules).breakdown["r"]["fired"]
    assert time.perf_counter() - started < 0.1


# --- config errors ----------------------------------------------------------------------

BUILT_INS = "task_success, code_runs_ok, invalid_tool_call, loop_detected, timeout"


def test_unknown_rule_names_the_rule_and_the_fix() -> None:
    assert config_error({"loop_detectd": -10}) == (
        "config.json: environment.reward_rules.loop_detectd: unknown rule; did you mean "
        f"loop_detected? built-in rules are {BUILT_INS}; a custom rule needs the long form "
        'with "match"'
    )


def test_the_file_name_is_the_callers() -> None:
    with pytest.raises(ConfigError, match=r"^/etc/hub\.json: environment\.reward_rules\.nope: "):
        RewardRules.from_config({"nope": 1}, file="/etc/hub.json")


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([1], "environment.reward_rules: expected an object of rule name -> points, got [1]"),
        (
            {"task_success": "20"},
            'task_success: expected points (a number) or an object with "points", got "20"',
        ),
        ({"task_success": True}, "task_success: expected points (a number)"),
        ({"task_success": [20]}, "task_success: expected points (a number)"),
        ({"task_success": float("nan")}, "task_success.points: expected a number, got NaN"),
        ({"task_success": {}}, "task_success.points: missing; expected a number"),
        ({"task_success": {"points": "1"}}, 'task_success.points: expected a number, got "1"'),
        (
            {"loop_detected": {"points": -10, "loop_treshold": 4}},
            (
                "loop_detected.loop_treshold: unknown parameter; did you mean loop_threshold? "
                "its parameters are points, per_occurrence, max_count, loop_threshold"
            ),
        ),
        (
            {"timeout": {"points": -1, "loop_threshold": 4}},
            (
                "timeout.loop_threshold: unknown parameter; its parameters are points, "
                "per_occurrence, max_count"
            ),
        ),
        (
            {"loop_detected": {"points": -10, "loop_threshold": 1}},
            "loop_detected.loop_threshold: expected an integer >= 2, got 1",
        ),
        (
            {"loop_detected": {"points": -10, "loop_threshold": 2.5}},
            "loop_detected.loop_threshold: expected an integer >= 2, got 2.5",
        ),
        (
            {"loop_detected": {"points": -10, "loop_threshold": True}},
            "loop_detected.loop_threshold: expected an integer >= 2, got true",
        ),
        (
            {"invalid_tool_call": {"points": -5, "max_count": 0}},
            "invalid_tool_call.max_count: expected an integer >= 1 or null, got 0",
        ),
        (
            {"invalid_tool_call": {"points": -5, "per_occurrence": "yes"}},
            'invalid_tool_call.per_occurrence: expected true or false, got "yes"',
        ),
        (
            {"timeout": {"points": -15, "max_count": 2}},
            (
                'timeout.max_count: caps per-occurrence rules only; add "per_occurrence": true '
                "or drop max_count"
            ),
        ),
        (
            {"task_success": {"points": 1, "match": {"status": "success"}}},
            'task_success: is a built-in rule; "match" is for custom rules',
        ),
    ],
)
def test_config_errors(rules: Any, message: str) -> None:
    assert message in config_error(rules)


@pytest.mark.parametrize(
    ("match", "message"),
    [
        ({}, "r.match: expected an object with one or more of tool, arguments, observation, "),
        ("ok", "r.match: expected an object"),
        ({"tol": "x"}, "r.match.tol: unknown match key; did you mean tool? match keys are tool, "),
        ({"tool": []}, "r.match.tool: expected a tool name or a non-empty list of tool names"),
        ({"tool": ["a", 1]}, "r.match.tool: expected a tool name or a non-empty list"),
        ({"observation": "("}, 'r.match.observation: invalid pattern "(": missing ): ('),
        ({"observation": r"(a)\1"}, "invalid escape sequence: \\1; patterns use RE2 syntax"),
        ({"final": "(?=x)"}, 'r.match.final: invalid pattern "(?=x)": invalid perl operator'),
        ({"final": ""}, 'r.match.final: expected a pattern (a non-empty string), got ""'),
        ({"arguments": 5}, "r.match.arguments: expected a pattern (a non-empty string), got 5"),
        ({"error": 1}, "r.match.error: expected a pattern (a non-empty string), got 1"),
        ({"exit_code": "0"}, 'r.match.exit_code: expected an integer exit code, got "0"'),
        ({"exit_code": False}, "r.match.exit_code: expected an integer exit code, got false"),
        ({"status": "sucess"}, "r.match.status: expected one of success, failure, timeout, "),
        ({"status": []}, "r.match.status: expected one of"),
        ({"metadata": []}, "r.match.metadata: expected an object of metadata key -> value"),
        ({"metadata": {}}, "r.match.metadata: expected an object"),
    ],
)
def test_custom_rule_config_errors(match: Any, message: str) -> None:
    assert message in config_error({"r": {"points": 1, "match": match}})


def test_custom_rules_take_the_common_parameters_only() -> None:
    message = config_error({"r": {"points": 1, "loop_threshold": 3, "match": {"tool": "x"}}})
    assert "r.loop_threshold: unknown parameter; its parameters are points, " in message


# --- speed ------------------------------------------------------------------------------


def test_scoring_and_filtering_a_typical_trace_is_fast() -> None:
    # A 30-step trace with the default rules and filters. The budget is 50 us on an idle
    # machine; the bound here is loose so that a busy CI box does not fail it, while a
    # regression such as compiling per call or quadratic scans still does.
    steps: list[Step] = []
    for i in range(10):
        steps += [
            thought(f"Look at file {i} next."),
            action("bash", {"cmd": f"cat f{i}.py"}),
            observation("x" * 500, exit_code=0),
        ]
    t = trace(*steps, tools=["bash"], status=Status.SUCCESS)
    rules = RewardRules.from_config(DEFAULT_RULES)
    filters = Filters.from_config(["repeated_thought", "empty_action", "tool_error_streak"])
    best = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        for _ in range(100):
            score(t, rules)
            find_reject_reasons(t, filters)
        best = min(best, (time.perf_counter() - started) / 100)
    assert best < 500e-6
