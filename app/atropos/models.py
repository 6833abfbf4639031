"""Request bodies of the Atropos API: the fields, types and defaults of atroposlib
0.4.0's `api/server.py`, so that what its clients send validates the same way; and
the receipts of POST /scored_data(_list), built as these TypedDicts, which are also
their schemas in the OpenAPI document (keys absent, not null, as atroposlib answers).

Constraints that are ours, each refusing with 422 what atroposlib would crash or
loop on, or what a database column cannot hold: batch_size and group_size are at
least 1 (atroposlib loops forever on a batch size of 0 and divides by the group
size); integers that are stored fit 32 bits; weights, allocations, scores, advantages
and logprobs are finite (NaN and Infinity are not JSON: stored, they came back as
null); names are text a database can store (no NUL, no unpaired surrogate).

A group's lists stop at their first bad entry (`fail_fast`), and a list of groups
at its first `MAX_ERRORS` errors: a million bad entries would otherwise each build an
error (3 GB for a million `{}`)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, NotRequired

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from typing_extensions import TypedDict  # pydantic needs this one on 3.11

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_ERRORS = 20


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
# Lists that stop at their first error (floats are finite: ScoredData's config).
Ints = Annotated[list[int], Field(fail_fast=True)]
Floats = Annotated[list[float], Field(fail_fast=True)]
IntRows = Annotated[list[Ints], Field(fail_fast=True)]
FloatRows = Annotated[list[Floats], Field(fail_fast=True)]


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

    model_config = ConfigDict(allow_inf_nan=False)

    tokens: IntRows
    masks: IntRows
    scores: Floats
    advantages: FloatRows | None = None
    ref_logprobs: FloatRows | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: FloatRows | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: Int32 | None = None
    # On-policy distillation: [sequence][position][top_k].
    distill_token_ids: Annotated[list[IntRows], Field(fail_fast=True)] | None = None
    distill_logprobs: Annotated[list[FloatRows], Field(fail_fast=True)] | None = None

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


# The fields of a group that take any JSON: the only ones that hold strings (so secrets)
# or numbers that are not checked as they are parsed. The others are numbers.
ANY_JSON_FIELDS = ("messages", "generation_params", "overrides", "group_overrides", "images")


class GroupReceived(TypedDict):
    """The receipt of POST /scored_data: the group is stored."""

    status: Annotated[Literal["received", "buffered"], Field(
        description="buffered: held until its env has a full group size (see buffer_size)")]
    buffer_size: NotRequired[Annotated[int, Field(
        description="Present when buffered: sequences its env's buffer holds")]]


class GroupsReceived(TypedDict):
    """The receipt of POST /scored_data_list: every group is stored."""

    status: Literal["received"]
    groups_processed: int
    buffered: NotRequired[Annotated[int, Field(
        description="Present when some were buffered: how many")]]
    last_buffer_size: NotRequired[Annotated[int, Field(
        description="Present when some were buffered")]]


class InvalidGroups(ValueError):
    """Why groups were refused: at most MAX_ERRORS pydantic errors, each `loc` opening
    with the group's index in its list (none for a single group)."""

    def __init__(self, errors: list[Any]) -> None:
        super().__init__(f"{len(errors)} validation errors")
        self.errors = errors


def parse_group(text: bytes) -> ScoredData:
    """One group from its JSON text; InvalidGroups says why not."""
    try:
        group = ScoredData.model_validate_json(text)
    except ValidationError as exc:
        raise InvalidGroups(exc.errors(include_url=False)[:MAX_ERRORS]) from None
    _refuse_non_json_numbers(group)
    return group


def parse_groups(texts: list[bytes]) -> list[ScoredData]:
    """Groups from their JSON texts; InvalidGroups holds the first MAX_ERRORS errors,
    after which the rest is not looked at."""
    groups: list[ScoredData] = []
    errors: list[Any] = []
    for index, text in enumerate(texts):
        try:
            groups.append(parse_group(text))
        except InvalidGroups as exc:
            errors += [{**error, "loc": (index, *error["loc"])} for error in exc.errors]
            if len(errors) >= MAX_ERRORS:
                break
    if errors:
        raise InvalidGroups(errors[:MAX_ERRORS])
    return groups


def _refuse_non_json_numbers(group: ScoredData) -> None:
    """NaN and Infinity (or a number too large for a float) where the model takes any
    JSON: pydantic reads them, orjson would store them as null. The typed fields refuse
    them already (allow_inf_nan=False); these hold a few hundred values, not the
    tokens, so walking them costs less than searching the request's text."""
    for name in ANY_JSON_FIELDS:
        stack = [getattr(group, name)]
        while stack:
            value = stack.pop()
            if isinstance(value, float):
                if not math.isfinite(value):
                    message = (f"not valid JSON ({value} in {name}); NaN and Infinity are "
                               "not JSON numbers")
                    raise InvalidGroups([{"type": "json_invalid", "loc": (name,),
                                          "msg": message}])
            elif isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
