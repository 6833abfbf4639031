"""A real atroposlib `BaseEnv` (atroposlib.envs.base), run by its own `env_manager`: it
registers (`/register-env` with its weight and min_batch_allocation), reads
`/status-env`, and sends scored groups through `handle_send_to_api` until the queue
holds more than `total_steps` batches, as a training env does. Its rollouts are made
without a model (this machine has none): two answers to a sum, the right one scored 1,
rendered with the chat tokenizer given, the prompt masked -100. (atroposlib 0.4.0's
`tokenize_for_trainer` cannot: it takes `apply_chat_template`'s answer for a list of
ids, which transformers 5 makes a BatchEncoding.) wandb is off (`use_wandb` false;
WANDB_MODE=disabled besides).

    python env.py URL TOKENIZER_DIR NAME WEIGHT MIN_BATCH_ALLOCATION

Run with atroposlib installed on PYTHONPATH (tests/support/atroposlib.py
`install_trainer_and_env`). The last line printed is JSON: its env_id, the last
/status-env answer, and how many groups it made.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from atroposlib.envs.base import BaseEnv, BaseEnvConfig  # type: ignore[import-not-found]
from atroposlib.envs.server_handling.server_baseline import (  # type: ignore[import-not-found]
    APIServerConfig,
)


class SumsEnv(BaseEnv):  # type: ignore[misc]
    name = "sums"

    async def setup(self) -> None:
        self.made = 0

    async def get_next_item(self) -> int:
        self.made += 1
        return self.made

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def collect_trajectories(self, item: int) -> tuple[dict[str, Any], list[Any]]:
        question = f"What is {item} plus {item}?"
        group: dict[str, Any] = {"tokens": [], "masks": [], "scores": [], "messages": []}
        for answer, score in ((str(2 * item), 1.0), (str(2 * item + 1), 0.0)):
            chat = [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]
            prompt = self.tokenizer.apply_chat_template(
                chat[:-1], add_generation_prompt=True, return_dict=False)
            tokens = self.tokenizer.apply_chat_template(chat, return_dict=False)
            group["tokens"].append(tokens)
            group["masks"].append([-100] * len(prompt) + tokens[len(prompt):])
            group["scores"].append(score)
            group["messages"].append(chat)
        return group, []


def main() -> None:
    url, tokenizer, name, weight, allocation = sys.argv[1:6]
    config = BaseEnvConfig(
        group_size=2, max_token_length=2048, inference_weight=float(weight),
        min_batch_allocation=float(allocation), tokenizer_name=tokenizer, use_wandb=False,
        rollout_server_url=url, total_steps=1, wandb_name=name, steps_per_eval=0,
        max_num_workers=2, include_messages=True,
    )
    # Never called: the rollouts are made without a model.
    servers = [APIServerConfig(model_name="none", base_url="http://127.0.0.1:9/v1",
                               api_key="none", health_check=False)]
    env = SumsEnv(config, servers)
    asyncio.run(env.env_manager())
    print(json.dumps({"env_id": env.env_id, "status": env.status_dict, "made": env.made}))


if __name__ == "__main__":
    main()
