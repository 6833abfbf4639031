from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.domain import Step, Trace
from app.errors import ConfigError
from app.evaluation.filters import SIMILARITY_WINDOW, Filters, RejectReason, find_reject_reasons
from tests.support import checks
from tests.support.builders import action, final, message, observation, thought, trace


def reasons(steps: list[Step], filters: Any) -> list[RejectReason]:
    return find_reject_reasons(trace(*steps), Filters.from_config(filters))


def hit(steps: list[Step], filters: Any) -> int | None | bool:
    """The step_index of the only reason, or False when the trace passes."""
    found = reasons(steps, filters)
    assert len(found) <= 1
    return found[0]["step_index"] if found else False


def config_error(filters: Any) -> str:
    return checks.config_error(Filters.from_config, filters)


# --- the reasons ------------------------------------------------------------------------


def test_a_valid_trace_has_no_reasons() -> None:
    steps = [thought("look"), action(), observation(), thought("done looking"), final("42")]
    assert reasons(steps, ["repeated_thought", "empty_action", "tool_error_streak"]) == []


def test_one_json_ready_reason_per_matching_filter_in_config_order() -> None:
    steps = [action(None), *[thought("same")] * 3, *[observation(error="boom")] * 6, action("")]
    found = reasons(steps, ["tool_error_streak", "empty_action", "repeated_thought"])
    assert found == [
        {
            "filter": "tool_error_streak",
            "detail": "3 tool errors in a row (max_streak 3), the last: 'boom'",
            "step_index": 6,
        },
        {"filter": "empty_action", "detail": "action without a tool name", "step_index": 0},
        {
            "filter": "repeated_thought",
            "detail": "thought repeated 3 times (max_repeats 3): 'same'",
            "step_index": 3,
        },
    ]
    assert orjson.loads(orjson.dumps(found)) == found


def test_the_two_config_forms_agree() -> None:
    as_list = Filters.from_config(["empty_action", "tool_error_streak"])
    as_dict = Filters.from_config({"empty_action": {}, "tool_error_streak": {"max_streak": 3}})
    assert as_list.names == as_dict.names == ("empty_action", "tool_error_streak")
    t = Trace(steps=[observation(error="e")] * 3)
    assert find_reject_reasons(t, as_list) == find_reject_reasons(t, as_dict)


def test_no_filters_reject_nothing() -> None:
    assert reasons([], []) == reasons([], {}) == []


# --- repeated_thought -------------------------------------------------------------------


@pytest.mark.parametrize(("n", "index"), [(2, False), (3, 4)])
def test_repeated_thought_at_the_default_threshold(n: int, index: int | bool) -> None:
    steps = [s for _ in range(n) for s in (thought("Search again"), action())]
    assert hit(steps, ["repeated_thought"]) == index


@pytest.mark.parametrize(("n", "index"), [(4, False), (5, 4)])
def test_max_repeats_parameter(n: int, index: int | bool) -> None:
    assert hit([thought("x")] * n, {"repeated_thought": {"max_repeats": 5}}) == index


def test_thoughts_compare_after_folding_case_and_whitespace() -> None:
    steps = [
        thought("I will  search"),
        observation(),
        thought("i will search\n"),
        thought(" I WILL\tSEARCH"),
    ]
    assert hit(steps, ["repeated_thought"]) == 3


def test_repeats_need_not_be_consecutive_or_the_same_thought() -> None:
    steps = [thought("a"), thought("b"), thought("a"), thought("b"), thought("c"), thought("b")]
    assert hit(steps, ["repeated_thought"]) == 5


def test_only_thoughts_with_text_count() -> None:
    steps = [
        thought(""),
        thought(" "),
        thought(None),
        final("x"),
        final("x"),
        final("x"),
        message("assistant", "x"),
    ]
    assert hit(steps, ["repeated_thought"]) is False


SIMILAR = {"repeated_thought": {"similarity": 0.8}}
# The later two have word sets with a Jaccard index of exactly 4/5 = 0.8 with the first.
NEAR = ["one two three four", "one two three four five", "one two three four six"]


