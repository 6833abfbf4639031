"""The `atropos` command."""

from app.cli.main import main

__all__ = ["main"]
