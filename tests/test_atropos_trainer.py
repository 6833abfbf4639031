"""atroposlib's own code consumes the hub's groups: its example trainer's
`register_trainer`, `get_batch` and `pad_data_to_good_offset` (atroposlib 0.4.0 ships
them in the wheel as the top-level package `example_trainer`), run in a process of
their own with atroposlib from PyPI (tests/support/atroposlib.py,
tests/support/atroposlib_clients/), take groups made from (a) POSTed OpenAI chats
rendered with a chat template built offline and (b) gateway captures with their exact
ids and logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.conftest import StartHub
from tests.support.atroposlib import install_trainer_and_env, installed_for_tests
from tests.support.fakes.vllm_server import END, FakeVllm, prompt_ids, rendered, text_ids
from tests.support.waiting import wait_until
from tests.test_atropos_groups import (
    EVERY_TRACE_PASSES,
    ROLLOUT_REWARDS,
    chat,
    gateway_hub,
    hub_figures,
    run_rollouts,
)

# Each test runs atroposlib's clients as processes of their own (torch, wandb to import).
pytestmark = pytest.mark.process

CLIENTS = Path(__file__).parent / "support" / "atroposlib_clients"
TRAINER, ENV = CLIENTS / "trainer.py", CLIENTS / "env.py"
MASKED = -100


@pytest.fixture(scope="session")
def atroposlib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_for_tests(install_trainer_and_env, "atroposlib-trainer", tmp_path_factory)


class Trainer:
    """atroposlib's example trainer functions in a process of their own, one for the
    session's tests (tests/support/atroposlib_clients/trainer.py)."""

    def __init__(self, atroposlib_dir: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as stderr:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, str(TRAINER)],
                env={**os.environ, "PYTHONPATH": str(atroposlib_dir), "WANDB_MODE": "disabled"},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
            )

    def __call__(self, *args: str) -> Any:
        """The JSON the trainer answers a call with."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            kind, _, answer = line.partition(" ")
            if kind == "ANSWER":
                return json.loads(answer)
            assert kind != "FAILED", json.loads(answer)[-3000:]
        raise AssertionError(f"the trainer process ended: exit code {self.proc.wait()}\n"
                             f"{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


@pytest.fixture(scope="session")
def trainer(atroposlib_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    started = Trainer(atroposlib_dir, tmp_path_factory.mktemp("trainer") / "stderr.log")
    yield started
    started.close()


def base_env(atroposlib_dir: Path, *args: str) -> Any:
    """atroposlib's BaseEnv run by its env_manager, in a process of its own: the JSON
    it prints last."""
    done = subprocess.run(
        [sys.executable, str(ENV), *args],
        env={**os.environ, "PYTHONPATH": str(atroposlib_dir), "WANDB_MODE": "disabled"},
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def normalised(scores: list[float]) -> list[float]:
    """The advantages the trainer's GRPO step reads: a group's scores less their mean,
    over their standard deviation."""
    mean = sum(scores) / len(scores)
    std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
    return [(s - mean) / max(std, 1e-8) for s in scores]


def check_padded(taken: dict[str, Any], row: int, sequence: list[int]) -> list[int]:
    """The trainer's input ids for a sequence are its tokens, padded with 0 (the padded
    row less its last position, for the causal shift); returns its labels (the masks
    shifted by one, padded with -100) up to its end."""
    (tokens,), (labels,) = taken["tokens"], taken["labels"]
    n = min(len(sequence), len(tokens[row]))
    assert tokens[row][:n] == sequence[:n]
    assert set(tokens[row][n:]) <= {0}
    assert set(labels[row][len(sequence) - 1:]) <= {MASKED}
    return list(labels[row][: len(sequence) - 1])


def test_atroposlibs_example_trainer_takes_posted_chats_rendered_with_the_chat_template(
    start_hub: StartHub, trace_server: dict[str, Any], tokenizer_dir: Path,
    tinker_args: list[str], atroposlib_dir: Path, trainer: Trainer, tmp_path: Path,
) -> None:
    hub = start_hub(trace_server, *tinker_args, listen=True,
                    distributor={"target": "atropos", "group_size": 4},
                    environment=EVERY_TRACE_PASSES)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    started = trainer("register", hub.url, "4", str(tmp_path / "checkpoints"))
    assert started == {"batch": None}
    sent: dict[str, tuple[list[dict[str, Any]], float]] = {}
    with hub.client() as client:
        for i, env_reward in enumerate((0.0, 0.5, 1.0, 0.25)):
            messages = chat("What is two plus two?", f"Answer {i}: it is four.")
            r = client.post("/v1/traces", json={"format": "openai", "trace_id": f"p{i}",
                                                "messages": messages, "reward": env_reward})
            assert r.status_code == 202, r.text
            sent[f"p{i}"] = (messages, r.json()["reward"])
        wait_until(lambda: hub_figures(client)["groups"] == 1, 30, what="the group formed")

    taken = trainer("take", hub.url, "4")
    (group,) = taken["batch"]
    trace_ids = group["group_overrides"]["trace_ids"]
    assert sorted(trace_ids) == sorted(sent)
    rewards = [sent[t][1] for t in trace_ids]
    assert group["scores"] == rewards and len(set(rewards)) == 4
    for row, trace_id in enumerate(trace_ids):
        messages, sequence = sent[trace_id][0], group["tokens"][row]
        assert tokenizer.decode(sequence) == tokenizer.apply_chat_template(
            messages, tokenize=False)
        labels = check_padded(taken, row, sequence)
        assert labels == group["masks"][row][1:]
        trained = [t for t, label in zip(sequence[1:], labels) if label != MASKED]
        assert tokenizer.decode(trained) == "".join(
            f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
    (advantages,) = taken["advantages"]
    assert advantages == pytest.approx(normalised(rewards), rel=1e-5)
    assert taken["logprobs"] is None  # none captured, none invented


def test_atroposlibs_example_trainer_takes_gateway_rollouts_with_their_exact_ids(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    monkeypatch: pytest.MonkeyPatch, trainer: Trainer, tmp_path: Path,
) -> None:
    hub = gateway_hub(start_hub, trace_server, upstream, monkeypatch)
    assert trainer("register", hub.url, "3", str(tmp_path / "checkpoints")) == {"batch": None}
    with hub.client() as client:
        conversations = run_rollouts(hub, client)
        wait_until(lambda: hub_figures(client)["groups"] == 1, 30, what="the group formed")
    rewards = ROLLOUT_REWARDS

    taken = trainer("take", hub.url, "3", "--logprobs")
    (group,) = taken["batch"]
    trace_ids = group["group_overrides"]["trace_ids"]
    assert sorted(trace_ids) == sorted(rewards)
    assert group["scores"] == [rewards[t] for t in trace_ids]
    (served_logprobs,) = taken["logprobs"]
    for row, trace_id in enumerate(trace_ids):
        messages, sequence = conversations[trace_id], group["tokens"][row]
        # The ids the model saw and made, in the upstream's own tokenization: the
        # conversation up to the answer, then the answer as generated.
        assert sequence == prompt_ids(messages[:-1]) + text_ids(rendered(messages[-1])) + [END]
        labels = check_padded(taken, row, sequence)
        assert labels == group["masks"][row][1:]
        trained = [t for t, label in zip(sequence[1:], labels) if label != MASKED]
        assert trained == [t for m in messages if m["role"] == "assistant"
                           for t in [*text_ids(rendered(m)), END]]
        # The captured logprobs, aligned with the labels as the GRPO loss reads them.
        logprobs = group["inference_logprobs"][row]
        assert len(logprobs) == len(sequence)
        assert served_logprobs[row][: len(sequence) - 1] == pytest.approx(logprobs[1:])
    (advantages,) = taken["advantages"]
    assert advantages == pytest.approx(normalised(group["scores"]), rel=1e-5)


def test_a_real_base_env_and_the_hubs_env_share_one_trainers_batches_by_weight(
    start_hub: StartHub, trace_server: dict[str, Any], tokenizer_dir: Path,
    tinker_args: list[str], atroposlib_dir: Path, trainer: Trainer, tmp_path: Path,
) -> None:
    hub = start_hub(trace_server, *tinker_args, listen=True,
                    distributor={"target": "atropos", "group_size": 2, "atropos_env": "collected",
                                 "atropos_env_weight": 3.0,
                                 "atropos_env_min_batch_allocation": 0.5},
                    environment=EVERY_TRACE_PASSES)
    assert trainer("register", hub.url, "8", str(tmp_path / "checkpoints")) == {"batch": None}
    with hub.client() as client:
        for i in range(8):
            r = client.post("/v1/traces", json={
                "format": "openai", "trace_id": f"h{i}", "reward": 0.5 * (i % 2),
                "messages": chat(f"Task {i // 2}", f"Answer {i}.")})
            assert r.status_code == 202, r.text
        wait_until(lambda: hub_figures(client)["groups"] == 4, 30, what="the hub's groups")
        hub_id = next(e["env_id"] for e in client.get("/v1/stats").json()["atropos"]["envs"]
                      if e["name"] == "collected_0")

    # The env runs until the queue holds more than its total_steps (1) batches beyond
    # the others' minimums, reading its share of the weight from /status-env.
    env = base_env(atroposlib_dir, hub.url, str(tokenizer_dir), "sums", "1.0", "0.5")
    assert env["made"] >= 6
    # Its weight against the hub's env's (3.0), both of max_token_length 2048.
    assert env["status"]["env_weight"] == pytest.approx(0.25)

    # Each batch of 8 sequences: half the hub's env's, half the real env's, as their
    # min_batch_allocation 0.5 each asks; the scores as each env gave them.
    for _ in range(2):
        batch = trainer("take", hub.url, "8")["batch"]
        sequences = Counter[int]()
        for group in batch:
            sequences[group["env_id"]] += len(group["tokens"])
            if group["env_id"] == env["env_id"]:
                assert group["scores"] == [1.0, 0.0]
        assert sequences == {hub_id: 4, env["env_id"]: 4}
