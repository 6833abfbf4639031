"""The tokens view of a gateway trajectory (`GET /v1/traces/{id}?view=tokens`): the
exact token ids the policy saw and produced, with its logprobs, as a trainer takes them.

    {"tokens", "masks", "logprobs", "exact", "broken_at"?, "samples"?}

`tokens` are the last call's prompt ids followed by its completion ids (the last call
that returned ids). `masks` are -100 except on positions the model generated, in that
call or any earlier one whose generation the sequence holds; there a mask is the token
id (the Atropos convention). One logprob per position: the upstream's on generated
positions (null where it returned none), 1.0 elsewhere, as atroposlib fills prompt
positions.

`exact` is true when every call's prompt ids begin with the previous call's prompt and
completion ids, so the one sequence holds every call's generation as the model made
it. Otherwise (an agent that edits its history, a chat template that re-renders, a
call without ids) it is false, `broken_at` names the first call that breaks the chain,
only the generations since the last break are marked, and `samples` lists each call's
own prompt ids, completion ids and logprobs.
"""

from __future__ import annotations

from typing import Any

from app.errors import Invalid, NotFound

PROMPT_LOGPROB = 1.0
MASKED = -100


def token_view(trace_id: str, source_format: str, original: Any) -> dict[str, Any]:
    if source_format != "gateway" or not isinstance(original, dict):
        raise NotFound(f"trace {trace_id!r} came in format {source_format}, not through the "
                       "gateway: it has no token ids", field="view", code="no_token_ids")
    calls = [c for c in original.get("calls") or []
             if isinstance(c, dict) and isinstance(c.get("response"), dict)]
    samples = [_sample(i, c) for i, c in enumerate(calls)]
    with_ids = [s for s in samples if s["prompt_token_ids"] is not None
                and s["token_ids"] is not None]
    if not with_ids:
        raise Invalid(
            f"no call of trace {trace_id!r} came with token ids (ask the upstream for them: "
            'a gateway.routes entry with "add": {"return_token_ids": true, "logprobs": true})',
            field="view", code="no_token_ids",
        )
    broken_at: int | None = None
    chain_start = 0
    for k in range(1, len(samples)):
        before, now = samples[k - 1], samples[k]
        if not _continues(before, now):
            broken_at = broken_at if broken_at is not None else now["call"]
            chain_start = k
    last = with_ids[-1]
    tokens = [*last["prompt_token_ids"], *last["token_ids"]]
    masks = [MASKED] * len(tokens)
    logprobs: list[float | None] = [PROMPT_LOGPROB] * len(tokens)
    for sample in samples[chain_start:]:
        if sample["prompt_token_ids"] is None or sample["token_ids"] is None:
            continue
        start = len(sample["prompt_token_ids"])
        given = sample["logprobs"] or []
        for j, token in enumerate(sample["token_ids"]):
            if start + j >= len(tokens):
                break
            masks[start + j] = token
            logprobs[start + j] = given[j] if j < len(given) else None
    view: dict[str, Any] = {"tokens": tokens, "masks": masks, "logprobs": logprobs,
                            "exact": broken_at is None}
    if broken_at is not None:
        view["broken_at"] = broken_at
        view["samples"] = samples
    return view


def _sample(index: int, call: dict[str, Any]) -> dict[str, Any]:
    return {"call": index, "prompt_token_ids": call.get("prompt_token_ids"),
            "token_ids": call.get("token_ids"), "logprobs": call.get("logprobs"),
            **({"tokens_withheld": call["tokens_withheld"]} if call.get("tokens_withheld")
               else {})}


def _continues(before: dict[str, Any], now: dict[str, Any]) -> bool:
    if None in (before["prompt_token_ids"], before["token_ids"], now["prompt_token_ids"]):
        return False
    held = [*before["prompt_token_ids"], *before["token_ids"]]
    return bool(now["prompt_token_ids"][: len(held)] == held)
