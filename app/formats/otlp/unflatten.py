"""Attribute values as conventions write them: JSON inside strings, and lists spread
over indexed keys (`llm.input_messages.0.message.role`)."""

from __future__ import annotations

from typing import Any

import orjson

from app.formats import _common as c

# Levels an indexed key may have below its prefix: the conventions' deepest
# (`llm.output_messages.N.message.tool_calls.N.tool_call.function.arguments`) has 7. A
# key of thousands of dots would otherwise nest as deep, past what can be read back.
MAX_KEY_DEPTH = 32


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
    (numbered levels below become lists too). Gaps in the numbering are closed. Raises
    Invalid for a key of more than MAX_KEY_DEPTH levels below `prefix`."""
    start = prefix + "."
    tree: dict[str, Any] = {}
    for key, value in attrs.items():
        if key.startswith(start):
            path = key[len(start):].split(".", MAX_KEY_DEPTH)
            if len(path) > MAX_KEY_DEPTH:
                c.fail(f"{key[:80]}...", f"an attribute key under {prefix} may have at "
                       f"most {MAX_KEY_DEPTH} levels; this one has "
                       f"{key.count('.', len(start)) + 1}")
            _put(tree, path, value)
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
