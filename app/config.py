"""The three config files (config.json, compression.json, tinker.json), each one
pydantic model with the seed documents' keys kept exactly.

A file that cannot be used stops start-up with one line naming the file, the key
and the problem (`ConfigError`), never a traceback.

Environment variables override keys: `ATROPOS_<SECTION>__<KEY>=value`, e.g.
`ATROPOS_TRACE_SERVER__PORT=9000` or `ATROPOS_COMPRESSION__RATIO=0.25`. The value is
read as JSON when it parses (numbers, booleans, lists), else as a plain string.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Annotated, Any, Literal, TypeGuard, TypeVar, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from app import formats
from app.domain import NEVER_PRUNED, Stage
from app.durations import format_duration, parse_duration
from app.errors import ConfigError
from app.patterns import compile_pattern

ENV_PREFIX = "ATROPOS_"

# A path whose leading ~ is expanded once, when the file is loaded.
HomePath = Annotated[str, AfterValidator(lambda value: str(Path(value).expanduser()))]


class _Section(BaseModel):
    # strict: "32" is not a number nor "yes" a boolean (environment variables are read
    # as JSON first, and as text for a key that wants text: _env_value).
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True)


def _duration(value: Any) -> Any:
    return parse_duration(value) if isinstance(value, str) else value


# "30d", "12h", "90m": written as the CLI's --older-than is.
Duration = Annotated[
    timedelta, BeforeValidator(_duration), PlainSerializer(format_duration, return_type=str)
]


class TraceServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    endpoint: str = "/v1/traces"
    storage_backend: Literal["sqlite", "postgresql"] = "sqlite"
    db_path: HomePath = "~/.atropos/traces.db"
    # postgresql://user:pass@host:port/db; used when storage_backend is postgresql.
    database_url: str | None = None
    max_trace_tokens: int = Field(50000, gt=0)
    flush_interval_seconds: float = Field(30, gt=0)
    # Processes that parse, score and tokenize incoming traces and validate and deflate
    # Atropos groups (app/ingest/processes.py); null: one per CPU this process may run
    # on, at most 8 (each holds the hub's code and the tokenizer: docs/ingest.md).
    ingest_processes: int | None = Field(None, ge=1, le=64)
    # The log's level for every command run with this file (--log-level overrides it).
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Every this many seconds, one INFO line of what the process did meanwhile (traces
    # in, rejected, compressed, batches delivered), instead of a line per trace; 0: none.
    log_summary_seconds: float = Field(60, ge=0)
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (IPs or networks,
    # "*" for any): the client address they name is then the one the per-address rate
    # limit and the logs use. Empty: the headers are ignored, the peer's address counts.
    forwarded_allow_ips: list[str] = Field(default_factory=list)
    # Names the hub answers to besides IP addresses, localhost, the bind address and
    # this machine's host name (app/api/middleware.py HostCheck: DNS rebinding);
    # "*.example.com" for subdomains, "*" for any name.
    allowed_hosts: list[str] = Field(default_factory=list)
    # Files the hub creates (database, batch files, logs, exports) are 0600; with a
    # group named here, 0640 and owned by that group (app/files.py).
    file_group: str | None = None
    # Slow clients (app/api/server.py): a request's headers must be in this long after
    # its first byte, and its body may stall at most body_timeout_seconds (else 408);
    # past max_connections open connections, requests get 503.
    header_timeout_seconds: float = Field(10, gt=0)
    body_timeout_seconds: float = Field(60, gt=0)
    max_connections: int = Field(4096, gt=0)

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry == "*":
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r}: an IP address or network (10.0.0.0/8), or *"
                ) from None
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_a_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/', e.g. /v1/traces")
        return value.rstrip("/") or "/"


class EnvRewardConfig(_Section):
    """How the environment's own reward (a trace's `env_reward`) enters `reward`:
    weight x env_reward, its own line in reward_breakdown (docs/environment.md)."""

    weight: float = Field(20, allow_inf_nan=False)


class EnvironmentConfig(_Section):
    # Compiled and checked by scoring.RewardRules / filters.Filters at start-up.
    reward_rules: dict[str, Any] = Field(
        default_factory=lambda: {
            "task_success": 20,
            "code_runs_ok": 10,
            "invalid_tool_call": -5,
            "loop_detected": -10,
            "timeout": -15,
        }
    )
    invalid_trace_filters: list[str] | dict[str, dict[str, Any]] = Field(
        default_factory=lambda: ["repeated_thought", "empty_action", "tool_error_streak"]
    )
    env_reward: EnvRewardConfig = Field(default_factory=EnvRewardConfig)


def _training_record(name: str) -> str:
    if name not in formats.TRAINING_EXPORTS:
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}",
            {"expected": _either(formats.TRAINING_EXPORTS)},
        )
    return name


class RetryPolicy(_Section):
    """How a failed attempt is retried: a background stage's row (compression.retry,
    distributor.retry) or a call to the model endpoint (tinker.retry). Failed attempt
    n is retried after min(base_seconds * 2^(n-1), max_seconds), less up to `jitter`
    of that at random, so that workers that failed together do not retry together
    while the bounds still hold; after max_attempts attempts the row is failed with
    its error (app/stages/leases.py `retry_later`), or the call (app/llm.py)."""

    max_attempts: int = Field(3, gt=0)
    base_seconds: float = Field(5, ge=0)
    max_seconds: float = Field(60, ge=0)
    jitter: float = Field(0, ge=0, le=1)

    def delay(self, attempt: int) -> float:
        """Seconds from failed attempt `attempt` (1 for the first) to the next."""
        ceiling = min(self.base_seconds * 2.0 ** (attempt - 1), self.max_seconds)
        return ceiling * (1 - self.jitter * random.random())


class DeliveryRetry(RetryPolicy):
    """distributor.retry: the first retry within 5 s, none later than a minute."""

    max_attempts: int = Field(6, gt=0)
    base_seconds: float = Field(5, ge=0, le=5)
    max_seconds: float = Field(60, ge=0, le=60)
    jitter: float = Field(0.5, ge=0, le=1)


class ModelRetry(RetryPolicy):
    """tinker.retry: the model endpoint's 429, 5xx, 408, timeouts and connection
    failures. A Retry-After longer than max_seconds fails the call at once."""

    max_attempts: int = Field(4, gt=0)
    base_seconds: float = Field(1, ge=0)
    max_seconds: float = Field(30, ge=0)
    jitter: float = Field(0.5, ge=0, le=1)


# Keys from before `retry` was an object of its own, still read: the old key, the
# retry key it became, and how its value reads there.
_Legacy = dict[str, tuple[str, Callable[[Any], Any]]]


def _same(value: Any) -> Any:
    return value


def _attempts(retries: Any) -> Any:
    # max_retries counted the retries after the first attempt; max_attempts counts it too.
    return retries + 1 if isinstance(retries, int) else retries


_DISTRIBUTOR_RETRY_KEYS: _Legacy = {
    "max_attempts": ("max_attempts", _same),
    "retry_base_seconds": ("base_seconds", _same),
    "retry_max_seconds": ("max_seconds", _same),
}
_MODEL_RETRY_KEYS: _Legacy = {
    "max_retries": ("max_attempts", _attempts),
    "retry_base_delay_seconds": ("base_seconds", _same),
    "retry_max_delay_seconds": ("max_seconds", _same),
}


def _legacy_retry_keys(data: Any, legacy: _Legacy) -> Any:
    """A section's older flat retry keys moved into its `retry` object, as older config
    files and environment overrides write them; one key set both ways is refused."""
    if not isinstance(data, dict) or not legacy.keys() & data.keys():
        return data
    data = dict(data)
    retry = data.get("retry") or {}
    if not isinstance(retry, dict):
        return data  # the retry field reports what is wrong with it
    retry = dict(retry)
    for flat, (key, convert) in legacy.items():
        if flat in data:
            if key in retry:
                raise ValueError(f"{flat} and retry.{key} both set; keep retry.{key}")
            retry[key] = convert(data.pop(flat))
    data["retry"] = retry
    return data


class DistributorConfig(_Section):
    """The keys every target shares. Each target (app/targets) adds its own in a
    subclass; HubConfig.distributor is that subclass, chosen by `target`."""

    # jsonl by default: nothing leaves the machine unless the config says where to.
    # tinker needs a tinker.json naming its base_url (checked by serve and worker).
    target: str = "jsonl"
    batch_size: int = Field(32, gt=0)
    min_reward_threshold: float = 5
    # The record each trace becomes in a batch (jsonl and http targets; the tinker
    # target always sends OpenAI chat records, which is what fine-tuning APIs take).
    format: Annotated[str, AfterValidator(_training_record)] = "openai"
    # Send a trace's compressed view where it has one (SFT); false: always the whole trace.
    use_compressed: bool = True
    # Failed deliveries; after retry.max_attempts the batch is `failed`
    # (`atropos batches retry ID` re-queues it).
    retry: DeliveryRetry = Field(default_factory=DeliveryRetry)

    @model_validator(mode="before")
    @classmethod
    def _flat_retry_keys(cls, data: Any) -> Any:
        return _legacy_retry_keys(data, _DISTRIBUTOR_RETRY_KEYS)


class TinkerTargetConfig(DistributorConfig):
    """distributor.target `tinker`: no keys of its own, the service is tinker.json's."""

    target: Literal["tinker"] = "tinker"


