"""Calls without a rollout id are stitched into rollouts by conversation: a call whose
messages begin with an earlier call's messages followed by that call's answer
continues the earlier call's rollout.

Each captured chat call stores `continuation(messages, answer)`, the digest of what
the next call of its conversation begins with; a new call looks up the digests of its
own prefixes that end on an assistant turn (`prefixes`). Messages are compared by what
the model saw (role, text, tool calls, the call id a result answers), so that an SDK
that resends an answer with fields of its own (`refusal: null`, `annotations: []`)
still continues the conversation.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

# Prefixes looked up per call at most: the longest first (the latest turns).
MAX_PREFIXES = 16


def continuation(messages: list[Any], answer: dict[str, Any] | None) -> str | None:
    """The digest a call continuing this one's conversation begins with; None when the
    call has no answer to continue from."""
    if answer is None:
        return None
    conversation = [*messages, answer]
    return _digests(conversation, [len(conversation)])[0]


def prefixes(messages: list[Any]) -> list[str]:
    """The digests of the prefixes of `messages` that end on an assistant turn, longest
    first: those an earlier call's continuation may equal."""
    ends = [i + 1 for i, m in enumerate(messages)
            if isinstance(m, dict) and m.get("role") == "assistant"]
    return _digests(messages, ends[-MAX_PREFIXES:])[::-1]


def _digests(messages: list[Any], ends: list[int]) -> list[str]:
    """The digest of each prefix `messages[:end]` (ends ascending): the sha256 of the
    JSON array of its messages as seen, hashed once for all of them, since a long
    agent's every call repeats its whole conversation."""
    digest, found, wanted = hashlib.sha256(b"["), [], set(ends)
    for i, message in enumerate(messages[:ends[-1]] if ends else []):
        # orjson's array: its items' JSON, comma-separated, in brackets, no spaces.
        digest.update(b"," if i else b"")
        digest.update(orjson.dumps(as_seen(message)))
        if i + 1 in wanted:
            prefix = digest.copy()
            prefix.update(b"]")
            found.append(prefix.hexdigest())
    return found


def as_seen(message: Any) -> Any:
    """A message as the model saw it: role, text, tool calls, the call id it answers."""
    if not isinstance(message, dict):
        return message
    calls = message.get("tool_calls") or []
    return [
        message.get("role"),
        _text(message.get("content")),
        [_call(c) for c in calls] if isinstance(calls, list) else calls,
        message.get("tool_call_id"),
    ]


def _call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    fn = call["function"] if isinstance(call.get("function"), dict) else {}
    return [call.get("id"), fn.get("name"), fn.get("arguments")]


def _text(content: Any) -> Any:
    """Text content as one string: a list of text parts reads as their joined text,
    and null as empty, as a chat template renders them."""
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content