def test_near_duplicates_count_only_when_similarity_is_set() -> None:
    # NEAR[1] and NEAR[2] share 4 of 6 words (0.67), so each counts towards NEAR[0].
    assert hit([thought(t) for t in NEAR], SIMILAR) == 2
    assert hit([thought(t) for t in NEAR], ["repeated_thought"]) is False


def test_near_duplicates_below_the_threshold_do_not_count() -> None:
    strict = {"repeated_thought": {"similarity": 0.81}}
    assert hit([thought(t) for t in NEAR], strict) is False


def test_near_duplicates_are_sought_among_recent_thoughts_only() -> None:
    others = [thought(f"distinct thought number {i}") for i in range(SIMILARITY_WINDOW)]
    close = [thought(NEAR[0]), *others[:-1], thought(NEAR[1]), thought(NEAR[2])]
    assert hit(close, SIMILAR) == len(close) - 1
    far = [thought(NEAR[0]), *others, thought(NEAR[1]), thought(NEAR[2])]
    assert hit(far, SIMILAR) is False


def test_similarity_detail_says_so() -> None:
    found = reasons([thought(t) for t in NEAR], SIMILAR)
    assert found[0]["detail"] == (
        "thought repeated 3 times (max_repeats 3, near-duplicates at similarity 0.8): "
        "'one two three four'"
    )


# --- empty_action -----------------------------------------------------------------------


def test_a_trace_without_steps_is_empty() -> None:
    assert reasons([], ["empty_action"]) == [
        {"filter": "empty_action", "detail": "the trace has no steps", "step_index": None}
    ]


def test_a_trace_without_agent_steps_is_empty() -> None:
    found = reasons([message("system", "be nice"), message("user", "hi")], ["empty_action"])
    assert found[0]["detail"] == "the trace has no step by the agent"
    assert found[0]["step_index"] is None


@pytest.mark.parametrize("tool", [None, "", "  "])
def test_an_action_without_a_tool_name_is_empty(tool: str | None) -> None:
    assert hit([thought("x"), action(), observation(), action(tool), observation()], ["empty_action"]) == 3


@pytest.mark.parametrize(
    ("steps", "index"),
    [
        ([message("user", "q"), message("assistant", "")], 1),
        ([message("user", "q"), message("assistant", " \n"), message("user", "well?")], 1),
        ([message("user", "q"), thought(""), message("assistant", None), message("user", "?")], 1),
        ([action(), observation(), thought("")], 2),  # a turn that is only "<think>\n"
        ([action(), observation(), final("")], 2),
        ([action(), observation(), thought(" "), final(None)], 2),
        ([message("user", ""), action(), observation("")], False),  # only the agent's turns count
        ([thought(""), action(), observation()], False),  # a tool call is not empty
        ([action(), observation(), thought("still thinking")], False),
        ([message("user", "q"), message("assistant", "a")], False),
        ([action(), observation(), final("42")], False),
    ],
)
def test_an_agent_turn_without_content_or_call_is_empty(
    steps: list[Step], index: int | bool
) -> None:
    assert hit(steps, ["empty_action"]) == index


def test_empty_action_reports_the_first_problem() -> None:
    steps = [message("user", "q"), message("assistant", ""), message("user", "q"), action(None)]
    found = reasons(steps, ["empty_action"])
    assert found == [
        {
            "filter": "empty_action",
            "detail": "agent turn with neither content nor a tool call",
            "step_index": 1,
        }
    ]


# --- tool_error_streak ------------------------------------------------------------------


@pytest.mark.parametrize(("n", "index"), [(2, False), (3, 5)])
def test_tool_error_streak_at_the_default_threshold(n: int, index: int | bool) -> None:
    steps = [s for _ in range(n) for s in (action(), observation(error="Error: no seats"))]
    assert hit(steps, ["tool_error_streak"]) == index


@pytest.mark.parametrize(("max_streak", "index"), [(1, 0), (2, 1), (4, False)])
def test_max_streak_parameter(max_streak: int, index: int | bool) -> None:
    steps = [observation(error="e"), observation(error="e"), observation(error="e")]
    assert hit(steps, {"tool_error_streak": {"max_streak": max_streak}}) == index


