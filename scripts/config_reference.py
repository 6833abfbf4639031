"""Write docs/configuration.md, the reference of every config key, from the pydantic
models in app/config.py: their types, defaults and bounds, and the comment above each
field (or its description). `--check` exits 1 when the committed file differs
(tests/test_config_reference.py runs the same check).

    python scripts/config_reference.py          # rewrite docs/configuration.md
    python scripts/config_reference.py --check  # is it current?
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from datetime import timedelta
from enum import Enum
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app import config  # noqa: E402
from app.durations import format_duration  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"
FILES: list[tuple[str, type[BaseModel], str]] = [
    ("config.json", config.HubConfig, "`--config`: the server, its stages and its API"),
    ("compression.json", config.CompressionFile, "`--compression`: what compression keeps"),
    ("tinker.json", config.TinkerFile, "`--tinker`: the model endpoint and training"),
]
HEADER = """# Configuration reference

Generated from the pydantic models in `app/config.py` by `python
scripts/config_reference.py`; do not edit by hand (`tests/test_config_reference.py`
fails when this file and the models differ). Every key is optional unless marked
required. Any key may be set from the environment as `ATROPOS_<SECTION>__<KEY>`
(`ATROPOS_TRACE_SERVER__PORT=9000`). The example files at the repository root
(`config.json.example`, ...) show every key with its default.
"""


@cache  # inspect finds a class's source by parsing its module: once per class
def _comments(cls: type) -> dict[str, str]:
    """The comment lines just above each field of `cls` (and its trailing comment)."""
    try:
        lines, start = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    tree = ast.parse("".join(_dedent(lines)))
    for node in tree.body[0].body if tree.body else []:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        trailing = lines[node.lineno - 1].partition("  # ")[2].strip()
        text = " ".join([*above, trailing]).strip()
        if text:
            found[node.target.id] = text
    return found


def _dedent(lines: list[str]) -> list[str]:
    indent = len(lines[0]) - len(lines[0].lstrip())
    return [line[indent:] if line.strip() else line for line in lines]


def _describe(cls: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.description:
        return field.description
    for klass in cls.__mro__:
        if isinstance(klass, type) and issubclass(klass, BaseModel):
            text = _comments(klass).get(name)
            if text:
                return text
    return ""


def _type(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type(get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(json.dumps(a.value if isinstance(a, Enum) else a)
                            for a in get_args(annotation))
    if origin in (Union, UnionType):
        return " \\| ".join(_type(a) for a in get_args(annotation))
    if origin is not None:
        args = ", ".join(_type(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    if annotation is timedelta:
        return "duration"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, timedelta):
        return f"`{json.dumps(format_duration(value))}`"
    return f"`{json.dumps(value, default=str)}`"


def _bounds(field: FieldInfo) -> str:
    marks = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                marks.append(f"{sign} {bound}")
    return ", ".join(marks)


def _section(cls: type[BaseModel], prefix: str) -> list[str]:
    """The table of `cls`'s own keys, then a section per nested model."""
    rows, nested = [], []
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        inner = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
        model = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)),
                     None)
        key = f"{prefix}{name}"
        if model is not None:
            nested.append((key, model, _describe(cls, name, field)))
            continue
        text = _describe(cls, name, field).replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(annotation)} | {_default(field)} | "
                    f"{_bounds(field)} | {text} |")
    out = []
    if rows:
        out += ["| key | type | default | bounds | meaning |", "|---|---|---|---|---|", *rows, ""]
    for key, model, text in nested:
        out += [f"### `{key}`", ""]
        doc = text or inspect.cleandoc(model.__doc__ or "")
        if doc and not doc.endswith(".json") and key != "distributor":
            out += [re.sub(r"\s+", " ", doc), ""]
        if key == "distributor":
            out += _distributor()
        else:
            out += _section(model, f"{key}.")
    return out


def _distributor() -> list[str]:
    out = ["The keys every target shares, then each target's own (`distributor.target`).", ""]
    out += _section(config.DistributorConfig, "distributor.")
    shared = set(config.DistributorConfig.model_fields) - {"target"}
    for name, model in config.TARGET_CONFIGS.items():
        # Its own keys, and the shared ones whose default it changes.
        own = {k: f for k, f in model.model_fields.items()
               if k not in shared or _default(f) != _default(
                   config.DistributorConfig.model_fields[k])}
        out += [f"#### `distributor.target`: `{name}`", ""]
        rows = [f"| `distributor.{k}` | {_type(f.annotation)} | {_default(f)} | {_bounds(f)} | "
                f"{_describe(model, k, f)} |" for k, f in own.items() if k != "target"]
        out += (["| key | type | default | bounds | meaning |", "|---|---|---|---|---|", *rows]
                if rows else ["No keys of its own."])
        out.append("")
    return out


def render() -> str:
    out = [HEADER]
    for filename, model, what in FILES:
        out += [f"## {filename}", "", f"{what}.", ""]
        out += _section(model, "")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
