"""`atropos init`: config.json, compression.json and tinker.json written with every key
and its default, to edit rather than to write from the README."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.cli.options import CONFIG_FOLDERS, Commands, command

# tinker.json names a model its base URL serves: the default base URL's, for a first
# `atropos doctor` that gets an answer.
_TINKER_MODEL = "gpt-4.1-mini-2025-04-14"


def register(commands: Commands[argparse.ArgumentParser]) -> None:
    init = command(commands, "init", _init, config=None, example="atropos init --dir ~/.atropos")
    init.add_argument("--dir", type=Path, default=Path("."),
                      help="where to write them (default: here; ~/.atropos is looked in too)")
    init.add_argument("--force", action="store_true", help="replace files that exist")


def files() -> dict[str, dict[str, Any]]:
    """Each file's name and content: every key with its default."""
    from app.config import CompressionFile, HubConfig, TinkerFile

    tinker = TinkerFile().model_dump(mode="json")
    tinker["tinker"]["model_id"] = _TINKER_MODEL
    return {
        "config.json": HubConfig().model_dump(mode="json"),
        "compression.json": CompressionFile().model_dump(mode="json"),
        "tinker.json": tinker,
    }


def _unexpanded(value: Any) -> Any:
    """Paths under the home directory as the defaults spell them (~/...), so that the
    file works for whoever reads it."""
    home = str(Path.home())
    if isinstance(value, dict):
        return {k: _unexpanded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unexpanded(v) for v in value]
    if isinstance(value, str) and (value == home or value.startswith(home + "/")):
        return "~" + value[len(home):]
    return value


async def _init(args: argparse.Namespace) -> int:
    from app.errors import ConfigError

    folder = args.dir.expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    written = files()
    there = [name for name in written if (folder / name).exists()]
    if there and not args.force:
        raise ConfigError(f"{', '.join(there)} already in {folder}: edit them, or pass "
                          "--force to replace them with the defaults")
    for name, content in written.items():
        text = json.dumps(_unexpanded(content), indent=2) + "\n"
        (folder / name).write_text(text, encoding="utf-8")
        print(folder / name)
    found = folder.resolve() in {f.expanduser().resolve() for f in CONFIG_FOLDERS}
    print("next: atropos serve" + ("" if found else f" --config {folder / 'config.json'}"
                                   f" --compression {folder / 'compression.json'}"))
    return 0
