"""inference_logprobs for groups sent without them, served only when
`atropos.fill_missing_logprobs` is on (off by default: groups are served as sent).

tinker-atropos's trainer reads `inference_logprobs[i]` of every sequence
unconditionally, and atroposlib's default `collect_trajectories` does not send
them. The risk of filling: atroposlib's GRPO trainer stops when logprobs are
missing, but given invented ones it trains with exp(logp_new - 0) = p_new as its
importance ratio instead of a ratio near 1, a different objective, silently. What
is stored is never filled: /latest_example shows the group as sent. A filled list
is aligned with `tokens`:

- 1.0 where the mask is -100 (the prompt): atroposlib's sentinel, which trainers
  already skip (tinker-atropos gives those positions no advantage);
- 0.0 elsewhere: log(1), "the sampler was certain". An unknown logprob has no true
  value; 0.0 keeps the position trained (it is not the 1.0 sentinel), is a valid
  log-probability, and keeps an importance ratio exp(new - old) at or below 1.
"""

from __future__ import annotations

from typing import Any

PROMPT = 1.0
UNKNOWN = 0.0
MASKED = -100


def fill_inference_logprobs(group: dict[str, Any]) -> dict[str, Any]:
    """The group with inference_logprobs filled, if it had none."""
    if group.get("inference_logprobs") is not None:
        return group
    masks = group.get("masks") or []
    filled = []
    for i, tokens in enumerate(group.get("tokens") or []):
        mask = masks[i][: len(tokens)] if i < len(masks) else []
        row = [PROMPT if m == MASKED else UNKNOWN for m in mask]
        row.extend([UNKNOWN] * (len(tokens) - len(row)))
        filled.append(row)
    return {**group, "inference_logprobs": filled}
