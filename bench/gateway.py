"""Gateway benchmark: small chat calls with the openai SDK's async client, one at a
time and 32 at a time, straight to a vLLM-like fake upstream, through `atropos serve`
with the gateway on (every call captured and committed), and through LiteLLM's proxy on
the same upstream, in one run. Prints calls/s, p50 latency, the client's own CPU per
call (32 at a time), and the time to the first streamed byte (one at a time).

Each call is a rollout of its own, made into a trajectory once it has been quiet for
gateway.quiet_seconds (the default, 30 s: longer than a load lasts), so that the hub's
loads measure the calls and their captures alone. After each, the bench waits until
every rollout is made (GET /v1/stats), so that none is made during the next load, and
prints the hub's CPU (all its processes) per call during the load and per rollout made
after it.

    python bench/gateway.py                                        # direct and hub
    python bench/gateway.py --litellm /work/venvs/litellm/bin/litellm
    python bench/gateway.py --upstream-ms 20   # an upstream that takes 20 ms a call
    python bench/gateway.py --later-upstream 2 # also direct to one that answers 2 ms later
    python bench/gateway.py --interleaved 400  # also: one at a time, direct and hub in turn
    python bench/gateway.py --rounds 5         # 32 at a time: 5 rounds, medians
    python bench/gateway.py --tool-loop 4      # agents' episodes of 4 calls each
    python bench/gateway.py --own-clients      # 32 callers with a client each, as 32 agents
    python bench/gateway.py --tool-loop 40 --turn-kb 5 --calls 4000   # long agents

With --tool-loop TURNS the 32-at-a-time load is agents' episodes, as real agents call:
each sends a task of its own with a tool offered; the (fake) model calls the tool, the
agent sends its result, then a user turn asks for more, until TURNS calls (with
--turn-kb, each result and user turn holds that many KB of text); each call repeats the
conversation so far, without a rollout id, so that the hub stitches every call after
the first to its episode (a lookup beside the upstream's answer). The bench checks that
the hub made one rollout of TURNS calls per episode.

With --later-upstream MS the same client also loads, straight, a second fake upstream
that answers MS later than the first: what a proxy would get that added MS and took no
CPU. At 32 at a time the client takes a whole CPU, and its CPU per call grows as
answers come later (docs/gateway.md).

With --own-clients each of the 32 callers has an `openai` client of its own, as 32
agents do. One client shared by 32 callers spends about half its CPU in its connection
pool (httpcore scans its connections for every queued request), and more the longer
each answer takes: through any proxy it runs out of CPU first (docs/gateway.md).

LiteLLM is not a dependency of the hub: install `litellm[proxy]` in a venv of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import GatewayConfig  # noqa: E402
from bench.ingest import tree_cpu  # noqa: E402

KEY = "sk-upstream"
MESSAGES = [{"role": "user", "content": "Say something short."}]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Reads a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
QUIET_SECONDS = GatewayConfig().quiet_seconds


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1, headers={"authorization": f"Bearer {KEY}"})
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer in {timeout} s")


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                 **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _run(base_url: str, concurrency: int, calls: int, turns: int = 1,
               turn_kb: float = 0, own_clients: bool = False) -> tuple[float, float]:
    """`calls` calls, `concurrency` at a time: single calls, or episodes of `turns`
    whose results and user turns hold `turn_kb` KB of text each. The callers share one
    client, or with `own_clients` each has its own (as that many agents would)."""
    said_more = "a line of the file\n" * int(turn_kb * 1024 / 19)

    def new_client() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0,
                                  http_client=httpx.AsyncClient(
                                      limits=httpx.Limits(max_connections=concurrency)))

    clients = [new_client() for _ in range(concurrency if own_clients else 1)]
    latencies: list[float] = []
    queue = iter(range(calls // turns))

    async def worker(client: openai.AsyncOpenAI) -> None:
        for episode in queue:
            if turns == 1:
                t = time.perf_counter()
                await client.chat.completions.create(model="policy", messages=MESSAGES,
                                                     max_tokens=16)
                latencies.append(time.perf_counter() - t)
                continue
            messages: list[Any] = [{"role": "user",
                                    "content": f"Task {episode}: what does README.md say?"}]
            for turn in range(turns):
                t = time.perf_counter()
                answer = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, max_tokens=16)
                latencies.append(time.perf_counter() - t)
                said = answer.choices[0].message
                messages.append(said.model_dump(exclude_none=True))
                for call in said.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": f"README.md, read at turn {turn}.\n"
                                                + said_more})
                if not said.tool_calls:
                    messages.append({"role": "user", "content": "And then?\n" + said_more})

    for n in range(_warm_ups(calls, len(clients))):  # warm-up: connections, caches
        await clients[n % len(clients)].chat.completions.create(model="policy",
                                                                messages=MESSAGES)
    start = time.perf_counter()
    await asyncio.gather(*(worker(clients[n % len(clients)]) for n in range(concurrency)))
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.close()
    return len(latencies) / elapsed, statistics.median(latencies) * 1000


def _warm_ups(calls: int, clients: int) -> int:
    """The calls `_run` makes before it times any: 20, and at least one a client."""
    return max(min(20, calls), clients)


def _rollouts(hub_url: str) -> dict[str, int]:
    """The hub's gateway rollouts by state, and its calls (GET /v1/stats)."""
    counts: dict[str, int] = httpx.get(f"{hub_url}/v1/stats", timeout=30).json()["gateway"]
    return counts


