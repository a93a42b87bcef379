"""Cost profiles for the cluster simulator: seconds per uncached prefill token and per decode step.

Four profiles; every figure below says whether it was measured (and where) or derived (and from what):

* ``h100-70b-tp4`` (the simulator's default; ``cluster.yaml``'s replica): Llama-3.1-70B in bf16 on
  4 x H100 SXM with tensor parallelism 4, served by vLLM. Decode, measured: vLLM 0.6.0 on that
  replica and model served ShareGPT at a median TPOT of 23.58 ms at 4 requests/s and 29.15 ms at
  8 requests/s, with median end-to-end latencies of 2.92 s and 3.75 s (SGLang's
  ``benchmark/benchmark_vllm_060/README.md``, vLLM's own reproduction recipe of vllm-project/vllm#8176).
  By Little's law that is 11.7 and 30.0 requests in flight, so step(B) = 20.0 ms + 0.303 ms x B
  (the TPOT includes the prefills interleaved with the decodes, so the slope is an upper bound).
  Prefill, derived: 2 x 70.6e9 FLOPs a token over 4 x 989 bf16 dense TFLOPS (H100 SXM datasheet) at
  50% utilisation is 71 us a token; the fixed 40 ms is the 54 ms median TTFT SGLang measured on the
  same replica at 4 requests/s (ShareGPT prompts, ~200 tokens: 14 ms of compute) less that compute.
* ``h100-8b``: Llama-3.1-8B in bf16 on one H100 SXM, vLLM. Decode, measured: vLLM 0.6.0 streamed
  10 concurrent ShareGPT requests at 72 ms per 10-step chunk, 7.2 ms a token
  (LambdaLabsML/vllm-benchmark, ``results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json``);
  the per-sequence slope is derived (the KV of a 1,000-token context, 128 MiB, read at 3.35 TB/s:
  0.04 ms). Prefill, derived: 2 x 8.0e9 FLOPs a token over 989 TFLOPS at 50%: 32 us a token;
  fixed 18 ms, what is left of the 62 ms TTFT that run measured for 10 prompts of 1,369 tokens
  arriving together once their 44 ms of compute is taken out.
* ``seed-article``: the seed articles' own figures, measured on a loaded 70B deployment. The
  prefix-cache article gives a TTFT p50 of ~820 ms for a 512 + 100-token prompt computed whole and
  ~180 ms for the 100-token suffix alone: (820 - 180) / 512 = 1.25 ms per uncached token and
  180 - 125 = 55 ms fixed, about 18 times the 4 x H100 replica's idle prefill above (queueing
  is in it). The KV-internals article serves ~47 requests/s with 200-token outputs with prefix
  caching (9,400 decode tokens/s); at a batch of 256 that is a 27 ms decode step: 15 ms + 0.05 ms
  per sequence. Its tier and adapter figures are the 8B shape's (128 KiB a token, 25 GB/s, 84 MB),
  as the tables that cite this profile were run with them.
* ``cpu``: our engine on this 2-core machine, derived from ``results/bench_engine.json``
  when ``loadtest/bench_engine.py`` has written it (``profile_from_bench``);
  otherwise the documented default below, derived from the figures measured here for vLLM's CPU build on
  bench_engine's workload (SmolLM2, ~530-token prompts): TTFT 0.71 s for a
  miss, 0.10 s for a hit computing ~40 tokens alone, so
  (0.71 - 0.10) / 490 = 1.25 ms per uncached token and 0.05 s fixed; decode 30 ms + 2 ms per
  running sequence.

Decode steps grow with the batch: ``decode_step_s + B * decode_per_seq_s``.

KV tiers (the host-memory and shared disk tiers behind the device pool): a prompt token
whose KV comes back from a tier costs ``kv_bytes_per_token`` over that tier's copy rate
instead of its prefill time (``tier_load_s``; the copy is counted as if serialized with the
prefill, the conservative reading of the engine's side-stream overlap). Llama-3.1-8B in bf16
holds 32 layers x 8 KV heads x 128 x K and V x 2 bytes = 128 KiB a token; 70B 80 layers, 320 KiB.
Pinned host memory over PCIe 5 at 25 GB/s a GPU (half the ~50 GB/s one direction vLLM's
offloading connector measured on an H100 with 2 MB blocks, vLLM blog 2025-12-29), so 100 GB/s
for a 4-GPU replica whose GPUs each move their own shard; an NVMe disk at 6 GB/s. ``cpu``:
SmolLM2 in fp32 (30 x 3 x 64 x 2 x 4 = 45 KiB a token) and the copy rates docs/benchmarks/tiers.md
measured here (a 1,024-token restore, 64 blocks of 737 KB: host -> device in 23.5 ms, 2 GB/s;
disk -> host -> device in 101 ms, so about 0.6 GB/s for the disk read).

LoRA adapters: a replica that does not hold a request's adapter reads its files first
(``adapter_load_s``: ``adapter_bytes`` over the disk read rate, then over the host copy
rate). A rank-16 adapter on all seven projections in bf16: Llama-3.1-8B 32 layers
x 16 x (2 x 8192 + 2 x 5120 + 3 x 18432) x 2 bytes = 84 MB; 70B 80 layers x 16 x
(2 x 16384 + 2 x 9216 + 3 x 36864) x 2 bytes = 414 MB; SmolLM2-135M in fp32
(30 x 16 x (2 x 1152 + 2 x 768 + 3 x 2112) x 4 bytes) = 19.5 MB.

Pure Python: json only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_BENCH_ENGINE = Path("results/bench_engine.json")


@dataclass(frozen=True)
class CostProfile:
    """Prefill time = ``prefill_overhead_s + uncached_tokens * prefill_s_per_token``;
    a decode step with B running sequences takes ``decode_step_s + B * decode_per_seq_s``."""

    name: str
    prefill_s_per_token: float
    prefill_overhead_s: float
    decode_step_s: float
    decode_per_seq_s: float
    source: str
    kv_bytes_per_token: int = 131_072
    host_copy_gbps: float = 25.0  # device <-> host tier, GB/s
    disk_read_gbps: float = 6.0  # shared disk tier -> host, GB/s (then host -> device as well)
    adapter_bytes: int = 83_886_080  # one LoRA adapter's weights

    def __post_init__(self) -> None:
        if (
            self.prefill_s_per_token <= 0
            or self.decode_step_s <= 0
            or self.prefill_overhead_s < 0
            or self.decode_per_seq_s < 0
            or self.kv_bytes_per_token <= 0
            or self.host_copy_gbps <= 0
            or self.disk_read_gbps <= 0
            or self.adapter_bytes <= 0
        ):
            raise ValueError(f"cost profile {self.name!r}: times must be positive (overhead, per-seq >= 0)")

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill_overhead_s + uncached_tokens * self.prefill_s_per_token

    def tier_load_s(self, host_tokens: int, disk_tokens: int) -> float:
        """Copy time of prompt tokens served by the host tier (``host_tokens``, disk ones included)
        and of the ``disk_tokens`` of them the host tier first read from disk."""
        nbytes = self.kv_bytes_per_token
        return host_tokens * nbytes / (self.host_copy_gbps * 1e9) + disk_tokens * nbytes / (self.disk_read_gbps * 1e9)

    def adapter_load_s(self) -> float:
        """Time to bring one LoRA adapter in: its files read from disk, then copied to the device."""
        nbytes = self.adapter_bytes
        return nbytes / (self.disk_read_gbps * 1e9) + nbytes / (self.host_copy_gbps * 1e9)

    def decode_step(self, batch: int) -> float:
        return self.decode_step_s + batch * self.decode_per_seq_s


CPU_DEFAULT = CostProfile(
    "cpu",
    1.25e-3,
    0.05,
    0.030,
    0.002,
    "default: vLLM CPU build here, bench_engine workload: 0.71 s miss / 0.10 s hit TTFT on ~530-token prompts",
    kv_bytes_per_token=46_080,
    host_copy_gbps=2.0,
    disk_read_gbps=0.6,
    adapter_bytes=19_537_920,
)
H100_70B_TP4 = CostProfile(
    "h100-70b-tp4",
    7.1e-5,
    0.040,
    0.0200,
    0.000303,
    "Llama-3.1-70B bf16 on 4 x H100 SXM (TP 4), vLLM 0.6.0: TPOT 23.6 / 29.2 ms at 11.7 / 30 in flight "
    "(SGLang benchmark_vllm_060); prefill 71 us/token at 50% of 4 x 989 TFLOPS, 40 ms fixed",
    kv_bytes_per_token=327_680,
    host_copy_gbps=100.0,
    adapter_bytes=414_187_520,
)
H100_8B = CostProfile(
    "h100-8b",
    3.2e-5,
    0.018,
    0.0068,
    0.00004,
    "Llama-3.1-8B bf16 on 1 x H100 SXM, vLLM 0.6.0: 7.2 ms a token at 10 in flight "
    "(LambdaLabsML/vllm-benchmark); prefill 32 us/token at 50% of 989 TFLOPS, 18 ms fixed",
)
SEED_ARTICLE = CostProfile(
    "seed-article",
    1.25e-3,
    0.055,
    0.015,
    0.00005,
    "seed articles, a loaded 70B deployment: 820 ms vs 180 ms TTFT (512+100 vs 100 tokens); "
    "47 req/s x 200 tokens at batch 256",
)
GPU_PROFILES = {p.name: p for p in (H100_70B_TP4, H100_8B, SEED_ARTICLE)}
PROFILE_NAMES = (*GPU_PROFILES, "cpu")


# The engine benchmark's prompts: 500 system + 30 question tokens (+ the chat
# template's ~15); its "alone hit" recomputes the 8 changed tail tokens plus
# the partial block before them (~16 tokens).
_BENCH_MISS_TOKENS = 545
_BENCH_HIT_TOKENS = 16


def profile_from_bench(data: Any, source: str) -> CostProfile | None:
    """Derive the CPU profile from ``loadtest/bench_engine.py``'s JSON, or None if it lacks the figures.

    Prefill: the TTFT of a whole prompt computed alone (caching off) against a
    warm-cache hit computed alone (caching on). Decode: the step time at batch
    1 and 32 from ``decode_tokens_per_s`` (step(B) = B / tokens_per_s(B)).
    """
    try:
        rows = {r["engine"]: r for r in data["rows"]}
        hit = float(rows["prefixserve, caching on"]["ttft_alone_hit_s"])
        miss = float(rows["prefixserve, caching off"]["ttft_alone_miss_s"])
        tps = {int(k): float(v) for k, v in data["decode_tokens_per_s"].items()}
        step1, step32 = 1 / tps[1], 32 / tps[32]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_token = (miss - hit) / (_BENCH_MISS_TOKENS - _BENCH_HIT_TOKENS)
    per_seq = max(0.0, (step32 - step1) / 31)
    if per_token <= 0 or step1 - per_seq <= 0:
        return None
    return CostProfile(
        "cpu",
        per_token,
        max(0.0, hit - _BENCH_HIT_TOKENS * per_token),
        step1 - per_seq,
        per_seq,
        f"measured by loadtest/bench_engine.py ({source}): TTFT alone {miss:.3f} s miss / "
        f"{hit:.3f} s hit; decode {tps[1]:.1f} tok/s at batch 1, {tps[32]:.1f} at 32",
        kv_bytes_per_token=CPU_DEFAULT.kv_bytes_per_token,
        host_copy_gbps=CPU_DEFAULT.host_copy_gbps,
        disk_read_gbps=CPU_DEFAULT.disk_read_gbps,
        adapter_bytes=CPU_DEFAULT.adapter_bytes,
    )


def cpu_profile(path: str | Path = DEFAULT_BENCH_ENGINE) -> CostProfile:
    """The CPU profile measured by the engine benchmark when its JSON exists, else the default."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return CPU_DEFAULT
    return profile_from_bench(data, str(p)) or CPU_DEFAULT


def get_profile(name: str, bench_engine: str | Path = DEFAULT_BENCH_ENGINE) -> CostProfile:
    """The profile called ``name`` (one of ``PROFILE_NAMES``); ``cpu`` is read from the engine benchmark."""
    if name == "cpu":
        return cpu_profile(bench_engine)
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    raise ValueError(f"unknown cost profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}")
