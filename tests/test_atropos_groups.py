"""Trajectories become the hub's own Atropos groups (distributor.target `atropos`),
which GET /batch serves to a trainer: from POSTed OpenAI chats rendered with a chat
template the test builds offline, and from gateway captures with their exact ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import StartHub
from tests.support.fakes.vllm_server import FakeVllm
from tests.support.hubs import InProcessHub
from tests.support.processes import run_cli
from tests.support.waiting import wait_until
from tests.test_gateway import KEY_ENV, TRAINING_ROUTE, tool_loop

TRAINER = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4, "max_token_len": 2048,
           "checkpoint_dir": "/tmp/ckpt", "save_checkpoint_interval": 10, "starting_step": 0,
           "num_steps": 100}
SYSTEM = {"role": "system", "content": "You are a careful agent."}
EVERY_TRACE_PASSES: dict[str, Any] = {"invalid_trace_filters": []}


def start_trainer(client: httpx.Client, **overrides: Any) -> None:
    """What a trainer does first (atroposlib's register_trainer, then get_batch)."""
    r = client.post("/register", json={**TRAINER, **overrides})
    assert r.status_code == 200, r.text
    assert client.get("/batch").json() == {"batch": None}


def next_batch(client: httpx.Client) -> list[dict[str, Any]]:
    def served() -> list[dict[str, Any]] | None:
        batch: list[dict[str, Any]] | None = client.get("/batch").json()["batch"]
        return batch
    return wait_until(served, 30, what="a batch of the hub's groups")


def hub_figures(client: httpx.Client) -> dict[str, Any]:
    figures: dict[str, Any] = client.get("/v1/stats").json()["atropos"]["hub_env"]
    return figures


def hub_env_id(client: httpx.Client) -> int:
    envs = client.get("/v1/stats").json()["atropos"]["envs"]
    return int(next(e["env_id"] for e in envs if e["name"].startswith("hub_")))


def chat(task: str, answer: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": task}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]


def atropos_hub(start_hub: StartHub, trace_server: dict[str, Any], tinker_args: list[str],
                **distributor: Any) -> InProcessHub:
    """A hub whose passing trajectories (every one passes) go to the `atropos` target."""
    return start_hub(trace_server, *tinker_args,
                     distributor={"target": "atropos", **distributor},
                     environment=EVERY_TRACE_PASSES)


def assistant_text(tokenizer: Any, tokens: list[int], masks: list[int]) -> str:
    return str(tokenizer.decode([t for t, m in zip(tokens, masks) if m != -100]))


def test_posted_chats_become_groups_rendered_with_the_chat_template(
    start_hub: StartHub, trace_server: dict[str, Any], tokenizer_dir: Path, tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args, group_size=4)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    with hub.client() as client:
        start_trainer(client)
        sent: dict[str, tuple[list[dict[str, Any]], float]] = {}
        # Four rollouts of one task (its whitespace aside), rewards that differ; four of
        # another, all scored alike: no advantage, dropped as atroposlib drops it.
        for i, (task, env_reward) in enumerate(
            [("What is two plus two?", r) for r in (0.0, 0.05, 0.1, 0.05)]
            + [("What  is the capital of France? ", 0.1)] * 4
        ):
            messages = chat(task if i % 2 else f" {task}", f"Answer {i}: it is {i}.")
            r = client.post("/v1/traces", json={"format": "openai", "trace_id": f"t{i}",
                                                "messages": messages, "reward": env_reward})
            assert r.status_code == 202, r.text
            sent[f"t{i}"] = (messages, r.json()["reward"])

        (group,) = next_batch(client)
        trace_ids = group["group_overrides"]["trace_ids"]
        assert sorted(trace_ids) == ["t0", "t1", "t2", "t3"]
        # Scores are the trajectories' rewards; they differ.
        assert group["scores"] == [sent[t][1] for t in trace_ids]
        assert len(set(group["scores"])) > 1
        # None invented: no logprobs were captured for rendered chats.
        assert group["inference_logprobs"] is None
        for tokens, masks, trace_id in zip(group["tokens"], group["masks"], trace_ids):
            messages = sent[trace_id][0]
            assert tokenizer.decode(tokens) == tokenizer.apply_chat_template(
                messages, tokenize=False)
            assert assistant_text(tokenizer, tokens, masks) == "".join(
                f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
            assert all(m in (-100, t) for t, m in zip(tokens, masks))
        assert group["messages"] == [sent[t][0] for t in trace_ids]

        # The dashboard shows the group: the rollouts side by side, score and advantage
        # (score minus the group's mean), reached from each of its trajectories.
        hub_group = group["group_overrides"]["hub_group"]
        page = client.get(f"/ui/groups/{hub_group}")
        assert page.status_code == 200, page.text
        mean = sum(group["scores"]) / 4
        for trace_id, score in zip(trace_ids, group["scores"]):
            assert trace_id in page.text
            assert f"advantage <strong class=\"advantage\">{score - mean:g}</strong>" in page.text
            assert f"/ui/groups/{hub_group}" in client.get(f"/ui/traces/{trace_id}").text
        assert hub_group in client.get("/ui/groups").text

        figures = wait_until(lambda: (f := hub_figures(client))["dropped"] and f,
                             what="the dropped group counted")
        assert figures["dropped"] == {"same_scores": 4}
        assert figures["grouped"] == 4 and figures["groups"] == 1
        overview = client.get("/ui/atropos").text
        assert "hub_0" in overview and "left out: same_scores" in overview
        # Each trajectory once: the trainer gets nothing more.
        assert client.get("/batch").json() == {"batch": None}


def test_a_group_short_of_group_size_is_released_at_its_timeout(
    start_hub: StartHub, trace_server: dict[str, Any], tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args,
                      # Both delivered at once: neither times out alone.
                      group_size=8, batch_size=2, group_timeout_seconds=0.5)
    with hub.client() as client:
        start_trainer(client, batch_size=2)
        for i, env_reward in enumerate((0.0, 0.1)):
            r = client.post("/v1/traces", json={
                "format": "openai", "trace_id": f"r{i}", "reward": env_reward,
                "metadata": {"group": "prompt-7"},
                "messages": chat(f"Task {i}", f"Answer {i}.")})
            assert r.status_code == 202, r.text
        (group,) = next_batch(client)
        # One group by the `group` id, though the tasks differ.
        assert sorted(group["group_overrides"]["trace_ids"]) == ["r0", "r1"]


def test_a_trajectory_without_token_ids_or_tokenizer_is_left_out_and_counted(
    start_hub: StartHub, trace_server: dict[str, Any]
) -> None:
    hub = start_hub(trace_server, distributor={"target": "atropos", "group_size": 2},
                    environment=EVERY_TRACE_PASSES)
    with hub.client() as client:
        start_trainer(client)
        r = client.post("/v1/traces", json={"format": "openai", "trace_id": "u1",
                                            "messages": chat("Q", "A"), "reward": 0.1})
        assert r.status_code == 202, r.text
        figures = wait_until(lambda: (f := hub_figures(client))["dropped"] and f,
                             what="the unusable trajectory counted")
        assert figures["dropped"] == {"unusable": 1} and figures["pending"] == 0


def gateway_hub(start_hub: StartHub, trace_server: dict[str, Any],
                upstream: tuple[FakeVllm, str], monkeypatch: pytest.MonkeyPatch) -> InProcessHub:
    """A hub whose gateway captures the fake vLLM's ids and logprobs, its rollouts
    grouped by three, scored by the reward given at their finish."""
    fake, url = upstream
    fake.reset()
    monkeypatch.setenv(KEY_ENV, fake.key)
    gateway = {"enabled": True, "upstream": {"base_url": url, "api_key_env": KEY_ENV},
               "routes": [TRAINING_ROUTE], "quiet_seconds": 30}
    return start_hub(trace_server, listen=True, gateway=gateway,
                     distributor={"target": "atropos", "group_size": 3, "score": "env_reward"},
                     environment=EVERY_TRACE_PASSES)


ROLLOUT_REWARDS = {"run-a": 1.0, "run-b": 0.0, "run-c": 0.5}


def run_rollouts(hub: InProcessHub, client: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    """An agent's tool loop through the gateway for each of ROLLOUT_REWARDS, finished
    with its reward in one group; each one's conversation."""
    conversations = {}
    for rollout, reward in ROLLOUT_REWARDS.items():
        agent = openai.OpenAI(base_url=f"{hub.url}/v1/rollouts/{rollout}",
                              api_key="agent-key", max_retries=0)
        conversations[rollout] = tool_loop(agent)
        r = client.post(f"/v1/rollouts/{rollout}/finish",
                        json={"reward": reward, "group": "readme"})
        assert r.status_code == 200, r.text
    return conversations


def test_gateway_rollouts_become_groups_with_their_exact_ids_and_logprobs(
    start_hub: StartHub, trace_server: dict[str, Any], upstream: tuple[FakeVllm, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub = gateway_hub(start_hub, trace_server, upstream, monkeypatch)
    with hub.client() as client:
        start_trainer(client, batch_size=3)
        run_rollouts(hub, client)
        rewards = ROLLOUT_REWARDS
        (group,) = next_batch(client)
        trace_ids = group["group_overrides"]["trace_ids"]
        assert sorted(trace_ids) == sorted(rewards)
        assert group["scores"] == [rewards[t] for t in trace_ids]
        for i, trace_id in enumerate(trace_ids):
            view = client.get(f"/v1/traces/{trace_id}", params={"view": "tokens"}).json()
            assert view["exact"] is True
            # The ids the model saw and produced, its logprobs, as captured.
            assert group["tokens"][i] == view["tokens"]
            assert group["masks"][i] == view["masks"]
            assert group["inference_logprobs"][i] == view["logprobs"]


def test_too_long_and_stale_trajectories_are_left_out_and_counted(
    start_hub: StartHub, trace_server: dict[str, Any], tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args, group_size=2,
                      max_policy_lag=2)
    with hub.client() as client:
        # The trainer is at step 10 and takes sequences of at most 80 tokens.
        start_trainer(client, batch_size=2, max_token_len=80, starting_step=10)
        sent = [("fresh-0", "8", "Yes."), ("stale", "step-7", "Yes."),
                ("long", "9", "Four, I think. " * 20), ("fresh-1", "10", "No.")]
        for i, (trace_id, version, answer) in enumerate(sent):
            r = client.post("/v1/traces", json={
                "format": "openai", "trace_id": trace_id, "policy_version": version,
                "reward": 0.05 * i, "messages": chat("What is two plus two?", answer)[:3]})
            assert r.status_code == 202, r.text
        (group,) = next_batch(client)
        assert sorted(group["group_overrides"]["trace_ids"]) == ["fresh-0", "fresh-1"]
        assert max(len(t) for t in group["tokens"]) <= 80
        assert hub_figures(client)["dropped"] == {"stale": 1, "too_long": 1}


def test_groups_an_env_sends_become_trajectories_listed_by_env_and_group(
    start_hub: StartHub, trace_server: dict[str, Any], tokenizer_dir: Path, tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args, group_size=2)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    prompt = tokenizer.encode("What is two plus two?")
    answers = [tokenizer.encode(" Four."), tokenizer.encode(" Five.")]
    with hub.client() as client:
        start_trainer(client, batch_size=4)
        r = client.post("/register-env", json={"max_token_length": 512, "desired_name": "math",
                                               "weight": 1.0, "group_size": 2})
        env_id = r.json()["env_id"]
        chats = [[{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": a}] for a in ("4", "5")]
        with_messages = {"tokens": [[1, 2, 3], [1, 2, 4]], "masks": [[-100, -100, 3],
                         [-100, -100, 4]], "scores": [1.0, -1.0], "messages": chats,
                         "env_id": env_id}
        tokens_only = {"tokens": [prompt + a for a in answers],
                       "masks": [[-100] * len(prompt) + a for a in answers],
                       "scores": [0.5, 0.0], "env_id": env_id}
        r = client.post("/scored_data_list", json=[with_messages, tokens_only])
        assert r.status_code == 200, r.text

        def listed() -> list[dict[str, Any]] | None:
            page = client.get("/v1/traces", params={"env": "math_0"}).json()["traces"]
            return page if len(page) == 4 else None
        traces = wait_until(listed, 30, what="the env's rollouts as trajectories")
        groups = {t["trace_id"].rsplit("-", 1)[0] for t in traces}
        assert len(groups) == 2
        by_group = {g: client.get("/v1/traces", params={"group": g}).json()["traces"]
                    for g in groups}
        assert sorted(sorted(t["env_reward"] for t in ts) for ts in by_group.values()) == [
            [-1.0, 1.0], [0.0, 0.5]]
        for trace in traces:
            stored = client.get(f"/v1/traces/{trace['trace_id']}").json()["trace"]
            atropos = stored["metadata"]["atropos"]
            assert atropos["env"] == "math_0" and atropos["step"] == 0
            steps = stored["steps"]
            if trace["env_reward"] in (1.0, -1.0):  # sent with messages
                assert stored["task"] == "What is 2+2?"
                assert steps[-1]["content"] == ("4" if trace["env_reward"] == 1.0 else "5")
                assert atropos["advantage"] == trace["env_reward"]
            else:  # decoded with the tokenizer
                assert atropos["decoded"] is True
                assert stored["task"] == "What is two plus two?"
                assert steps[-1]["content"] == (
                    " Four." if trace["env_reward"] == 0.5 else " Five.")
        # The trainer still gets the groups as they were sent, and only so: the hub's
        # own env does not group them again.
        batch = next_batch(client)
        assert sorted(g["scores"] for g in batch) == [[0.5, 0.0], [1.0, -1.0]]

        def left_out() -> dict[str, Any] | None:
            figures = hub_figures(client)
            return figures if figures["dropped"].get("unusable") == 4 else None
        assert wait_until(left_out, 30, what="the env's rollouts left out")["groups"] == 0


@pytest.mark.process
def test_export_writes_the_groups_the_hub_formed_as_it_served_them(
    start_hub: StartHub, trace_server: dict[str, Any], tmp_path: Path, tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args, group_size=2)
    with hub.client() as client:
        start_trainer(client, batch_size=2)
        for i in range(4):
            r = client.post("/v1/traces", json={
                "format": "openai", "trace_id": f"x{i}", "reward": 0.05 * i,
                "messages": chat(f"Task {i // 2}", f"Answer {i}.")})
            assert r.status_code == 202, r.text
        served = [next_batch(client)[0], next_batch(client)[0]]
        hub_id = hub_env_id(client)
    out = tmp_path / "groups.jsonl"
    done = run_cli("export", "--config", str(hub.config), "--format", "atropos", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported 2 groups" in done.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    key = lambda g: g["group_overrides"]["hub_group"]  # noqa: E731
    # As served, the hub's env's env_id included.
    assert {g["env_id"] for g in exported} == {hub_id}
    assert sorted(exported, key=key) == sorted(served, key=key)


@pytest.mark.process
def test_kill_9_between_forming_a_group_and_get_batch_loses_nothing_and_sends_once(
    start_hub_process: Any, trace_server: dict[str, Any], tinker_args: list[str]
) -> None:
    hub = start_hub_process(trace_server, *tinker_args,
                            distributor={"target": "atropos", "group_size": 2},
                            environment=EVERY_TRACE_PASSES)
    client = hub.client()
    start_trainer(client, batch_size=2)
    for i in range(2):
        r = client.post("/v1/traces", json={"format": "openai", "trace_id": f"k{i}",
                                            "reward": 0.1 * i, "messages": chat("Q", f"A{i}")})
        assert r.status_code == 202, r.text
    wait_until(lambda: hub_figures(client)["groups"] == 1, 30, what="the group formed")
    client.close()
    hub.kill()
    hub.start()
    with hub.client() as client:
        (group,) = next_batch(client)
        assert sorted(group["group_overrides"]["trace_ids"]) == ["k0", "k1"]
        assert client.get("/batch").json() == {"batch": None}
        figures = hub_figures(client)
        assert figures["groups"] == 1 and figures["grouped"] == 2 and figures["pending"] == 0


def test_the_hubs_env_and_a_real_env_share_one_trainers_batches(
    start_hub: StartHub, trace_server: dict[str, Any], tinker_args: list[str]
) -> None:
    hub = atropos_hub(start_hub, trace_server, tinker_args, group_size=2,
                      atropos_env="collected", atropos_env_weight=2.0)
    with hub.client() as client:
        start_trainer(client, batch_size=4)
        r = client.post("/register-env", json={"max_token_length": 512, "desired_name": "math",
                                               "weight": 1.0, "group_size": 2})
        math_id = r.json()["env_id"]
        for i in range(2):
            r = client.post("/v1/traces", json={"format": "openai", "trace_id": f"s{i}",
                                                "reward": 0.1 * i, "messages": chat("Q", "A")})
            assert r.status_code == 202, r.text
        wait_until(lambda: hub_figures(client)["groups"] == 1, 30, what="the hub's group")
        r = client.post("/scored_data", json={"tokens": [[1, 2], [1, 3]], "masks": [[-100, 2],
                        [-100, 3]], "scores": [1.0, 0.0], "env_id": math_id})
        assert r.status_code == 200, r.text
        batch = next_batch(client)
        envs = {e["env_id"]: e for e in client.get("/v1/stats").json()["atropos"]["envs"]}
        hub_id = next(i for i, e in envs.items() if e["name"] == "collected_0")
        # One batch of both envs' groups, each group once.
        assert sorted(g["env_id"] for g in batch) == sorted([math_id, hub_id])
        assert client.get("/batch").json() == {"batch": None}
        # Each env's groups listed under its name, the hub's env's too.
        hub_group = next(g for g in batch if g["env_id"] == hub_id)["group_overrides"]
        sent = wait_until(lambda: client.get("/v1/traces", params={"env": "math_0"}).json()[
            "traces"], 30, what="the env's group as trajectories")
        math_group = sent[0]["trace_id"].rsplit("-", 1)[0]
        for env, listed, other in (("collected_0", hub_group["hub_group"], math_group),
                                   ("math_0", math_group, hub_group["hub_group"])):
            page = client.get("/ui/groups", params={"env": env}).text
            assert listed in page and other not in page


def test_a_burst_worker_makes_trajectories_of_every_group_envs_sent(
    start_hub: StartHub, trace_server: dict[str, Any]
) -> None:
    """More groups than a pass takes, sent a moment ago (the stage, running beside the
    API, would give way to them): `atropos worker --burst` makes them all."""
    hub = start_hub(trace_server, "--no-workers")
    with hub.client() as client:
        start_trainer(client, batch_size=64)
        r = client.post("/register-env", json={"max_token_length": 512, "desired_name": "math",
                                               "weight": 1.0, "group_size": 2})
        env_id = r.json()["env_id"]
        groups = [{"tokens": [[1, 2, g], [1, 2, g + 1]], "masks": [[-100, -100, g],
                   [-100, -100, g + 1]], "scores": [1.0, float(g)], "env_id": env_id,
                   "messages": [[{"role": "user", "content": f"Task {g}"},
                                 {"role": "assistant", "content": f"Answer {g}.{i}"}]
                                for i in range(2)]}
                  for g in range(30)]
        r = client.post("/scored_data_list", json=groups)
        assert r.status_code == 200, r.text
        assert hub.drain() > 0
        traces = client.get("/v1/traces", params={"env": "math_0", "limit": 100}).json()
        assert len(traces["traces"]) == 60
        assert sorted(t["env_reward"] for t in traces["traces"]) == sorted(
            s for g in groups for s in g["scores"])