def _made(hub_url: str, timeout: float = 300) -> None:
    """Waits until the hub has made every captured rollout into a trajectory."""
    deadline = time.monotonic() + QUIET_SECONDS + timeout
    while time.monotonic() < deadline:
        if _rollouts(hub_url)["open_rollouts"] == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"the hub's rollouts were not all made within {timeout:g} s")


async def _first_byte(base_url: str, calls: int) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    waits = []
    for _ in range(calls):
        t = time.perf_counter()
        stream = await client.chat.completions.create(model="policy", messages=MESSAGES,
                                                      stream=True)
        async for _ in stream:
            waits.append(time.perf_counter() - t)
            break
        async for _ in stream:
            pass
    await client.close()
    return statistics.median(waits) * 1000


def _interleaved(targets: dict[str, str], calls: int) -> None:
    """One call at a time, plain then streamed, to each target in turn (a plain httpx
    client: the SDK's own variance left out), so that the machine's drift falls on all
    alike: what the hub adds to a call's p50 and to its first streamed byte."""
    plain: dict[str, list[float]] = {name: [] for name in targets}
    first: dict[str, list[float]] = {name: [] for name in targets}
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 16}
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}) as client:
        for n in range(calls + 30):  # the first 30: warm-up
            for name, url in targets.items():
                t = time.perf_counter()
                client.post(f"{url}/chat/completions", json=body).raise_for_status()
                took = time.perf_counter() - t
                t = time.perf_counter()
                with client.stream("POST", f"{url}/chat/completions",
                                   json={**body, "stream": True}) as answer:
                    chunks = answer.iter_raw()
                    next(chunks)
                    waited = time.perf_counter() - t
                    for _ in chunks:
                        pass
                if n >= 30:
                    plain[name].append(took)
                    first[name].append(waited)
    p50 = {name: statistics.median(v) * 1000 for name, v in plain.items()}
    ttfb = {name: statistics.median(v) * 1000 for name, v in first.items()}
    print(f"interleaved, one at a time, {calls} calls each (httpx):")
    for name in targets:
        print(f"  {name:8} p50 {p50[name]:6.2f} ms (+{p50[name] - p50['direct']:.2f})  "
              f"first byte p50 {ttfb[name]:6.2f} ms (+{ttfb[name] - ttfb['direct']:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--litellm", help="the litellm command of a venv with litellm[proxy]")
    parser.add_argument("--interleaved", type=int, default=0, metavar="CALLS",
                        help="also time CALLS calls one at a time, direct and through the "
                             "hub in turn (plain httpx)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the 32-at-a-time load, the targets in turn (medians)")
    parser.add_argument("--upstream-ms", type=float, default=0,
                        help="the fake upstream's time to answer each call (a model's)")
    parser.add_argument("--later-upstream", type=float, default=0, metavar="MS",
                        help="also load, straight, a second fake upstream that answers MS "
                             "later than the first: what a proxy that only added MS would get")
    parser.add_argument("--tool-loop", type=int, default=1, metavar="TURNS",
                        help="32 at a time as agents' episodes of TURNS calls each")
    parser.add_argument("--turn-kb", type=float, default=0, metavar="KB",
                        help="with --tool-loop: the KB of text of each result and user turn")
    parser.add_argument("--own-clients", action="store_true",
                        help="32 at a time: each caller with an openai client of its own, "
                             "as 32 agents would have, not one client shared by all")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs = []
    try:
        up_port = _port()
        procs.append(_start([sys.executable, "-m", "tests.support.fakes.vllm_server",
                             str(up_port), str(options.upstream_ms)]))
        upstream = f"http://127.0.0.1:{up_port}/v1"
        _wait(upstream + "/models")
        hub_port = _port()
        config = work / "config.json"
        config.write_text(json.dumps({
            "trace_server": {"host": "127.0.0.1", "port": hub_port,
                             "db_path": str(work / "traces.db")},
            "distributor": {"target": "jsonl", "output_dir": str(work / "batches")},
            "gateway": {"enabled": True,
                        "upstream": {"base_url": upstream, "api_key_env": "BENCH_KEY"}},
        }))
        hub = _start([sys.executable, "-m", "app.cli", "serve", "--config", str(config)],
                     {"BENCH_KEY": KEY})
        procs.append(hub)
        hub_url = f"http://127.0.0.1:{hub_port}"
        targets = {"direct": upstream, "hub": f"{hub_url}/v1"}
        if options.later_upstream:
            later_port = _port()
            procs.append(_start([sys.executable, "-m", "tests.support.fakes.vllm_server",
                                 str(later_port),
                                 str(options.upstream_ms + options.later_upstream)]))
            later = f"direct+{options.later_upstream:g}ms"
            targets[later] = f"http://127.0.0.1:{later_port}/v1"
            _wait(targets[later] + "/models")
        _wait(f"{hub_url}/healthz", timeout=300)
        if options.litellm:
            lite_port = _port()
            lite = work / "litellm.yaml"
            lite.write_text(
                "model_list:\n  - model_name: policy\n    litellm_params:\n"
                f"      model: openai/fake-policy\n      api_base: {upstream}\n"
                f"      api_key: {KEY}\n")
            with open(work / "litellm.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [options.litellm, "--config", str(lite), "--port", str(lite_port),
                     "--host", "127.0.0.1", "--num_workers", "1"],
                    env={**os.environ,
                         "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
                         "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                    stdout=log, stderr=subprocess.STDOUT))
            targets["litellm"] = f"http://127.0.0.1:{lite_port}/v1"
            _wait(f"http://127.0.0.1:{lite_port}/health/liveliness", timeout=300)
        if options.own_clients:
            print("32 at a time: 32 callers, each with an openai client of its own")
        if options.tool_loop > 1:
            print(f"32 at a time: agents' episodes of {options.tool_loop} calls, stitched "
                  f"by the hub; {options.turn_kb:g} KB a result or user turn")
        print(f"{'':8} {'1 at a time':>22} {'32 at a time':>22} {'client CPU':>12} "
              f"{'first byte p50':>15}")
        one = {name: asyncio.run(_run(url, 1, options.calls // 4))
               for name, url in targets.items()}
        ttfb = {name: asyncio.run(_first_byte(url, 200)) for name, url in targets.items()}
        _made(hub_url)
        # 32 at a time, the targets in turn, round after round: the rounds differ more
        # than the targets within one.
        many: dict[str, list[tuple[float, float, float]]] = {name: [] for name in targets}
        hub_cpu: list[tuple[float, float]] = []  # ms: a call during the load, a rollout after
        turns = options.tool_loop
        episodes = options.calls // turns
        warm_up = _warm_ups(options.calls, 32 if options.own_clients else 1)
        calls, rollouts = episodes * turns + warm_up, episodes + warm_up
        for _ in range(options.rounds):
            for name, url in targets.items():
                made = _rollouts(hub_url)["assembled_rollouts"]
                cpu, before, began = time.process_time(), tree_cpu([hub.pid]), time.monotonic()
                try:
                    rate, p50 = asyncio.run(_run(url, 32, options.calls, turns,
                                                 options.turn_kb, options.own_clients))
                except openai.APIError as exc:  # which target failed, and how
                    raise SystemExit(f"{name}, 32 at a time: {exc!r} "
                                     f"(caused by {exc.__cause__!r})") from exc
                # The client's own CPU per call: it runs here, on the same CPUs.
                cpu = (time.process_time() - cpu) / (episodes * turns) * 1000
                many[name].append((rate, p50, cpu))
                if name == "hub":
                    during = tree_cpu([hub.pid]) - before
                    if _rollouts(hub_url)["assembled_rollouts"] != made:
                        print(f"  (the load outlasted gateway.quiet_seconds, {QUIET_SECONDS:g} "
                              "s: rollouts were made during it)")
                    # Idle until the first of them comes due.
                    time.sleep(max(0.0, began + QUIET_SECONDS - 1 - time.monotonic()))
                    before = tree_cpu([hub.pid])
                    _made(hub_url)
                    hub_cpu.append((during / calls * 1000,
                                    (tree_cpu([hub.pid]) - before) / rollouts * 1000))
                    made = _rollouts(hub_url)["assembled_rollouts"] - made
                    if made != rollouts:  # a call not stitched to its episode, or lost
                        raise SystemExit(f"the hub made {made} rollouts of this load's "
                                         f"calls, not {rollouts}")
        for name in targets:
            rate, p50, cpu = (statistics.median(r[i] for r in many[name]) for i in range(3))
            print(f"{name:8} {one[name][0]:8.0f}/s p50 {one[name][1]:6.2f} ms {rate:8.0f}/s "
                  f"p50 {p50:6.2f} ms {cpu:6.2f} ms/call {ttfb[name]:12.2f} ms")
        during, after = (statistics.median(c[i] for c in hub_cpu) for i in range(2))
        print(f"the hub's CPU (all its processes), 32 at a time: {during:.2f} ms a call "
              f"during the load; {after:.2f} ms a rollout of {turns} call(s) made into a "
              "trajectory after it")
        for name in (n for n in targets if n != "direct" and options.rounds > 1):
            ratios = [them[0] / direct[0] for them, direct in zip(many[name], many["direct"],
                                                                 strict=True)]
            print(f"32 at a time, medians of {options.rounds} rounds; {name} / direct by "
                  "round: " + ", ".join(f"{r:.2f}x" for r in ratios)
                  + f" (median {statistics.median(ratios):.2f}x)")
        if options.interleaved:
            _interleaved({"direct": upstream, "hub": targets["hub"]}, options.interleaved)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


if __name__ == "__main__":
    main()
