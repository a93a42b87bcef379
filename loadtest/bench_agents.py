"""The agent workload through the engine (``bench_engine --agents-only``): prefix hits and TTFT, caching on/off.

Workload: ``loadtest/agent_workload.py`` (4 tenants, ~2,000-token system prompt
plus 6 tool definitions each, 3 sessions per tenant, 3 agent steps per
session whose history grows by a tool call and its result). Each request is
rendered as the replica renders it (the chat template with ``tools=``, the
shipped tool template on SmolLM2) and carries its static prefix (system
prompt + tools, ``InputProcessor.static_prefix_tokens``) for eviction protection.
Waves of one step each are generated as offline batches, one after the other,
so TTFT includes queueing within a wave. Greedy, fp32, SmolLM2.

Reports per engine (caching on, off): prefix-cache hit rate (cached prompt
tokens / prompt tokens, from the engine's counters), TTFT mean and p50 over
all requests and per step, wall time, and whether the two engines generated
the same tokens. Writes results/bench_agents.json.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from prefixserve.loadtest.agent_workload import AgentConfig, AgentRequest, agent_requests
from prefixserve.loadtest.harness.report import markdown_table


def render(engine: Any, waves: list[list[AgentRequest]]) -> list[list[tuple[list[int], int]]]:
    """Each request's prompt ids and static-prefix tokens, rendered by ``engine`` as its replica does."""
    out = []
    for wave in waves:
        rows = []
        for r in wave:
            ids = engine.input_processor.encode_chat(r.body["messages"], tools=r.body["tools"])
            rows.append(
                (ids, engine.input_processor.static_prefix_tokens(r.body["messages"], ids, tools=r.body["tools"]))
            )
        out.append(rows)
    return out


def run_engine(
    waves: list[list[AgentRequest]], output_len: int, caching: bool, kv_bytes: int, device: str = "auto"
) -> dict[str, Any]:
    """One engine over the workload's waves."""
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams
    from prefixserve.replica.tool_calling.templates import template_for

    llm = LLM("smollm2", enable_prefix_caching=caching, kv_cache_memory_bytes=kv_bytes, dtype="float32", device=device)
    try:
        rendered = render(llm.engine, waves)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len)
        llm.generate([rendered[0][0][0][:40]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        llm.engine.kv_manager.reset_prefix_cache()
        before = llm.engine.kv_manager.stats
        queried0, hit0 = before.prefix_query_tokens, before.prefix_hit_tokens
        per_step, ttfts, tokens, prompt_tokens, cached = [], [], [], 0, 0
        start = time.perf_counter()
        for wave in rendered:
            outs = llm.generate([ids for ids, _ in wave], params, static_prefix_tokens=[n for _, n in wave])
            sizes = [len(ids) for ids, _ in wave]
            step_ttfts = [o.ttft_s for o in outs]
            per_step.append(
                {
                    "requests": len(wave),
                    "ttft_mean_s": statistics.mean(step_ttfts),
                    "prompt_tokens_mean": statistics.mean(sizes),
                    "cached_share": sum(o.num_cached_tokens for o in outs) / sum(sizes),
                }
            )
            ttfts += step_ttfts
            tokens += [o.outputs[0].token_ids for o in outs]
            prompt_tokens += sum(sizes)
            cached += sum(o.num_cached_tokens for o in outs)
        wall = time.perf_counter() - start
        stats = llm.engine.kv_manager.stats
        queried = stats.prefix_query_tokens - queried0
        processor = llm.engine.input_processor
        template = template_for(processor.tokenizer.chat_template, processor.chat_template, True)
        return {
            "engine": f"prefixserve, caching {'on' if caching else 'off'}",
            "wall_s": wall,
            "requests": sum(map(len, rendered)),
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_mean": prompt_tokens / sum(map(len, rendered)),
            "static_prefix_tokens": rendered[0][0][1],
            "template": "the shipped ChatML tool template" if template else "the checkpoint's",
            "cached_prompt_tokens": cached,
            "cached_share": cached / prompt_tokens,
            "hit_rate": (stats.prefix_hit_tokens - hit0) / queried if queried else 0.0,
            "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p50_s": statistics.median(ttfts),
            "per_step": per_step,
            "token_ids": tokens,
        }
    finally:
        llm.shutdown()


def measure_agents(config: AgentConfig, kv_bytes: int, repeats: int = 1, device: str = "auto") -> dict[str, Any]:
    """Caching on and off over the agent workload (alternating, ``repeats`` runs each; the median by wall)."""
    from prefixserve.replica.model.loader import load_tokenizer, resolve

    waves = agent_requests(config, load_tokenizer(resolve("smollm2")))
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for _ in range(repeats):
        for caching in (True, False):
            runs[caching].append(run_engine(waves, config.output_len, caching, kv_bytes, device))
    rows = [sorted(runs[c], key=lambda r: r["wall_s"])[len(runs[c]) // 2] for c in (True, False)]
    same = sum(a == b for a, b in zip(rows[0]["token_ids"], rows[1]["token_ids"]))
    for caching, r in zip((True, False), rows):
        r["wall_s_runs"] = [round(x["wall_s"], 2) for x in runs[caching]]
        r.pop("token_ids")
    info = {k: rows[0][k] for k in ("requests", "prompt_tokens_mean", "static_prefix_tokens", "template")}
    info["waves"] = len(waves)
    return {"config": config.__dict__, "workload": info, "rows": rows, "same_tokens": f"{same}/{info['requests']}"}


def print_agents(result: dict[str, Any]) -> None:
    info, (on, off) = result["workload"], result["rows"]
    print(
        f"\nagent workload: {info['requests']} requests in {info['waves']} waves, prompt tokens mean "
        f"{info['prompt_tokens_mean']:.0f}, static prefix (system + tools) {info['static_prefix_tokens']} "
        f"tokens, template: {info['template']}"
    )
    header = (
        "engine | prefix hit rate | cached share of prompt tokens | TTFT mean (s) | TTFT p50 (s) | wall (s) | runs (s)"
    )
    cells = [
        [r["engine"], *(f"{r[k]:.3f}" for k in ("hit_rate", "cached_share", "ttft_mean_s", "ttft_p50_s"))]
        + [f"{r['wall_s']:.1f}", ", ".join(map(str, r["wall_s_runs"]))]
        for r in (on, off)
    ]
    print("\n" + markdown_table(header, cells))
    print(
        f"\nTTFT mean, caching off / on: {off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x; "
        f"same tokens: {result['same_tokens']}"
    )
    header = "step | requests | prompt tokens mean | cached share (on) | TTFT mean on (s) | TTFT mean off (s)"
    cells = [
        [k + 1, a["requests"], f"{a['prompt_tokens_mean']:.0f}", f"{a['cached_share']:.3f}"]
        + [f"{a['ttft_mean_s']:.3f}", f"{b['ttft_mean_s']:.3f}"]
        for k, (a, b) in enumerate(zip(on["per_step"], off["per_step"]))
    ]
    print("\n" + markdown_table(header, cells))
