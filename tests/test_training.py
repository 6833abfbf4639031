"""Training: the tinker target and `atropos train` against a fake OpenAI-compatible
server with files, fine_tuning/jobs and chat/completions on 127.0.0.1; the tinker SDK
backend at the SDK boundary, with a fake client object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from app.config import TinkerConfig
from app.domain import Trace
from app.targets import Batch, BatchItem
from app.targets.tinker import TinkerTarget
from app.training import Example, TrainerLog, TrainingFailed, TrainingRun
from app.training.openai_api import OpenAIFineTuning
from app.training.tinker_sdk import TinkerSDK
from tests.support import ROOT
from tests.support.builders import native_trace
from tests.support.fakes.model_server import FakeModel
from tests.support.hubs import InProcessHub, write_config
from tests.support.pipeline import set_rewards
from tests.support.processes import HubProcess, WorkerProcess, run_cli
from tests.support.waiting import wait_until

KEY = FakeModel.key
KEY_ENV = "FAKE_TRAINING_KEY"
SMOKE_LINE = "Model request completed: status=200, tokens=120"


@pytest.fixture
def fake(fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    monkeypatch.setenv(KEY_ENV, fake_model.key)
    return fake_model


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def tinker(model_root: str, tmp_path: Path, **overrides: Any) -> TinkerConfig:
    return TinkerConfig.model_validate({
        "base_url": f"{model_root}/v1", "api_key_env": KEY_ENV, "model_id": "base/model-8b",
        "poll_interval_seconds": 0.02, "max_retries": 0, "logs_dir": str(tmp_path / "logs"),
        **overrides,
    })


def tinker_file(model_root: str, tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "tinker.json"
    path.write_text(json.dumps({"tinker": tinker(model_root, tmp_path, **overrides).model_dump()}))
    return path


class Receipts:
    """The `save` callback, keeping what a delivery stage would have in the database."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    async def __call__(self, receipt: dict[str, Any]) -> None:
        self.saved = json.loads(json.dumps(receipt))


EXAMPLES = [Example({"messages": [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "4"}]})] * 2


async def test_tinker_target_trains_each_batch_and_smoke_tests_the_model(
    fake: FakeModel, model_root: str, tmp_path: Path
) -> None:
    trace_server = {"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db")}
    config = write_config(tmp_path, trace_server,
                          distributor={"target": "tinker", "batch_size": 2,
                                       "min_reward_threshold": 0})
    hub = InProcessHub(config, "--no-workers", "--tinker",
                       str(tinker_file(model_root, tmp_path))).start()
    try:
        with hub.client() as client:
            for t in ("m1", "m2"):
                assert client.post("/v1/traces", json=native_trace(trace_id=t)).status_code == 202
        await set_rewards(trace_server, {"m1": 1.0, "m2": 1.0})
        hub.drain()  # the delivery stage trains, as `atropos worker --burst` would
        with hub.client() as client:
            [batch] = client.get("/v1/batches").json()["batches"]
    finally:
        hub.stop()

    assert batch["state"] == "delivered" and batch["target"] == "tinker"
    job = batch["receipt"]["job"]
    assert job["state"] == "succeeded" and job["model"] == f"ft:base/model-8b:{batch['batch_id']}"
    assert batch["receipt"]["smoke"]["model"] == job["model"]
    [upload] = fake.files.values()
    lines = [json.loads(line) for line in upload.decode().splitlines()]
    assert len(lines) == 2 and all(line["messages"][0]["role"] == "user" for line in lines)
    created = next(r for r in fake.received if r.path == "/v1/fine_tuning/jobs" and r.body)
    assert created.headers["idempotency-key"] == batch["batch_id"]
    assert created.body["metadata"] == {"idempotency_key": batch["batch_id"]}
    assert created.body["model"] == "base/model-8b"
    assert created.body["hyperparameters"] == {
        "n_epochs": 1, "batch_size": 32, "learning_rate": 4e-5, "training_mode": "lora",
        "lora_rank": 32}
    smoke = [r for r in fake.received if r.path == "/v1/chat/completions"]
    assert [r.body["model"] for r in smoke] == [job["model"]]
    log = (tmp_path / "logs" / f"trainer_{batch['batch_id']}.log").read_text()
    assert SMOKE_LINE in log and f"job {job['id']}: validating_files -> running" in log
    assert SMOKE_LINE in hub.log


