"""The `environment` section of config.json: reward rules and invalid-trace filters,
compiled once at start-up and applied to every ingested trace."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import EnvironmentConfig
from app.domain import Trace
from app.ingest import Evaluation


@dataclass(frozen=True)
class Environment:
    config: EnvironmentConfig

    @classmethod
    def from_config(cls, config: EnvironmentConfig) -> Environment:
        return cls(config)

    def evaluate(self, trace: Trace) -> Evaluation:
        # Until the reward rules land, every trace is accepted unscored.
        return Evaluation(reward=None, breakdown=None, reject_reasons=[])
