"""LLM: the offline batch API (like ``vllm.LLM``).

``LLM(model="smollm2", **engine_knobs).generate(prompts, params)`` adds every prompt
(text or token ids, so benchmarks can feed identical tokens to every engine), steps
the engine until all finish and returns one RequestOutput per prompt, in order.
``chat`` applies the checkpoint's chat template first. ``shutdown()`` (or leaving a
``with LLM(...) as llm:`` block) stops a tensor-parallel engine's worker processes;
they are also stopped when the interpreter exits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.engine.outputs import RequestOutput
from prefixserve.replica.engine.request_runner import is_conversation_turn
from prefixserve.replica.engine.step_pipeline import build_on_forward_thread
from prefixserve.replica.lora.request import LoRARequest
from prefixserve.replica.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2", **engine_knobs: Any) -> None:
        self.config = EngineConfig(model=model, **engine_knobs)
        self.engine = build_on_forward_thread(lambda: LLMEngine(self.config), self.config.async_scheduling)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (idempotent; nothing to do for TP 1)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salts: Sequence[str | None] | None = None,
        conversation: bool | Sequence[bool] = False,
        static_prefix_tokens: int | Sequence[int] = 0,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; ``params`` is one for all or one per prompt.

        ``conversation``: whether each prompt is a conversation turn whose answer a later
        prompt repeats (one for all or one per prompt; see EngineConfig.evict_generated_first).
        ``static_prefix_tokens``: each prompt's leading tokens that other prompts share, such
        as a system prompt's (one for all or one per prompt; EngineConfig.protect_static_prefix;
        ``chat`` derives them).
        ``lora_request``: the LoRA adapter to run with (vLLM's argument; the engine needs
        ``enable_lora``): one for all prompts or one per prompt, None for the base model.
        ``priority``: one per prompt (vLLM's argument): under the "priority" scheduling policy a
        lower value is admitted first and preempted last; each must be 0 under "fcfs".
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts: pass one or one each")
        salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
        loras = _per_prompt_lora(lora_request, len(prompts))
        order = {}
        turns = [conversation] * len(prompts) if isinstance(conversation, bool) else list(conversation)
        if len(turns) != len(prompts):
            raise ValueError(f"got {len(turns)} conversation flags for {len(prompts)} prompts: pass one or one each")
        statics = (
            [static_prefix_tokens] * len(prompts)
            if isinstance(static_prefix_tokens, int)
            else list(static_prefix_tokens)
        )
        if len(statics) != len(prompts):
            raise ValueError(
                f"got {len(statics)} static_prefix_tokens for {len(prompts)} prompts: pass one or one each"
            )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts: pass one each")
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            # Inside the try: a prompt refused midway leaves none of those before it queued.
            for i, (prompt, p, salt, turn, static, rank) in enumerate(
                zip(prompts, per_prompt, salts, turns, statics, priorities, strict=True)
            ):
                req = self.engine.add_request(
                    None,
                    prompt,
                    p,
                    salt,
                    conversation=turn,
                    static_prefix_tokens=static,
                    priority=rank,
                    lora_request=loras[i],
                )
                order[req.request_id] = i
            while self.engine.has_unfinished_requests():
                for update in self.engine.step():
                    if update.error is not None:
                        raise update.error
                    if update.output is not None:
                        results[order[update.request_id]] = update.output
                        if bar is not None:
                            bar.update(1)
                if self.engine.stalled:  # the scheduler rejects what can never run, so this is a bug
                    raise RuntimeError("the engine cannot make progress on the remaining requests")
        finally:
            # On an error the batch is abandoned: free whatever of it is still in the engine.
            for request_id in order:
                self.engine.abort_request(request_id)
            self.engine.drain()  # steps still in flight (async_scheduling) free what they hold
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of ``{"role", "content"}`` messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.input_processor.encode_chat(list(c), **template_kwargs) for c in conversations]
        turns = [is_conversation_turn(list(c), {}) for c in conversations]
        statics = [
            self.engine.input_processor.static_prefix_tokens(list(c), ids, **template_kwargs)
            for c, ids in zip(conversations, prompts, strict=True)
        ]
        return self.generate(
            prompts,
            params,
            use_tqdm=use_tqdm,
            conversation=turns,
            static_prefix_tokens=statics,
            lora_request=lora_request,
        )


def _per_prompt_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from ``generate``'s ``lora_request``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts: pass one or one each")
    return loras