async def test_a_redelivery_resumes_the_job_instead_of_training_twice(
    fake: FakeModel, model_root: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    backend = OpenAIFineTuning(tinker(model_root, tmp_path), http)
    receipts = Receipts()

    async def crash_once_the_job_exists(receipt: dict[str, Any]) -> None:
        await receipts(receipt)
        if "job" in receipt:
            raise ConnectionError("worker died")

    with TrainerLog(tmp_path, "r1") as log:
        with pytest.raises(ConnectionError):
            await backend.train(TrainingRun(EXAMPLES, "b-1", {}, crash_once_the_job_exists, log))
        job = await backend.train(TrainingRun(EXAMPLES, "b-1", receipts.saved, receipts, log))
        # Even with the receipt lost, the job is found by its idempotency key.
        again = await backend.train(TrainingRun(EXAMPLES, "b-1", {}, receipts, log))
    assert len(fake.jobs) == 1 and len(fake.files) == 1
    assert job["state"] == again["state"] == "succeeded" and job["id"] == again["id"]


async def test_a_failed_job_fails_the_attempt_and_the_next_starts_a_new_job(
    fake: FakeModel, model_root: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    fake.job_outcome = "failed"
    backend = OpenAIFineTuning(tinker(model_root, tmp_path), http)
    receipts = Receipts()
    with TrainerLog(tmp_path, "r2") as log:
        with pytest.raises(TrainingFailed, match="ended failed: scripted failure"):
            await backend.train(TrainingRun(EXAMPLES, "b-2", {}, receipts, log))
        fake.job_outcome = "succeeded"
        job = await backend.train(TrainingRun(EXAMPLES, "b-2", receipts.saved, receipts, log))
    assert job["state"] == "succeeded" and len(fake.jobs) == 2
    assert [j["metadata"]["idempotency_key"] for j in fake.jobs.values()] == ["b-2", "b-2.1"]
    assert receipts.saved["failed_jobs"][0]["state"] == "failed"
    assert len(fake.files) == 1  # the uploaded file is reused


@pytest.mark.process
def test_atropos_train_runs_one_job_from_a_dataset(
    fake: FakeModel, model_root: str, tmp_path: Path
) -> None:
    dataset = tmp_path / "dataset.jsonl"
    sharegpt = {"conversations": [{"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}]}
    dataset.write_text("\n".join(json.dumps(r) for r in [*(e.record for e in EXAMPLES), sharegpt]))
    out = tmp_path / "run"
    done = run_cli("train", "--config", str(tinker_file(model_root, tmp_path, epochs=3)),
                   "--dataset", str(dataset), "--output", str(out), env={KEY_ENV: KEY})
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "job.json").read_text())
    job = record["receipt"]["job"]
    assert job["state"] == "succeeded" and job["model"].startswith("ft:base/model-8b:")
    assert f"job {job['id']} succeeded" in done.stdout
    assert json.loads((out / "hyperparameters.json").read_text())["n_epochs"] == 3
    [log] = out.glob("trainer_*.log")
    assert log.name == f"trainer_{record['run_id']}.log" and SMOKE_LINE in log.read_text()
    [upload] = fake.files.values()
    assert [json.loads(line)["messages"][-1]["content"] for line in upload.splitlines()] == [
        "4", "4", "hello"]

    fake.job_outcome = "failed"
    failed = run_cli("train", "--config", str(tinker_file(model_root, tmp_path)),
                     "--dataset", str(dataset), "--output", str(tmp_path / "run2"),
                     env={KEY_ENV: KEY})
    assert failed.returncode == 1 and "training failed" in failed.stderr


# --- the tinker SDK backend, at the SDK boundary ----------------------------------


@dataclass
class _Future:
    value: Any = None

    async def result_async(self) -> Any:
        return self.value


@dataclass
class FakeTrainingClient:
    calls: list[tuple[str, Any]] = field(default_factory=list)

    async def forward_backward_async(self, data: list[Any], loss_fn: str) -> _Future:
        self.calls.append(("forward_backward", (data, loss_fn)))
        return _Future(SimpleNamespace(metrics={"loss:sum": 1.0}))

    async def optim_step_async(self, adam: Any) -> _Future:
        self.calls.append(("optim_step", adam))
        return _Future()

    async def save_state_async(self, name: str) -> _Future:
        self.calls.append(("save_state", name))
        return _Future(SimpleNamespace(path=f"tinker://run/state/{name}"))

    async def load_state_with_optimizer_async(self, path: str) -> _Future:
        self.calls.append(("load_state_with_optimizer", path))
        return _Future()

    async def save_weights_for_sampler_async(self, name: str) -> _Future:
        self.calls.append(("save_weights_for_sampler", name))
        return _Future(SimpleNamespace(path=f"tinker://run/sampler_weights/{name}"))


@dataclass
class FakeService:
    client: FakeTrainingClient = field(default_factory=FakeTrainingClient)
    created: list[dict[str, Any]] = field(default_factory=list)

    async def create_lora_training_client_async(self, **kwargs: Any) -> FakeTrainingClient:
        self.created.append(kwargs)
        return self.client

    async def create_training_client_from_state_async(self, path: str) -> FakeTrainingClient:
        self.created.append({"state": path})
        return self.client


FAKE_SDK = SimpleNamespace(types=SimpleNamespace(
    Datum=lambda **kw: SimpleNamespace(**kw),
    ModelInput=SimpleNamespace(from_ints=lambda tokens: ("ints", list(tokens))),
    AdamParams=lambda **kw: SimpleNamespace(**kw),
))


class FakeTokenizer:
    """Each message renders as [its role's id, one id per character]."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        roles = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
        return [t for m in messages
                for t in [roles[m["role"]], *(ord(c) for c in m.get("content") or "")]]


async def test_tinker_sdk_trains_lora_with_adam_then_saves_and_smoke_tests(
    fake: FakeModel, model_root: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    config = tinker(model_root, tmp_path, backend="tinker", epochs=2, batch_size=1, lora_rank=8,
                    learning_rate=1e-4)
    service = FakeService()
    backend = TinkerSDK(config, sdk=FAKE_SDK, service=service, tokenizer=FakeTokenizer())
    with_tokens = native_trace(metadata={"tokens": [5, 6, 7, 8], "masks": [-100, -100, 7, 8]})
    items = [BatchItem("s1", 1.0, Trace.model_validate(with_tokens), compressed=False),
             BatchItem("s2", 1.0, Trace.model_validate(native_trace()), compressed=False)]
    batch = Batch("b-sdk", datetime.now(UTC), 1, items, {})
    receipts = Receipts()
    receipt = await TinkerTarget(config, http, backend).deliver(batch, receipts)

    assert service.created == [{"base_model": "base/model-8b", "rank": 8}]
    calls = service.client.calls
    steps = [c for c in calls if c[0] == "forward_backward"]
    assert len(steps) == 4 and all(loss == "cross_entropy" for _, (_, loss) in steps)
    assert [c[1].learning_rate for c in calls if c[0] == "optim_step"] == [1e-4] * 4
    first = steps[0][1][0][0]  # token ids from the trace: shifted by one, masks as weights
    assert first.model_input == ("ints", [5, 6, 7])
    assert first.loss_fn_inputs == {"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 1.0]}
    second = steps[1][1][0][0]  # rendered with the tokenizer: assistant turns weigh 1
    weights = second.loss_fn_inputs["weights"]
    assert 0.0 in weights and 1.0 in weights
    # Each step's state is saved as it is done; the last one is the result.
    assert [c[1] for c in calls if c[0] == "save_state"] == [f"b-sdk-step-{n}" for n in (1, 2, 3, 4)]
    assert calls[-1] == ("save_weights_for_sampler", "b-sdk")
    assert receipts.saved["progress"]["steps_done"] == 4
    model = "tinker://run/sampler_weights/b-sdk"
    assert receipt["job"]["model"] == model and receipt["smoke"]["model"] == model
    assert fake.received[-1].body["model"] == model
    assert SMOKE_LINE in (tmp_path / "logs" / "trainer_b-sdk.log").read_text()

    # A redelivery after the steps loads the saved state and trains nothing again.
    service.client.calls.clear()
    again = Batch("b-sdk", batch.created_at, 2, items, receipts.saved)
    await TinkerTarget(config, http, backend).deliver(again, receipts)
    assert service.created[-1] == {"state": "tinker://run/state/b-sdk-step-4"}
    assert [c[0] for c in service.client.calls] == ["save_weights_for_sampler"]


FAKE_SDK_PACKAGE = Path(__file__).parent / "support" / "fakes" / "tinker_sdk"  # `import tinker` there


@pytest.mark.process
def test_a_worker_killed_mid_steps_resumes_at_the_next_step(
    fake: FakeModel, model_root: str, tmp_path: Path
) -> None:
    """The tinker SDK backend trained a batch again from the start when its worker was
    killed mid-steps. The steps done are recorded with the batch in the
    database; the next worker loads the state of the last one and goes on from there,
    so each step of the batch is trained once."""
    trace_server = {"storage_backend": "sqlite", "db_path": str(tmp_path / "t.db"),
                    "flush_interval_seconds": 0.2}
    config = write_config(tmp_path, trace_server, workers={"lease_seconds": 2},
                          distributor={"target": "tinker", "batch_size": 3,
                                       "min_reward_threshold": -1e9})
    tinker_json = tinker_file(model_root, tmp_path, backend="tinker", batch_size=1, epochs=2)
    events, hang = tmp_path / "events.jsonl", tmp_path / "hang"
    env = {KEY_ENV: KEY, "PYTHONPATH": f"{ROOT}:{FAKE_SDK_PACKAGE}", "FAKE_TINKER_EVENTS": str(events),
           "FAKE_TINKER_HANG": str(hang), "FAKE_TINKER_HANG_AT": "4"}
    hang.touch()

    def calls() -> list[dict[str, Any]]:
        text = events.read_text() if events.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    hub = HubProcess(config, "--no-workers").start()
    workers: list[HubProcess] = []
    try:
        with hub.client() as client:
            for i in range(3):  # token ids of their own: no tokenizer needed
                trace = native_trace(trace_id=f"s{i}", metadata={
                    "tokens": [10 * i + 1, 10 * i + 2, 10 * i + 3], "masks": [-100, 1, 1]})
                assert client.post("/v1/traces", json=trace).status_code == 202
            first = WorkerProcess(config, "--tinker", str(tinker_json), env=env).start()
            workers.append(first)
            wait_until(lambda: any(c["call"] == "hang" for c in calls()), timeout=60,
                       what="the first worker at step 4")
            first.kill()  # kill -9 during the steps
            hang.unlink()
            workers.append(WorkerProcess(config, "--tinker", str(tinker_json), env=env).start())
            [batch] = wait_until(
                lambda: [b for b in client.get("/v1/batches").json()["batches"]
                         if b["state"] == "delivered"], timeout=60, what="the batch delivered")
    finally:
        for process in [hub, *workers]:
            process.kill()

    done = calls()
    trained = [c["step"] for c in done if c["call"] == "forward_backward"]
    assert trained == [1, 2, 3, 4, 5, 6], "a step was trained twice"
    assert [c["path"] for c in done if c["call"] == "load_state_with_optimizer"] == [
        f"tinker://fake/state/{batch['batch_id']}-step-3?steps=3"]
    assert batch["receipt"]["progress"]["steps_done"] == 6
    # The weights served hold six steps: two epochs of three examples, once each.
    assert batch["receipt"]["job"]["model"].endswith("?steps=6")
    assert batch["receipt"]["smoke"]["status"] == 200


async def test_tinker_sdk_without_token_ids_or_tokenizer_says_what_to_set(
    fake: FakeModel, model_root: str, tmp_path: Path
) -> None:
    backend = TinkerSDK(tinker(model_root, tmp_path, backend="tinker"), sdk=FAKE_SDK,
                        service=FakeService())
    with TrainerLog(tmp_path, "r3") as log, pytest.raises(TrainingFailed, match="tinker.tokenizer"):
        await backend.train(TrainingRun(EXAMPLES, "k", {}, Receipts(), log))
