"""Request bodies of the Atropos API: the fields, types and defaults of atroposlib
0.4.0's `api/server.py`, so that what its clients send validates the same way.

Constraints that are ours, each refusing with 422 what atroposlib would crash or
loop on, or what a database column cannot hold: batch_size and group_size are at
least 1 (atroposlib loops forever on a batch size of 0 and divides by the group
size); integers that are stored fit 32 bits; weights and allocations are finite;
names are text a database can store (no NUL, no unpaired surrogate)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, field_validator

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds an unpaired surrogate)") from None
    return value


Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, AfterValidator(_storable)]


class Registration(BaseModel):
    wandb_group: Text
    wandb_project: Text
    batch_size: Count
    max_token_len: Int32
    checkpoint_dir: Text
    save_checkpoint_interval: Int32
    starting_step: Int32
    num_steps: Int32


class RegisterEnv(BaseModel):
    max_token_length: Int32
    desired_name: Text
    weight: Finite
    group_size: Count
    # The least share (0.0-1.0) of every batch this env's groups should fill.
    min_batch_allocation: Finite | None = None


class EnvIdentifier(BaseModel):
    env_id: Int32


class BatchAck(BaseModel):
    batch_id: Text


class ScoredData(BaseModel):
    """One group: parallel per-sequence lists. Field order is the order of the keys
    in a served group (atroposlib's `_scored_data_to_dict`)."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: Int32 | None = None
    # On-policy distillation: [sequence][position][top_k].
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_have_role_and_content(
        cls, value: list[list[dict[str, Any]]] | None
    ) -> list[list[dict[str, Any]]] | None:
        for conversation in value or ():
            for message in conversation:
                if "role" not in message or "content" not in message:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return value
