"""docs/configuration.md is generated from the config models: it cannot drift."""

from __future__ import annotations

import importlib.util

from tests.support import ROOT


def test_the_committed_reference_is_the_generated_one() -> None:
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference.render(), (
        "docs/configuration.md is stale: run python scripts/config_reference.py"
    )
    # Every key of every file is in it, nested ones too.
    for key in ("trace_server.port", "distributor.retry.max_attempts", "distributor.url",
                "tinker.retry.max_seconds", "compression.retry.jitter"):
        assert f"`{key}`" in committed
