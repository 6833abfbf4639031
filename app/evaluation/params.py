"""Start-up checks shared by the reward rules and the invalid-trace filters.

Both read a name -> parameters mapping out of config.json; a wrong name or value must
stop start-up with one line that names the file, the key and the fix, so the checks and
the wording live here once.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from app.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: its type (int, float or bool), default and allowed range.

    `required` parameters have no default; `nullable` ones accept JSON null (= off).
    """

    kind: type[int | float | bool]
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    required: bool = False
    nullable: bool = False

    def describe(self) -> str:
        what = {bool: "true or false", int: "an integer", float: "a number"}[self.kind]
        if self.minimum is not None and self.maximum is not None:
            what += f" from {_num(self.minimum)} to {_num(self.maximum)}"
        elif self.minimum is not None:
            what += f" >= {_num(self.minimum)}"
        return what + (" or null" if self.nullable else "")


@dataclass(frozen=True, slots=True)
class BuiltIn(Generic[T]):
    """A built-in rule or filter: its parameters, and how to build it from their values."""

    make: Callable[[dict[str, Any]], T]
    params: Mapping[str, Param] = field(default_factory=dict)


def config_error(where: str, problem: str) -> ConfigError:
    """`where` is "file: dotted.key"; the message stays on one line."""
    return ConfigError(f"{where}: {problem}".replace("\n", " "))


def unknown_name(
    where: str, name: str, what: str, known: Iterable[str], known_as: str, extra: str = ""
) -> ConfigError:
    """An unknown rule, filter or parameter `name` at `where`, with the closest known name
    when a typo is the likely cause: "unknown rule; did you mean X? built-in rules are ..."."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    listing = ", ".join(known) or "none"
    return config_error(where, f"unknown {what}; {hint}{known_as} are {listing}{extra}")


def read_params(where: str, given: Mapping[str, Any], specs: Mapping[str, Param]) -> dict[str, Any]:
    """Checks `given` against `specs` and returns every parameter, defaults filled in."""
    for key in given:
        if key not in specs:
            raise unknown_name(f"{where}.{key}", key, "parameter", specs, "its parameters")
    values: dict[str, Any] = {}
    for key, spec in specs.items():
        if key in given:
            values[key] = _checked(f"{where}.{key}", given[key], spec)
        elif spec.required:
            raise config_error(f"{where}.{key}", f"missing; expected {spec.describe()}")
        else:
            values[key] = spec.default
    return values


def show(value: Any) -> str:
    """A config value as the user wrote it (JSON), cut short."""
    text = json.dumps(value, ensure_ascii=False, default=repr)  # not orjson: it writes NaN as null
    return text if len(text) <= 60 else text[:57] + "..."


def _checked(where: str, value: Any, spec: Param) -> Any:
    if value is None and spec.nullable:
        return None
    if not _has_kind(value, spec.kind):
        raise config_error(where, f"expected {spec.describe()}, got {show(value)}")
    if spec.kind is bool:
        return value
    if (spec.minimum is not None and value < spec.minimum) or (
        spec.maximum is not None and value > spec.maximum
    ):
        raise config_error(where, f"expected {spec.describe()}, got {show(value)}")
    return float(value) if spec.kind is float else value


def _has_kind(value: Any, kind: type) -> bool:
    # bool is an int subclass in Python, but `true` is never a count or a weight in JSON.
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