class JsonlTargetConfig(DistributorConfig):
    target: Literal["jsonl"] = "jsonl"
    # One training file per batch, plus manifest.jsonl.
    output_dir: HomePath = "~/.atropos/batches"


class HttpTargetConfig(DistributorConfig):
    target: Literal["http"] = "http"
    # Where batches are POSTed, e.g. https://trainer/batches.
    url: str
    http_timeout_seconds: float = Field(60, gt=0)


class AtroposTargetConfig(DistributorConfig):
    """distributor.target `atropos`: passing traces become scored groups in the hub's
    own Atropos queue, served by GET /batch beside the groups envs send
    (docs/distribution.md). Its defaults differ on three shared keys: batch_size 1,
    min_reward_threshold -inf (low rewards are what a group learns from),
    use_compressed false (the trajectory as the model saw it)."""

    target: Literal["atropos"] = "atropos"
    # A trajectory is delivered into its group as soon as it passes.
    batch_size: int = Field(1, gt=0)
    # An RL trainer learns from low rewards too: nothing is held back by reward.
    min_reward_threshold: float = float("-inf")
    # The whole trajectory, as the model saw it: a compressed view is not what it was
    # trained on.
    use_compressed: bool = False
    # The env the hub registers for its own groups once the trainer has started (its
    # desired_name in /status and the dashboard).
    atropos_env: str = Field("hub", min_length=1, max_length=200)
    # Its weight against the other envs' in the batches GET /batch forms.
    atropos_env_weight: float = Field(1.0, gt=0)
    # The least share (0.0-1.0) of every batch its groups should fill; null: none.
    atropos_env_min_batch_allocation: float | None = Field(None, ge=0, le=1)
    # Trajectories of one task (its normalised text, or the `group` given in its
    # metadata or at /v1/rollouts/{id}/finish) that make one group.
    group_size: int = Field(8, ge=1)
    # A group still short of group_size this long after its first trajectory passed is
    # `release`d as it is, or `drop`ped.
    group_timeout_seconds: float = Field(600, gt=0)
    # What becomes of such a group: it enters the queue smaller, or its rollouts are
    # left out (counted as timed_out).
    group_timeout: Literal["release", "drop"] = "release"
    # A rollout's score: the hub's `reward`, or the environment's own `env_reward`.
    score: Literal["reward", "env_reward"] = "reward"
    # A trajectory whose policy_version (a step: `7`, or ending in one: `step-7`) is
    # more than this many steps behind the trainer's is left out; null: never.
    max_policy_lag: int | None = Field(None, ge=0)


