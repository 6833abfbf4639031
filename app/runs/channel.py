"""The environment a run's processes start with, and the model channel the trainer
gets in it.

Every process inherits the hub's environment (PATH, HOME, WANDB_API_KEY, ...), with
`PYTHONUNBUFFERED=1` so that Python output reaches its log (and `log` health checks)
as it is printed, the spec's `env` on top, and `ATROPOS_HUB_URL`. The trainer alone
also gets the model channel:

    OPENAI_BASE_URL   tinker.json base_url, normalised as app/llm.py does, ending in /v1
    OPENAI_API_KEY    the value of the variable tinker.json's api_key_env names
    TINKER_API_KEY    the hub's, when set

Those keys are taken out of what the environments inherit, and so are the hub's own
`ATROPOS_<SECTION>__<KEY>` config overrides (a database URL may carry a password).
None of these values is written anywhere by the hub: not to a log line, a run record
or a response; `redact` keeps them out of the log tails it serves, too.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from app.config import TinkerConfig
from app.llm import api_base_url

TINKER_KEY_ENV = "TINKER_API_KEY"
REDACTED = "[redacted]"
# Shorter values are not redacted: replacing every "x" of a log would hide the log,
# and a key that short protects nothing anyway.
_MIN_SECRET = 6


@dataclass(frozen=True)
class ModelChannel:
    base_url: str
    api_key_env: str
    api_key: str | None
    tinker_key: str | None

    @classmethod
    def from_tinker(
        cls, tinker: TinkerConfig, environ: Mapping[str, str] = os.environ
    ) -> ModelChannel:
        """The channel as tinker.json and the hub's environment define it."""
        tinker_key = (environ.get(TINKER_KEY_ENV) or "").strip() or None
        return cls(api_base_url(tinker.base_url), tinker.api_key_env, tinker.api_key(), tinker_key)

    def secrets(self) -> list[str]:
        return [s for s in (self.api_key, self.tinker_key) if s and len(s) >= _MIN_SECRET]

    def redact(self, text: str) -> str:
        """`text` without the keys, as written or in base64 (an HTTP library's debug
        output of `Authorization: Basic ...`, a config dumped encoded)."""
        for secret in self.secrets():
            for form in (secret, *_base64_forms(secret)):
                text = text.replace(form, REDACTED)
        return text


def _base64_forms(secret: str) -> list[str]:
    """What base64 (standard and URL-safe) writes for `secret` wherever it sits in what
    is encoded: at each of the three byte offsets from a 3-byte group, the characters
    that depend on its bytes alone. The characters at either end, which also depend on
    the neighbouring bytes, are left out: they say nothing without the rest."""
    raw = secret.encode()
    forms = []
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + raw + bytes(2)).decode()
        # Character i carries bits 6i..6i+5 of the stream; keep those inside `raw`.
        first = math.ceil(8 * offset / 6)
        last = (8 * (offset + len(raw))) // 6  # exclusive
        middle = encoded[first:last]
        forms += [middle, middle.replace("+", "-").replace("/", "_")]
    return [f for f in dict.fromkeys(forms) if len(f) >= _MIN_SECRET]


def process_env(
    role: str,
    *,
    spec_env: Mapping[str, str],
    channel: ModelChannel,
    hub_url: str,
    inherited: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The environment `role` ("trainer", "env_0", ...) starts with."""
    hidden = {channel.api_key_env, TINKER_KEY_ENV}
    env = {
        name: value
        for name, value in inherited.items()
        if name not in hidden and not _is_config_override(name)
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec_env)
    env["ATROPOS_HUB_URL"] = hub_url
    if role == "trainer":
        env["OPENAI_BASE_URL"] = channel.base_url
        if channel.api_key:
            env["OPENAI_API_KEY"] = channel.api_key
        if channel.tinker_key:
            env[TINKER_KEY_ENV] = channel.tinker_key
    return env


def _is_config_override(name: str) -> bool:
    return name.startswith("ATROPOS_") and "__" in name
