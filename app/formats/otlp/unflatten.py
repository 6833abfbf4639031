"""Attribute values as conventions write them: JSON inside strings, and lists spread
over indexed keys (`llm.input_messages.0.message.role`)."""

from __future__ import annotations

from typing import Any

import orjson


def decoded_json(value: Any) -> Any:
    """A string holding a JSON object or array, decoded; anything else as it is."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def indexed(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """The entries `prefix.N.<path>` as a list by N, each a nested dict of its paths
    (numbered levels below become lists too). Gaps in the numbering are closed."""
    start = prefix + "."
    tree: dict[str, Any] = {}
    for key, value in attrs.items():
        if key.startswith(start):
            _put(tree, key[len(start):].split("."), value)
    listed = _listed(tree)
    return [e for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return  # a value already stands where this path branches
        node = child
    node.setdefault(path[-1], value)


def _listed(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    children = {key: _listed(child) for key, child in node.items()}
    if children and all(key.isdecimal() for key in children):
        return [children[key] for key in sorted(children, key=_number_order)]
    return children


def _number_order(digits: str) -> tuple[int, str]:
    """Numeric order without int(), which refuses numbers past 4,300 digits."""
    significant = digits.lstrip("0")
    return len(significant), significant