# Each target's distributor keys, by distributor.target, in the order config errors list
# them. The config owns every key; app/targets builds each target from its model.
TARGET_CONFIGS: Mapping[str, type[DistributorConfig]] = MappingProxyType({
    "tinker": TinkerTargetConfig,
    "jsonl": JsonlTargetConfig,
    "http": HttpTargetConfig,
    "atropos": AtroposTargetConfig,
})


def _for_its_target(raw: dict[str, Any]) -> DistributorConfig:
    """The distributor section as the config model of the target it names. A key of
    another target is refused unless it holds that key's default or null, as
    config.json.example, which lists every key, has it."""
    name = raw.get("target", DistributorConfig.model_fields["target"].default)
    model = TARGET_CONFIGS.get(name) if isinstance(name, str) else None
    if model is None:
        raise _error("literal_error", "Input should be {expected}", ("target",), name,
                     expected=_either(TARGET_CONFIGS))
    own = model.model_fields
    keys = dict(raw)
    for key, value in raw.items():
        if key in own:
            continue
        owner = next((t for t, m in TARGET_CONFIGS.items() if key in m.model_fields), None)
        if owner is None:
            continue  # no target's key: the model refuses it, below
        if value is not None and value != TARGET_CONFIGS[owner].model_fields[key].default:
            raise _error("not_a_key", "a key of the {owner} target; distributor.target is {target}",
                         (key,), value, owner=owner, target=name)
        del keys[key]
    try:
        config: DistributorConfig = model.model_validate(keys)
    except ValidationError as exc:
        unknown = next((e for e in exc.errors() if e["type"] == "extra_forbidden"), None)
        if unknown is None:
            raise
        raise _error("not_a_key", "unknown key; known keys for target {target}: {known}",
                     unknown["loc"], unknown["input"], target=name, known=", ".join(own)) from None
    return config


