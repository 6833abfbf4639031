"""Real models' chat templates (see README.md here) and a tokenizer to render them
with `transformers`' `apply_chat_template`: rendering to text needs only the template,
so the tokenizer is an empty word-level one built locally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def template(name: str) -> str:
    return (HERE / f"{name}.jinja").read_text()


def renderer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast  # its constructor is untyped
    return fast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
