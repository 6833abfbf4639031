"""Facts: the identifiers, numbers, paths and names a trace's turns hold, so that
compression keeps what an assistant turn relies on.

    facts("user mia_li_3668 paid $368.00")   # {"mia_li_3668", "368.00", "368"}
    facts("on 2024-05-20", parts=False)      # {"2024-05-20"}: what a turn states

A fact is a token with a digit (a number, a date, an id like HAT069), with an
underscore, slash or inner dot (a snake_case name, a path, a file name), or an
upper-case code of three letters or more (JFK, HXDUBJ). A token a turn holds also
stands for its parts between separators, so that "368" is found in "$368.00" and
"app/main.py" in "src/app/main.py:12"; what a turn states is taken whole (a path also
as its file name), so that stating "2024-05-20" does not make every "2024" matter.
Plain words are not facts: every output shares them.

A fact an assistant turn states is *backed* when an earlier turn other than the
assistant's (the task, the system prompt, a user turn, a tool result) holds it.
key_decision_extract keeps every line of a tool output that holds a fact a later
assistant turn states, and the tests check on the real corpus that backed facts stay
backed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from app.domain import Step

# Runs of word characters joined by the separators paths, versions, dates and
# amounts use; separators at the ends are not part of the token.
# (Possessive: a separator never matches [\w$], so giving back is never needed, and
# the engine is told so.)
TOKEN = re.compile(r"[\w$]++(?:[./:\-@#][\w$]++)*+")
_PARTS = re.compile(r"[./:\-@#$]")
_COLON, _SLASH = re.compile(r"[:@#]"), re.compile(r"[/:@#]")
_DIGIT = re.compile(r"\d")
_CODE = re.compile(r"[A-Z][A-Z0-9]{2,}")
# What makes a word a name: a snake_case join, a path, a file or module name.
_NAME = re.compile(r"[_/.]")
# Shorter numbers (list items, small counts) are in every text.
_MIN_NUMBER = 3
_MIN_NAME = 4


def facts(text: str, *, parts: bool = True) -> set[str]:
    """The facts `text` holds, each whole and by its parts. With `parts` false, what
    the text states: a path stands for itself and its file name, but a date or an
    amount does not state its year or its cents."""
    found: set[str] = set()
    known = _FACTS[parts]
    for token in set(TOKEN.findall(text)):
        held = known.get(token)
        if held is None:
            held = _remember(known, token, tuple(
                p for p in _split(token, parts) if _is_fact(p)))
        if held:
            found.update(held)
    return found


def candidates(token: str, *, parts: bool = True) -> tuple[str, ...]:
    """A token and what it also stands for (its parts), facts or not."""
    known = _CANDIDATES[parts]
    found = known.get(token)
    return _remember(known, token, _split(token, parts)) if found is None else found


# The words of a trace come back in every output and turn, and compression looks up
# each one's parts many times: those of a usual length are remembered, by `parts`
# (all forgotten at once when there are too many).
_CANDIDATES: dict[bool, dict[str, tuple[str, ...]]] = {True: {}, False: {}}
_FACTS: dict[bool, dict[str, tuple[str, ...]]] = {True: {}, False: {}}
_REMEMBERED_TOKEN = 64
_REMEMBERED = 1 << 15


def _remember(known: dict[str, tuple[str, ...]], token: str,
              found: tuple[str, ...]) -> tuple[str, ...]:
    if len(token) <= _REMEMBERED_TOKEN:
        if len(known) >= _REMEMBERED:
            known.clear()
        known[token] = found
    return found


def _split(token: str, parts: bool) -> tuple[str, ...]:
    token = token.strip("$")
    if not _PARTS.search(token):
        return (token,)
    # A path with its line number, its file name, then every part.
    splits = (_COLON, _SLASH, _PARTS) if parts else (_COLON, _SLASH)
    return (token, *(part for split in splits for part in split.split(token)))


class Wanted(frozenset[str]):
    """A set of facts as the `wanted` of `holds` (a fact is wanted if it is in the set).
    Every candidate of a text is a piece of it, so a text in which no fact of the set
    occurs holds none: `holds` answers it without reading its tokens."""

    def __call__(self, fact: str) -> bool:
        return fact in self

    def within(self, text: str) -> Wanted:
        """The facts that occur in `text`: all that any piece of it can hold."""
        return Wanted(fact for fact in self if fact in text) if self else self


def holds(text: str, wanted: Callable[[str], bool]) -> bool:
    """Whether `text` holds a fact `wanted` says yes to (it is only asked about the
    text's tokens and their parts, facts or not: for a set of facts, the same)."""
    if isinstance(wanted, Wanted) and not any(fact in text for fact in wanted):
        return False
    return any(wanted(p) for token in set(TOKEN.findall(text)) for p in candidates(token))


def _is_fact(token: str) -> bool:
    if _DIGIT.search(token):
        return len(token) >= _MIN_NUMBER
    if len(token) < _MIN_NAME:
        return bool(_CODE.fullmatch(token))
    return bool(_NAME.search(token.strip("_./"))) or bool(_CODE.fullmatch(token))


def step_text(step: Step) -> str:
    return "\n".join(step.text_parts())


def stated(steps: Iterable[Step]) -> set[str]:
    """The facts a run of steps holds."""
    found: set[str] = set()
    for step in steps:
        found |= facts(step_text(step))
    return found
