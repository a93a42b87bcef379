"""vLLM's CPU build generating with LoRA adapters: the peer tokens of ``bench_lora --vllm-python``.

Run by a *vLLM* interpreter, never by ours (vLLM's CPU build replaces torch, so it lives in a
virtualenv of its own): this file imports only the standard library at module level and vLLM
inside ``main``, and never imports prefixserve. ``loadtest/bench_lora.py --vllm-python PY``
writes the job (a JSON file: the model folder, the adapters' folders, the prompts' token ids,
each prompt's adapter index or -1 for the base model, ``max_tokens``, the LoRA limits) and runs
``PY -I vllm_lora.py JOB``; one JSON object comes back on the last line of stdout: each
prompt's greedy token ids, the base-model prompts' ids from an engine without LoRA, and the
versions.

vLLM's offline ``LLM`` with ``enable_lora``: fp32, greedy, ``ignore_eos``, every prompt in one
``generate`` call with its ``LoRARequest`` (so a batch mixes the adapters and the base model,
as the engine's run does). The base-model prompts run again on an ``LLM`` without LoRA: what
they give when no adapter is anywhere near them.
"""

from __future__ import annotations

import json
import os
import sys


def main(job_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with open(job_path) as f:
        job = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    common = {
        "model": job["model"],
        "dtype": "float32",
        "max_model_len": job["max_model_len"],
        "kv_cache_memory_bytes": job["kv_cache_memory_bytes"],
        "enable_prefix_caching": False,
        "seed": 0,
    }
    llm = LLM(**common, enable_lora=True, max_loras=job["max_loras"], max_lora_rank=job["max_lora_rank"])
    adapters = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
        params,
        lora_request=[adapters[i] if i >= 0 else None for i in job["adapter_of"]],
        use_tqdm=False,
    )
    base = [p for p, i in zip(job["prompts"], job["adapter_of"], strict=True) if i < 0]
    del llm
    plain = LLM(**common) if base else None
    base_outputs = (
        plain.generate([TokensPrompt(prompt_token_ids=p) for p in base], params, use_tqdm=False) if plain else []
    )
    print(
        json.dumps(
            {
                "vllm_version": vllm.__version__,
                "torch_version": torch.__version__,
                "python": sys.version.split()[0],
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "base_tokens_without_lora": [list(o.outputs[0].token_ids) for o in base_outputs],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
