"""Request bodies of the Atropos API: the fields, types and defaults of atroposlib
0.4.0's `api/server.py`, so that what its clients send validates the same way.

Two constraints are ours: batch_size and group_size must be at least 1 (atroposlib
loops forever on a batch size of 0 and divides by the group size)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator


class Registration(BaseModel):
    wandb_group: str
    wandb_project: str
    batch_size: int = Field(ge=1)
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    max_token_length: int
    desired_name: str
    weight: float
    group_size: int = Field(ge=1)
    # The least share (0.0-1.0) of every batch this env's groups should fill.
    min_batch_allocation: float | None = None


class EnvIdentifier(BaseModel):
    env_id: int


class BatchAck(BaseModel):
    batch_id: str


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
    env_id: int | None = None
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
