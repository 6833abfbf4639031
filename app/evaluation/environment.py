"""The `environment` section of config.json: reward rules (scoring.py) and
invalid-trace filters (filters.py), compiled once at start-up (a bad rule stops the
hub with one line) and applied to every trace before it is stored."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from app.config import EnvironmentConfig
from app.domain import Trace
from app.evaluation.filters import Filters, find_reject_reasons
from app.evaluation.scoring import RewardRules, score


@dataclass(frozen=True, slots=True)
class Evaluation:
    reward: float
    breakdown: dict[str, Any]
    reject_reasons: list[dict[str, Any]]


@dataclass(frozen=True)
class Environment:
    config: EnvironmentConfig
    rules: RewardRules
    filters: Filters
    fingerprint: str

    @classmethod
    def from_config(cls, config: EnvironmentConfig) -> Environment:
        canonical = orjson.dumps(config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
        return cls(
            config,
            RewardRules.from_config(
                config.reward_rules, env_reward_weight=config.env_reward.weight
            ),
            Filters.from_config(config.invalid_trace_filters),
            fingerprint=hashlib.sha256(canonical).hexdigest()[:16],
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to the ingest processes as its config: compiled RE2 patterns do not pickle.
        return (Environment.from_config, (self.config,))

    def evaluate(self, trace: Trace) -> Evaluation:
        """Rejected traces are scored too, so users see both why and how well."""
        result = score(trace, self.rules)
        reasons = find_reject_reasons(trace, self.filters)
        return Evaluation(
            reward=result.reward,
            breakdown=dict(result.breakdown),
            reject_reasons=[dict(reason) for reason in reasons],
        )
