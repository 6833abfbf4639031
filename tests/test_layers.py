"""The layers of app/, lowest first: a package imports only from layers below its own
(and from itself), function-level imports included, so that `ls app` reads as the
pipeline and no package needs one above it. Packages of one layer do not import each
other. A new package gets its line here."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

LAYERS: list[set[str]] = [
    {"errors", "durations", "waits", "patterns"},
    {"domain", "files", "tokens", "outage"},
    {"formats"},
    {"config"},
    {"llm", "evaluation", "metrics"},
    {"db", "compression", "import_sources", "training"},
    {"access", "targets", "ingest"},
    {"atropos", "runs"},
    {"gateway"},
    {"stages"},
    {"hub"},
    {"api"},
    {"cli"},
]
APP = ROOT / "app"


def _layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _imported(path: Path) -> set[str]:
    """The app packages `path` imports (`app.X...` -> X), wherever the import is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"app.{a.name}" for a in node.names if node.module == "app")]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("app.")}
    return found


def _package(path: Path) -> str:
    return path.relative_to(APP).with_suffix("").parts[0]


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in APP.rglob("*.py") if p.name != "__init__.py" or p.parent != APP}
    assert packages == set().union(*LAYERS)


def test_no_package_imports_its_own_layer_or_one_above() -> None:
    upward = []
    for path in sorted(APP.rglob("*.py")):
        if path.parent == APP and path.name == "__init__.py":
            continue
        own = _package(path)
        for imported in _imported(path) - {own}:
            if _layer_of(imported) >= _layer_of(own):
                upward.append(f"{path.relative_to(ROOT)} imports app.{imported}")
    assert upward == []
