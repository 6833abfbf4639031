"""Real models' chat templates, as TRL ships them (`trl/chat_templates/*.jinja`; each is
the model's own `tokenizer_config.json` template: Qwen2.5's, Qwen3.6's, Llama 3.2's,
gpt-oss'...), and a tokenizer to render them with `transformers`' `apply_chat_template`:
rendering to text needs only the template, so the tokenizer is an empty word-level one
built locally."""

from __future__ import annotations

from importlib import resources
from typing import Any


def template(name: str) -> str:
    # Read from the installed package without importing TRL's trainers (and torch).
    return (resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def renderer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast  # its constructor is untyped
    return fast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
