"""atroposlib's example trainer, as far as it talks to the API and readies a batch for
its GRPO step: `register_trainer`, `get_batch` and `pad_data_to_good_offset`, called as
its `get_data` calls them. Run with atroposlib installed on PYTHONPATH
(tests/support/atroposlib.py `install_trainer_and_env`), in a process of its own, so
that what wandb brings into that directory stays out of the test's process. One process
serves a test session's calls (torch and wandb imported once): each line read is a
call, a JSON list of arguments,

    ["register", URL, SEQUENCES, SAVE_PATH]
        registers (batch_size SEQUENCES) and takes the first batch, which starts the
        trainer; answers that answer
    ["take", URL, SEQUENCES] or ["take", URL, SEQUENCES, "--logprobs"]
        takes one batch and pads it as the trainer does; answers the batch as served and
        the tensors made of it

and its answer one line, `ANSWER ` and the JSON (or `FAILED ` and the traceback's, when
the call raised); the trainer's own lines come before it.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from typing import Any

from example_trainer.api import get_batch, register_trainer  # type: ignore[import-not-found]
from example_trainer.config import TrainingConfig  # type: ignore[import-not-found]
from example_trainer.data import pad_data_to_good_offset  # type: ignore[import-not-found]


def call(argv: list[str]) -> Any:
    mode, url, sequences = argv[0], argv[1], int(argv[2])
    if mode == "register":
        config = TrainingConfig(model_name="hub-test-policy", atropos_url=url,
                                batch_size=sequences, gradient_accumulation_steps=1,
                                seq_len=2048, training_steps=10, save_path=argv[3],
                                wandb_project="hub-test", wandb_group="hub-test")
        register_trainer(config)
        return get_batch(url)
    data = get_batch(url)
    served = copy.deepcopy(data["batch"])
    logprobs = "--logprobs" in argv
    tokens, labels, advantages, temperatures, inference_logprobs = pad_data_to_good_offset(
        data, sequences, extract_inference_logprobs=logprobs)
    return {
        "batch": served,
        "tokens": [t.tolist() for t in tokens],
        "labels": [t.tolist() for t in labels],
        "advantages": [t.view(-1).tolist() for t in advantages],
        "temperatures": [t.view(-1).tolist() for t in temperatures],
        "logprobs": None if inference_logprobs is None
        else [t.tolist() for t in inference_logprobs],
    }


def main() -> None:
    for line in sys.stdin:
        try:
            answer = "ANSWER " + json.dumps(call(json.loads(line)))
        except Exception:
            answer = "FAILED " + json.dumps(traceback.format_exc())
        print(answer, flush=True)


if __name__ == "__main__":
    main()
