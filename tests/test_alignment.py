"""align(): each compressed step beside the original step it came from."""

from __future__ import annotations

from app.compression.alignment import align
from app.domain import Step, StepType


def thought(text: str) -> Step:
    return Step(type=StepType.THOUGHT, content=text)


def call(n: int, output: str) -> list[Step]:
    return [Step(type=StepType.ACTION, tool="bash", arguments={"n": n}, call_id=f"c{n}"),
            Step(type=StepType.OBSERVATION, call_id=f"c{n}", content=output)]


def test_kept_rewritten_removed_and_added_steps_are_paired_in_order() -> None:
    original = [thought("Look at the failing test first."), *call(1, "x" * 500),
                thought("Same again."), *call(2, "ok"), Step(type=StepType.FINAL, content="Done")]
    summary = Step(type=StepType.MESSAGE, role="user", content="[Summary] two calls")
    compressed = [thought("Look at the failing test first."),
                  original[1], original[2].model_copy(update={"content": "x" * 40 + "[... cut ...]"}),
                  summary, original[6]]
    pairs = [(p.original, p.compressed, p.change) for p in align(original, compressed)]
    assert pairs == [(0, 0, "kept"), (1, 1, "kept"), (2, 2, "rewritten"), (None, 3, "added"),
                     (3, None, "removed"), (4, None, "removed"), (5, None, "removed"),
                     (6, 4, "kept")]


def test_a_thought_trimmed_at_its_end_is_the_same_thought() -> None:
    long = thought("I will read the whole module before I change anything in it. " * 5)
    trimmed = thought(long.content[:120] + "\n[... 40 tokens cut ...]\n")  # type: ignore[index]
    other = thought("Something else entirely, said at more length than forty characters.")
    pairs = [(p.original, p.compressed, p.change) for p in align([other, long], [trimmed])]
    assert pairs == [(0, None, "removed"), (1, 0, "rewritten")]
