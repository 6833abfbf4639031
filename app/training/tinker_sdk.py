"""The `tinker` training backend: Thinking Machines' `tinker` SDK, an optional extra
(`pip install 'atropos-hub[tinker]'`), imported only when tinker.backend is `tinker`.

A LoRA training client for tinker.model_id with rank tinker.lora_rank; for each epoch,
forward_backward (cross-entropy) and an Adam optim_step with tinker.learning_rate over
each chunk of tinker.batch_size examples; then the weights are saved for sampling
under the key, and their path is the resulting model.

Token ids: from the trace where it carries them (`tokens`, with Atropos `masks`: -100
where not trained on); otherwise the messages are rendered with the chat template of
the tokenizer tinker.tokenizer names (Hugging Face), training on assistant turns only.

Each batch trains a fresh adapter on the base model, as each fine-tuning job of the
openai backend does.

Idempotency: the SDK has no job to look up, so the receipt (stored with the batch in
the database, or in `atropos train`'s job.json) records the progress. After each
step (forward_backward + optim_step) the training state, weights and optimizer, is
saved as `<key>-step-<n>` and the receipt's `progress` says `{"steps_done": n,
"steps": N, "state_path": ...}`. A worker killed mid-steps is followed by one that
loads the last recorded state (with its optimizer) into a fresh training client and
goes on with step n+1: the steps after the record are redone from the recorded state,
which does not hold them, so each step of a batch counts once. After the last step
the receipt's `state_path` is that state: a redelivery only saves the weights for
sampling again (under the same name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import httpx

from app.config import TinkerConfig
from app.errors import TrainingFailed
from app.training import Example, TrainingRun
from app.training.chat_template import load_tokenizer

EXTRA_HINT = "pip install 'atropos-hub[tinker]'"


class Tokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class TinkerSDK:
    name = "tinker"

    def __init__(
        self,
        tinker: TinkerConfig,
        *,
        sdk: Any = None,
        service: Any = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`sdk` (the `tinker` module), `service` (a ServiceClient) and `tokenizer` are
        built from tinker.json when not given; tests pass stand-ins."""
        self._tinker = tinker
        self._sdk = sdk
        self._service = service
        self._tokenizer = tokenizer

    async def train(self, run: TrainingRun) -> dict[str, Any]:
        sdk = self._load_sdk()
        with _sdk_errors(sdk):
            return await self._train(sdk, run)

    async def _train(self, sdk: Any, run: TrainingRun) -> dict[str, Any]:
        t, log, key = self._tinker, run.log, run.key
        service = self._service or sdk.ServiceClient(api_key=t.api_key())
        state = run.receipt.get("state_path")
        if state:
            log.line(f"resuming from the state saved by an earlier attempt: {state}")
            client = await service.create_training_client_from_state_async(state)
        else:
            client = await service.create_lora_training_client_async(
                base_model=t.model_id, rank=t.lora_rank
            )
            state = await self._steps(sdk, client, run)
            run.receipt["state_path"] = state
            await run.save()
        path = await _result_path(await client.save_weights_for_sampler_async(name=key))
        log.line(f"weights saved for sampling: {path}")
        return {"id": key, "state": "succeeded", "model": path, "base_model": t.model_id,
                "state_path": state, "error": None}

    async def _steps(self, sdk: Any, client: Any, run: TrainingRun) -> str:
        """Every step not recorded as done in `run.receipt`, each recorded once its
        state is saved; returns the path of the state after the last step."""
        t, log = self._tinker, run.log
        datums = [self._datum(sdk, e) for e in run.examples]
        chunks = [datums[start : start + t.batch_size]
                  for start in range(0, len(datums), t.batch_size)]
        steps = [(epoch, chunk) for epoch in range(t.epochs) for chunk in chunks]
        progress = run.receipt.get("progress") or {"steps_done": 0, "state_path": None}
        done = progress["steps_done"]
        if done:
            log.line(f"resuming after step {done} of {len(steps)}, from the state saved "
                     f"then: {progress['state_path']}")
            loaded = await client.load_state_with_optimizer_async(progress["state_path"])
            await loaded.result_async()
        adam = sdk.types.AdamParams(learning_rate=t.learning_rate)
        for step, (epoch, chunk) in enumerate(steps[done:], start=done + 1):
            # Submitted together, awaited together: one clock cycle of the service.
            backward = await client.forward_backward_async(chunk, "cross_entropy")
            optim = await client.optim_step_async(adam)
            result = await backward.result_async()
            await optim.result_async()
            saved = await client.save_state_async(name=f"{run.key}-step-{step}")
            run.receipt["progress"] = {
                "steps_done": step, "steps": len(steps), "state_path": await _result_path(saved)
            }
            await run.save()
            log.line(f"epoch {epoch + 1} step {step} of {len(steps)}: {len(chunk)} examples, "
                     f"metrics {getattr(result, 'metrics', {})}")
        path: str = run.receipt["progress"]["state_path"]
        return path

    def _load_sdk(self) -> Any:
        if self._sdk is None:
            try:
                import tinker  # type: ignore[import-not-found]
            except ImportError:
                raise TrainingFailed(
                    f"tinker.backend is 'tinker' but the tinker SDK is not installed: {EXTRA_HINT}"
                ) from None
            self._sdk = tinker
        return self._sdk

    def _datum(self, sdk: Any, example: Example) -> Any:
        tokens, weights = self._tokens(example)
        if len(tokens) < 2:
            raise TrainingFailed("an example has fewer than two tokens; nothing to train on")
        # Next-token prediction: the input is every token but the last, each target the
        # token after it.
        return sdk.types.Datum(
            model_input=sdk.types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
        )

    def _tokens(self, example: Example) -> tuple[list[int], list[float]]:
        if example.tokens:
            masks = example.masks or example.tokens
            return list(example.tokens), [0.0 if m == -100 else 1.0 for m in masks]
        tokenizer = self._load_tokenizer()
        messages = example.record["messages"]
        tokens: list[int] = []
        weights: list[float] = []
        # Render growing prefixes and take what each message adds, so every token knows
        # which message it came from (only assistant turns are trained on).
        for i, message in enumerate(messages):
            ids = list(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
            added = ids[len(tokens) :]
            tokens = ids
            weights += [1.0 if message.get("role") == "assistant" else 0.0] * len(added)
        return tokens, weights

    def _load_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            name = self._tinker.tokenizer
            if not name:
                raise TrainingFailed(
                    "these traces carry no token ids: set tinker.tokenizer to the Hugging Face "
                    f"tokenizer of {self._tinker.model_id}"
                )
            try:
                self._tokenizer = load_tokenizer(name, download=True)
            except ImportError:
                raise TrainingFailed(f"tinker.tokenizer needs transformers: {EXTRA_HINT}") from None
        return self._tokenizer


@contextlib.contextmanager
def _sdk_errors(sdk: Any) -> Iterator[None]:
    """The SDK's errors (its APIError tree, the httpx errors under it) as TrainingFailed:
    translated here, as httpx translates httpcore's, so nothing above catches them."""
    foreign: tuple[type[Exception], ...] = tuple(
        t for t in (getattr(sdk, "APIError", None), httpx.HTTPError)
        if isinstance(t, type) and issubclass(t, Exception)
    )
    try:
        yield
    except foreign as exc:
        raise TrainingFailed(f"the tinker service failed: {type(exc).__name__}: {exc}") from exc


async def _result_path(future: Any) -> str:
    return str((await future.result_async()).path)
