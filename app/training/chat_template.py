"""A conversation as the policy's tokens: its chat template, from a tokenizer on this
machine (tinker.tokenizer: a directory, or a name already in the Hugging Face cache;
nothing is downloaded), rendered and tokenized, with the assistant turns marked.

The masks follow the Atropos convention: -100 on every position the model did not
write (system, user, tool turns, the role headers the template adds before an
assistant turn), the token id on the ones it did (an assistant turn's text and the
end-of-turn marker the template closes it with). A template that renders an earlier
turn differently once a later one follows (one that drops past reasoning, say) has no
single sequence holding every turn as the model wrote it: `NotRenderable`, never a
sequence that says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast


class NotRenderable(ValueError):
    """The conversation has no faithful rendering with this template."""


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    masks: list[int]


def load_tokenizer(name: str, *, download: bool = False) -> ChatTokenizer:
    """The tokenizer at `name` (a directory or a cached name; with `download`, also
    one fetched from the Hugging Face hub); OSError when it is not there, ImportError
    without transformers (the `rl` and `tinker` extras)."""
    from transformers import AutoTokenizer  # type: ignore[import-not-found, unused-ignore]

    return cast(ChatTokenizer, AutoTokenizer.from_pretrained(name, local_files_only=not download))


def render(tokenizer: ChatTokenizer, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None = None) -> Rendered:
    """`messages` (OpenAI chat) as token ids and masks (see the module docstring)."""
    extra: dict[str, Any] = {"tools": tools} if tools else {}

    def text(upto: int, generation: bool = False) -> str:
        rendered = tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation, **extra)
        if not isinstance(rendered, str):
            raise NotRenderable("the chat template did not render text")
        return rendered

    try:
        full = text(len(messages))
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = text(i, generation=True) if i else ""
            through = text(i + 1)
            if not (through.startswith(before) and full.startswith(through)):
                raise NotRenderable(
                    f"the chat template renders the turns before message {i} differently "
                    "once it follows: no one sequence holds the conversation as written")
            spans.append((len(before), len(through)))
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotRenderable:
        raise
    except Exception as exc:  # a template's own error (a role it refuses, a missing key)
        raise NotRenderable(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    tokens = [int(t) for t in encoded["input_ids"]]
    masks = [
        token if any(start <= offset[0] < end for start, end in spans) else -100
        for token, offset in zip(tokens, encoded["offset_mapping"])
    ]
    return Rendered(tokens, masks)