def _distributor(value: Any, handler: ValidatorFunctionWrapHandler) -> DistributorConfig:
    if isinstance(value, dict):
        return _for_its_target(value)
    checked: DistributorConfig = handler(value)
    return checked


class LimitsConfig(_Section):
    """What one request may carry, and how much unwritten work the hub holds before it
    answers 503 (docs/access.md)."""

    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    max_traces_per_request: int = Field(1000, gt=0)
    # Steps in one trace, as sent (messages, conversation turns) and once normalised.
    max_steps_per_trace: int = Field(10_000, gt=0)
    # Characters of one step's text (content, arguments, error).
    max_step_chars: int = Field(1_000_000, gt=0)
    # Nesting of one trace's JSON. orjson cannot store more than 254 levels.
    max_json_depth: int = Field(64, gt=1, le=250)
    # The longest an ingest process may spend on one trace (parsing, scoring, counting
    # its tokens): past it the trace is refused with 422 and the process replaced.
    max_item_seconds: float = Field(10, gt=0)
    # The write path: traces admitted but not yet committed. Past it, and while one
    # write transaction has waited longer than max_write_wait_seconds (a lock held by
    # another process, a slow disk), new traces get 503 + Retry-After; so does a trace
    # not committed within max_write_wait_seconds (and it is never written later).
    max_queued_traces: int = Field(10_000, gt=0)
    max_write_wait_seconds: float = Field(5, gt=0)
    retry_after_seconds: int = Field(2, ge=1)
    # Request body bytes (as received, and once gunzipped) all requests may hold at
    # once; past it, 503 with Retry-After (app/ingest/body.py BodyBudget).
    max_body_bytes_in_flight: int = Field(256 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _one_request_fits_the_queue(self) -> LimitsConfig:
        if self.max_traces_per_request > self.max_queued_traces:
            raise ValueError(
                f"max_traces_per_request ({self.max_traces_per_request}) must not exceed "
                f"max_queued_traces ({self.max_queued_traces}): such a request could "
                "never be admitted"
            )
        return self


class AuthConfig(_Section):
    """API keys on /v1/* (docs/access.md). Off by default, so that local use and
    Atropos clients work unchanged."""

    enabled: bool = False
    # Requests per second per key (per client address while auth is off); null: no
    # limit. burst: how many may come at once; null: one second's worth.
    rate_limit_per_second: float | None = Field(None, gt=0)
    rate_limit_burst: int | None = Field(None, gt=0)
    # A verified key is trusted this long before it is looked up again; a revoked
    # key stops working within this time on every hub process.
    key_cache_seconds: float = Field(5, ge=0)
    # How long a dashboard sign-in lasts (its session; logging out ends it sooner).
    session_hours: float = Field(12, gt=0, le=24 * 365)
    # /docs, /redoc and /openapi.json.
    docs_enabled: bool = True
    # Browser origins allowed to call the API (CORS); empty: no CORS headers at all.
    cors_origins: list[str] = Field(default_factory=list)

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"{origin!r}: an origin is scheme://host[:port], or *")
        return [origin.rstrip("/") for origin in value]