def test_a_successful_observation_breaks_the_streak_other_steps_do_not() -> None:
    broken = [observation(error="e"), observation(error="e"), observation("fine"), observation(error="e"), observation(error="e")]
    assert hit(broken, ["tool_error_streak"]) is False
    spaced = [
        observation(error="e"),
        thought("hm"),
        action(),
        observation(error="e"),
        message("user", "?"),
        observation(error="e"),
    ]
    assert hit(spaced, ["tool_error_streak"]) == 5


def test_a_non_zero_exit_code_alone_is_not_a_tool_error() -> None:
    steps = [observation("FAILED test_x", exit_code=1), observation("127", exit_code=127), observation(exit_code=2)]
    assert hit(steps, ["tool_error_streak"]) is False
    assert hit([observation(error="", exit_code=1)] * 3, ["tool_error_streak"]) is False


def test_the_detail_quotes_the_last_error_briefly() -> None:
    found = reasons([observation(error="x" * 200)] * 3, ["tool_error_streak"])
    detail = found[0]["detail"]
    assert detail.startswith("3 tool errors in a row (max_streak 3), the last: 'xxx")
    assert detail.endswith("...'") and len(detail) < 140


# --- config errors ----------------------------------------------------------------------

PREFIX = "config.json: environment.invalid_trace_filters"


def test_unknown_filter_names_the_filter_and_the_known_ones() -> None:
    assert config_error(["repeated_thougt"]) == (
        f"{PREFIX}.repeated_thougt: unknown filter; did you mean repeated_thought? "
        "built-in filters are repeated_thought, empty_action, tool_error_streak"
    )


def test_the_file_name_is_the_callers() -> None:
    with pytest.raises(ConfigError, match=r"^hub\.json: environment\.invalid_trace_filters\.x: "):
        Filters.from_config(["x"], file="hub.json")


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"nope": {}}, ".nope: unknown filter; built-in filters are "),
        ("empty_action", ": expected a list of filter names or an object of name -> parameters"),
        ([1], "[0]: expected a filter name, got 1"),
        (["empty_action", "empty_action"], "[1]: empty_action is listed twice; list it once"),
        ({"empty_action": True}, ".empty_action: expected an object of parameters, got true"),
        (
            {"empty_action": {"max_streak": 2}},
            ".empty_action.max_streak: unknown parameter; its parameters are none",
        ),
        (
            {"tool_error_streak": {"max_streaks": 2}},
            (
                ".tool_error_streak.max_streaks: unknown parameter; did you mean max_streak? "
                "its parameters are max_streak"
            ),
        ),
        (
            {"tool_error_streak": {"max_streak": 0}},
            ".tool_error_streak.max_streak: expected an integer >= 1, got 0",
        ),
        (
            {"tool_error_streak": {"max_streak": "3"}},
            '.tool_error_streak.max_streak: expected an integer >= 1, got "3"',
        ),
        (
            {"repeated_thought": {"max_repeats": 1}},
            ".repeated_thought.max_repeats: expected an integer >= 2, got 1",
        ),
        (
            {"repeated_thought": {"max_repeats": True}},
            ".repeated_thought.max_repeats: expected an integer >= 2, got true",
        ),
        (
            {"repeated_thought": {"similarity": 1.5}},
            ".repeated_thought.similarity: expected a number from 0.5 to 1 or null, got 1.5",
        ),
        (
            {"repeated_thought": {"similarity": "high"}},
            '.repeated_thought.similarity: expected a number from 0.5 to 1 or null, got "high"',
        ),
    ],
)
def test_config_errors(filters: Any, message: str) -> None:
    assert f"{PREFIX}{message}" in config_error(filters)


def test_similarity_may_be_null_or_one() -> None:
    assert Filters.from_config({"repeated_thought": {"similarity": None}}).names == (
        "repeated_thought",
    )
    steps = [thought("a b"), thought("A  b"), thought("a b")]
    assert hit(steps, {"repeated_thought": {"similarity": 1}}) == 2
