"""Checks that several test files make."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from app.errors import ConfigError


def config_error(load: Callable[[Any], object], value: Any) -> str:
    """The message of the ConfigError that `load(value)` raises; it must be one line."""
    with pytest.raises(ConfigError) as caught:
        load(value)
    message = str(caught.value)
    assert "\n" not in message
    return message