class RetentionConfig(_Section):
    """What the worker prunes, once every `every` (`atropos prune` with these options)."""

    older_than: Duration
    # Only traces whose reward is below this (the seed's `reward < 5`); null: any.
    max_reward: float | None = None
    # Only traces in these stages; empty: any stage (never `batched`: NEVER_PRUNED).
    stages: list[Annotated[Stage, Strict(False)]] = Field(default_factory=list)  # names
    every: Duration = Field(default_factory=lambda: timedelta(days=1))
    batch_size: int = Field(1000, gt=0)

    @field_validator("stages")
    @classmethod
    def _prunable(cls, value: list[Stage]) -> list[Stage]:
        for stage in value:
            if stage in NEVER_PRUNED:
                raise ValueError(f"{stage} traces wait for delivery and are never pruned")
        return value


class WorkersConfig(_Section):
    # How long a claimed trace or batch stays with a worker that stopped answering
    # (killed, hung) before another worker may take it.
    lease_seconds: float = Field(30, gt=0)


class RunsConfig(_Section):
    """Training runs (app/runs): the hub starts and watches trainer and environment
    processes. Off by default, because the endpoint spawns processes."""

    enabled: bool = False
    # Each process writes {logs_dir}/{trainer|env_N}_{run_id}.log.
    logs_dir: str = "~/.atropos/logs"
    # ATROPOS_HUB_URL as the run's processes get it; null: the address the request
    # that started the run came in on (an address of this machine that reaches the hub).
    hub_url: str | None = None
    # The user the run's processes run as (the hub must run as root); null: the hub's.
    # Processes of the hub's own user can read its environment (/proc/PID/environ),
    # which holds the model keys the environments are not given.
    user: str | None = None
    # With auth off, runs.enabled lets anyone who reaches the port start processes on
    # this machine: `atropos serve` refuses to start so unless this is true.
    allow_without_auth: bool = False

    @field_validator("user")
    @classmethod
    def _user_exists(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            pwd.getpwnam(value)
        except KeyError:
            raise ValueError(f"no user {value!r} on this machine") from None
        if os.geteuid() != 0:
            raise ValueError(
                "only a hub running as root can start processes as another user; "
                "run the hub as root or remove runs.user"
            )
        return value

    @field_validator("logs_dir")
    @classmethod
    def _expand_home(cls, value: str) -> str:
        return str(Path(value).expanduser())

    @field_validator("hub_url")
    @classmethod
    def _hub_url_is_http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL, e.g. http://10.0.0.5:8000")
        return value.rstrip("/") if value else value


class AtroposConfig(_Section):
    """The Atropos trajectory API (/register, /scored_data, /batch, ...)."""

    # Groups waiting (buffered, queued or in a formed batch not yet served); past
    # this, /scored_data answers 503 with Retry-After instead of growing.
    queue_max_groups: int = Field(100_000, gt=0)
    # The same bound in bytes of stored group JSON (2 GiB); null: no byte limit. A
    # submission larger than this alone could never be queued: 413.
    queue_max_bytes: int | None = Field(2 * 1024**3, gt=0)
    # Groups in one /scored_data_list request, counted before any is parsed; past it 413.
    max_groups_per_request: int = Field(10_000, gt=0)
    # How long a batch handed out with GET /batch?ack=1 waits for POST /batch/ack
    # before it is served again.
    ack_timeout_seconds: float = Field(60, gt=0)
    retry_after_seconds: int = Field(5, ge=1)
    # Serve invented inference_logprobs (1.0 at prompt positions, 0.0 elsewhere) for
    # groups sent without any. Off: a trainer that computes importance ratios against
    # them optimises a different objective without knowing (docs/atropos.md).
    fill_missing_logprobs: bool = False
    # An env not heard from (/scored_data, /scored_data_list, /status-env) for this
    # long stops counting for weights and minimum allocations until it is heard again:
    # atroposlib's envs never disconnect, and a dead one would hold batches back.
    env_timeout_seconds: float = Field(120, gt=0)
    # API keys on the Atropos paths too (environments `ingest`, trainers `train`);
    # null: on whenever auth.enabled is. false with auth on leaves them open (said at
    # start-up), for atroposlib's clients, which send no key.
    require_key: bool | None = None

    def keys_required(self, auth: AuthConfig) -> bool:
        """Whether the Atropos paths take API keys under `auth`."""
        return auth.enabled if self.require_key is None else self.require_key and auth.enabled


def _re2_pattern(pattern: str) -> str:
    compile_pattern(pattern)
    return pattern


class PrivacyConfig(_Section):
    """What is redacted from every trace and Atropos group before it is stored
    (app/evaluation/redaction.py; docs/privacy.md)."""

    redact_secrets: bool = True
    redact_emails: bool = False
    # RE2 patterns; each match becomes [REDACTED:custom].
    extra_patterns: list[Annotated[str, AfterValidator(_re2_pattern)]] = Field(
        default_factory=list
    )


class OtlpConfig(_Section):
    """OTLP/HTTP traces on the ingest path (docs/otlp.md): when a trace's spans become
    one trajectory."""

    # After its root span has ended, a trace is assembled once no span of it has
    # arrived for this long.
    quiet_seconds: float = Field(10, gt=0)
    # ... or this long after its first span at the latest (root span or not; marked
    # incomplete when the root span is missing).
    max_wait_seconds: float = Field(600, gt=0)
    # When the traces come due faster than they are assembled (the machine's CPU is
    # the limit), new spans get 503 with Retry-After once the oldest trace due has
    # waited this long, until the assembly catches up: exporters retry, and a
    # trajectory appears within about quiet_seconds + this after its run ends.
    max_assembly_lag_seconds: float = Field(1, gt=0)
    # Spans in one request (and groups of them: resource and scope), counted before
    # any is read; past it, 413. Exporters send 512 at a time by default.
    max_spans_per_request: int = Field(10_000, gt=0)
    # A trajectory is made of at most this many of its trace's spans, and this many
    # bytes of them (as stored, protobuf), the first by start time: what an agent run
    # may cost the assembly in memory. A trajectory that leaves spans out says so
    # (metadata.truncated).
    max_spans_per_trace: int = Field(10_000, gt=0)
    max_bytes_per_trace: int = Field(32 * 2**20, gt=0)


def _http_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8001/v1")
    return value.rstrip("/") if value else value


HttpUrl = Annotated[str, AfterValidator(_http_url)]


class GatewayUpstream(_Section):
    """Where the gateway sends calls; each key defaults to the tinker section's."""

    base_url: HttpUrl | None = None
    # The name of the environment variable holding the upstream's key, never the key.
    api_key_env: str | None = None


class GatewayRoute(_Section):
    """A rule for calls naming `model` (`"*"`: any): the model name sent upstream, the
    upstream, fields added to (or dropped from) the request, the policy version."""

    model: str = Field(min_length=1)
    upstream_model: str | None = None
    base_url: HttpUrl | None = None
    api_key_env: str | None = None
    add: dict[str, Any] = Field(default_factory=dict)
    drop: list[str] = Field(default_factory=list)
    # The policy version serving this route's calls, recorded on each; without it,
    # the Atropos trainer's current step when one is registered.
    version: str | None = None

    @model_validator(mode="after")
    def _add_or_drop(self) -> GatewayRoute:
        both = sorted(set(self.add) & set(self.drop))
        if both:
            raise ValueError(f"{', '.join(both)}: a field is added or dropped, not both")
        if "model" in self.add or "model" in self.drop:
            raise ValueError("the model is rewritten with upstream_model, not add or drop")
        return self


class GatewayConfig(_Section):
    """The OpenAI-compatible model endpoint (docs/gateway.md): calls forwarded to the
    upstream and captured, each rollout one trajectory."""

    enabled: bool = False
    upstream: GatewayUpstream = Field(default_factory=GatewayUpstream)
    # First match wins; a call no route matches goes to `upstream` unchanged.
    routes: list[GatewayRoute] = Field(default_factory=list)
    # A rollout with no call for this long closes by itself (a finish closes it now).
    quiet_seconds: float = Field(30, gt=0)


class HubConfig(_Section):
    """config.json"""

    trace_server: TraceServerConfig = Field(default_factory=TraceServerConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    distributor: Annotated[DistributorConfig, WrapValidator(_distributor)] = Field(
        default_factory=lambda: _for_its_target({})
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    atropos: AtroposConfig = Field(default_factory=AtroposConfig)
    runs: RunsConfig = Field(default_factory=RunsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    otlp: OtlpConfig = Field(default_factory=OtlpConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    # Absent: nothing is pruned but by `atropos prune`.
    retention: RetentionConfig | None = None

    @model_validator(mode="after")
    def _keys_need_auth(self) -> HubConfig:
        if self.atropos.require_key and not self.auth.enabled:
            raise _error("not_a_key", "needs auth.enabled: true (without it no key is checked)",
                         ("atropos", "require_key"), True)
        return self


PreservedField = Literal["user_instruction", "final_action", "reward_signal", "error_context"]
DroppedField = Literal["intermediate_thoughts", "repeated_observations", "redundant_tool_outputs"]


class CompressionConfig(_Section):
    enabled: bool = True
    ratio: float = Field(0.3, gt=0, le=1)
    min_tokens_after: int = Field(500, ge=0)
    max_tokens_after: int = Field(8000, gt=0)
    # A trace is compressed only when that saves at least this share of its tokens;
    # otherwise it is kept whole (compression_skipped, with the saving it would have had).
    min_saving: float = Field(0.1, ge=0, lt=1)
    strategy: Literal["key_decision_extract", "summarize_middle"] = "key_decision_extract"
    preserve_fields: list[PreservedField] = Field(
        default_factory=lambda: list(get_args(PreservedField))
    )
    drop_fields: list[DroppedField] = Field(default_factory=lambda: list(get_args(DroppedField)))
    dedup_window: int = Field(5, ge=0)
    # summarize_middle: turns kept verbatim at the end, and the summary's size (Hermes'
    # trajectory_compressor defaults).
    protect_last_n_turns: int = Field(4, ge=0)
    summary_target_tokens: int = Field(750, gt=0)
    # A trace whose compression failed (a strategy error, the model unreachable) is
    # retried so, then `compression_failed` with its error.
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    # summarize_middle while the model fails: the trace is retried by `retry` (size it
    # to the outages to ride out), and after its last attempt `retry` leaves it
    # compression_failed with the model's error, `fallback` compresses it with
    # key_decision_extract instead (counted in /v1/stats as compression.fallbacks).
    on_model_failure: Literal["retry", "fallback"] = "retry"
    # summarize_middle: model calls in flight at once, per worker. Traces that need no
    # call (skips) never wait for them.
    max_concurrent_calls: int = Field(4, gt=0)

    @field_validator("drop_fields", mode="before")
    @classmethod
    def _system_prompt_stays(cls, value: Any) -> Any:
        if isinstance(value, list) and "system_prompt" in value:
            raise ValueError(
                "'system_prompt' cannot be dropped: compression never alters the system "
                "prompt (it defines the tools and the policy every step follows); remove "
                "it from drop_fields"
            )
        return value

    @model_validator(mode="after")
    def _bounds_ordered(self) -> CompressionConfig:
        if self.min_tokens_after > self.max_tokens_after:
            raise ValueError(
                f"min_tokens_after ({self.min_tokens_after}) must not exceed "
                f"max_tokens_after ({self.max_tokens_after})"
            )
        return self


class CompressionFile(_Section):
    """compression.json"""

    compression: CompressionConfig = Field(default_factory=CompressionConfig)


class TinkerConfig(_Section):
    base_url: str = "https://api.openai.com/v1"
    # The name of the environment variable that holds the key; never the key itself.
    api_key_env: str = "OPENAI_API_KEY"
    model_id: str = "Qwen/Qwen3-8B"
    training_mode: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(32, gt=0)
    learning_rate: float = Field(4e-5, gt=0)
    epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    # The model endpoint client (app/llm.py): per-request timeout, and the retries of
    # 429, 5xx and timeouts (the stages' policy, its own defaults).
    timeout_seconds: float = Field(60, gt=0)
    retry: ModelRetry = Field(default_factory=ModelRetry)
    # Training (the tinker target and `atropos train`): `openai` is an OpenAI-compatible
    # fine-tuning API at base_url; `tinker` is Thinking Machines' SDK (pip extra).
    backend: Literal["openai", "tinker"] = "openai"
    logs_dir: HomePath = "~/.atropos/logs"
    poll_interval_seconds: float = Field(10, gt=0)
    job_timeout_seconds: float = Field(86400, gt=0)
    # The tinker backend: a Hugging Face tokenizer for traces that carry no token ids.
    tokenizer: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _flat_retry_keys(cls, data: Any) -> Any:
        return _legacy_retry_keys(data, _MODEL_RETRY_KEYS)

    def api_key(self) -> str | None:
        value = os.environ.get(self.api_key_env)
        return value.strip() if value is not None else None


class TinkerFile(_Section):
    """tinker.json"""

    tinker: TinkerConfig = Field(default_factory=TinkerConfig)


M = TypeVar("M", bound=BaseModel)


def load_config(path: str | Path | None) -> HubConfig:
    """config.json at `path`; None: the built-in defaults (environment overrides apply
    to either)."""
    return _load(path, HubConfig, "config.json")


def load_compression(path: str | Path | None) -> CompressionFile:
    return _load(path, CompressionFile, "compression.json")


def load_tinker(path: str | Path | None) -> TinkerFile:
    return _load(path, TinkerFile, "tinker.json")


def _load(given: str | Path | None, model: type[M], default_name: str) -> M:
    raw = {} if given is None else _read(Path(given), model)
    name = default_name if given is None else Path(given).name
    overridden = _apply_env_overrides(raw, model, name)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        var = overridden.get((str(loc[0]), str(loc[1]))) if len(loc) > 1 else None
        raise ConfigError(_describe(f"environment variable {var}" if var else name, exc)) from None


def _read(path: Path, model: type[M]) -> dict[str, Any]:
    name = path.name
    path = path.expanduser()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{name}: file not found at {path}; pass the right path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{name}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: must be a JSON object with sections {_sections(model)}")
    return raw


def _either(names: Iterable[str]) -> str:
    """'a', 'b' or 'c', as pydantic lists a Literal's values."""
    *first, last = [f"'{name}'" for name in names]
    return f"{', '.join(first)} or {last}" if first else last


def _error(
    kind: str, message: str, loc: tuple[int | str, ...], value: Any, **context: Any
) -> ValidationError:
    """A validation error at `loc` (within the value being validated)."""
    detail: InitErrorDetails = {
        "type": PydanticCustomError(kind, message, context), "loc": loc, "input": value
    }
    return ValidationError.from_exception_data("DistributorConfig", [detail])


def _sections(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _apply_env_overrides(
    raw: dict[str, Any], model: type[BaseModel], name: str
) -> dict[tuple[str, str], str]:
    """Each ATROPOS_<SECTION>__<KEY> of this file into `raw`; which variable set which
    key, so that a bad value is blamed on the variable. A variable naming no section
    of any config file is a typo: refused."""
    overridden: dict[tuple[str, str], str] = {}
    for var, value in os.environ.items():
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        section, _, key = var[len(ENV_PREFIX) :].lower().partition("__")
        if not any(section in m.model_fields for m in _MODELS.values()):
            known = ", ".join(f"{ENV_PREFIX}{s.upper()}__" for m in _MODELS.values()
                              for s in m.model_fields)
            raise ConfigError(
                f"environment variable {var}: no config section {section!r}; "
                f"overrides are {ENV_PREFIX}<SECTION>__<KEY> with a section among {known}"
            )
        if section not in model.model_fields:
            continue  # a key of another config file
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{name}: {section} must be an object (overridden by {var})")
        target[key] = _env_value(model, section, key, value)
        overridden[(section, key)] = var
    return overridden


def _env_value(model: type[BaseModel], section: str, key: str, value: str) -> Any:
    """The variable's text as JSON when it parses (numbers, booleans, lists), except
    for a key that wants text (a port-like password stays a string)."""
    owner = model.model_fields[section].annotation
    field = owner.model_fields.get(key) if _is_model(owner) else None
    if field is not None and _wants_text(field.annotation):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _wants_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Annotated:
        return _wants_text(get_args(annotation)[0])
    args = [a for a in get_args(annotation) if a is not type(None)]
    return get_origin(annotation) in (Union, UnionType) and args == [str]


def _describe(name: str, exc: ValidationError) -> str:
    """One line: the file, the key, the problem and what would fix it."""
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "not_a_key":
        problem = err["msg"]
    elif kind == "extra_forbidden":
        parent = err["loc"][:-1]
        known = _known_keys(exc.title, parent)
        hint = f"; known keys: {', '.join(known)}" if known else ""
        problem = f"unknown key{hint}"
    else:
        problem = err["msg"]
        if "input" in err and kind not in ("missing",):
            problem += f" (got {json.dumps(err['input'], default=str)[:80]})"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{name}: {key}: {problem}{more}"


_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m for m in (HubConfig, CompressionFile, TinkerFile)
}


def _known_keys(title: str, loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] | None = _MODELS.get(title)
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return list(model.model_fields) if model else []


@dataclass(frozen=True)
class Settings:
    """The three config files, loaded and checked once."""

    config: HubConfig
    compression: CompressionFile
    tinker: TinkerFile
