"""The run spec a client POSTs to /v1/runs: which processes to start, in what
order, and how to tell that each one is up.

    {"trainer": {"command": [...], "health": H, "start_timeout": s},
     "environments": [{"command": [...], "health": H}, ...],
     "cwd": "...", "env": {...}, "poll_interval": 30, "stop_timeout": 10}

H is {"http": URL} (answers 2xx), {"log": TEXT} (a line of the process's output
contains it) or {"alive_seconds": N} (still running after N seconds); no health
check means "up once spawned".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

# The variables the hub injects into the trainer (app/runs/channel.py). A spec may not
# set them: the model channel has one source, tinker.json and the hub's environment.
INJECTED = frozenset({"OPENAI_BASE_URL", "OPENAI_API_KEY", "TINKER_API_KEY", "ATROPOS_HUB_URL"})


def _no_nul(value: str) -> str:
    # Neither exec() nor the database (PostgreSQL's jsonb) takes a NUL character.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HealthCheck(_Spec):
    http: Annotated[Text, Field(pattern=r"^https?://")] | None = None
    log: Annotated[Text, Field(min_length=1)] | None = None
    alive_seconds: Annotated[float, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> HealthCheck:
        given = [
            name for name in ("http", "log", "alive_seconds") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                'a health check is exactly one of {"http": URL}, {"log": TEXT} or '
                '{"alive_seconds": N}'
            )
        return self

    def describe(self) -> str:
        if self.http is not None:
            return f"{self.http} did not answer 2xx"
        if self.log is not None:
            return f"no output line contained {self.log!r}"
        return f"it did not stay up {self.alive_seconds:g} s"


class ProcessSpec(_Spec):
    command: Annotated[
        list[Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]], Field(min_length=1)
    ]
    health: HealthCheck | None = None
    # How long the health check may take before the run fails.
    start_timeout: Annotated[float, Field(gt=0)] = 120

    @model_validator(mode="after")
    def _alive_fits_in_timeout(self) -> ProcessSpec:
        alive = self.health.alive_seconds if self.health else None
        if alive is not None and alive >= self.start_timeout:
            raise ValueError(
                f"health.alive_seconds ({alive:g}) must be shorter than start_timeout "
                f"({self.start_timeout:g})"
            )
        return self


class RunSpec(_Spec):
    trainer: ProcessSpec
    environments: list[ProcessSpec] = Field(default_factory=list)
    # The processes' working directory on the hub's machine; default and relative
    # paths are the hub's (resolved and checked when the run is created).
    cwd: Text | None = None
    # Added to the environment the processes inherit from the hub. Stored with the run
    # and shown by GET: secrets belong in the hub's environment, not here.
    env: dict[Text, Text] = Field(default_factory=dict)
    poll_interval: Annotated[float, Field(gt=0)] = 30
    stop_timeout: Annotated[float, Field(ge=0)] = 10

    @field_validator("env")
    @classmethod
    def _no_injected_names(cls, value: dict[str, str]) -> dict[str, str]:
        taken = sorted(INJECTED & value.keys())
        if taken:
            raise ValueError(
                f"{', '.join(taken)} is set by the hub from tinker.json and its own "
                "environment; remove it from env"
            )
        return value

    def processes(self) -> list[tuple[str, ProcessSpec]]:
        """(role, spec) in start order: the trainer, then env_0, env_1, ..."""
        return [("trainer", self.trainer)] + [
            (f"env_{i}", spec) for i, spec in enumerate(self.environments)
        ]
