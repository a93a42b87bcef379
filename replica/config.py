"""EngineConfig: every knob of one engine replica, validated in one place.

The replica CLI (``prefixserve replica``), the Ray Serve deployment and the offline
``LLM`` all build this one dataclass. Validation happens in ``__post_init__`` and
raises ``ValueError`` whose message says what to change. A knob whose feature the
engine does not implement is refused rather than accepted and ignored.

Pure Python: no torch here (device strings are checked later by the model runner).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from prefixserve.common.config_util import add_cli_arguments, check_switches, from_cli_args, from_dict
from prefixserve.common.tracing import check_endpoint
from prefixserve.replica.contract.vllm_kv_events import KVEventsConfig
from prefixserve.replica.core.request_queue import SCHEDULING_POLICIES
from prefixserve.replica.kv.block_pool import EVICTION_POLICIES
from prefixserve.replica.kv.hashing import DEFAULT_HASH_ALGO
from prefixserve.replica.sampling_params import LOGPROBS_MODES
from prefixserve.replica.tool_calling.parsers import TOOL_CALL_PARSERS
from prefixserve.replica.tool_calling.templates import load_chat_template

HASH_ALGOS = ("xxh3_128", "sha256")
# vLLM's spellings of the block-hash algorithm (its knob ``prefix_caching_hash_algo``),
# mapped onto ours. vLLM serializes a block's key (parent, tokens, extra keys) with
# pickle or CBOR before hashing; we always use the language-neutral byte layout of
# docs/design.md (Contract 2), so only the digest function carries over:
#   sha256, sha256_cbor, sha256_cbor_64bit  -> sha256   (collision-resistant; untrusted tenants)
#   xxhash, xxhash_cbor                     -> xxh3_128 (vLLM's xxhash is xxh3_128 too)
#   builtin (vLLM < 0.10, Python's hash())  -> xxh3_128 (fast, not collision-resistant)
# Our own names map to themselves. Anything else is refused with the accepted list.
HASH_ALGO_ALIASES: dict[str, str] = {
    "xxh3_128": "xxh3_128",
    "sha256": "sha256",
    "sha256_cbor": "sha256",
    "sha256_cbor_64bit": "sha256",
    "xxhash": "xxh3_128",
    "xxhash_cbor": "xxh3_128",
    "builtin": "xxh3_128",
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
PREEMPTION_MODES = ("recompute", "swap")
KV_OFFLOADING_BACKENDS = ("native",)
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
DEFAULT_MODEL = "smollm2"
# Longest context an engine serves when the checkpoint allows more and the user
# does not ask: keeps the RoPE table and block tables small on CPU.
MAX_MODEL_LEN_CAP = 8192


@dataclass
class EngineConfig:
    """Knobs of one engine (vLLM's names where vLLM has one)."""

    model: str = DEFAULT_MODEL
    # Name reported by /v1/models and in metric labels; None = derived from ``model``.
    served_model_name: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Block-hash digest: "sha256" (default: collision-resistant, as vLLM's) or "xxh3_128" (faster,
    # for trusted clients only; replica/kv/hashing.py); vLLM's values are accepted too
    # (HASH_ALGO_ALIASES) and stored as ours.
    prefix_hash_algo: str = DEFAULT_HASH_ALGO
    # vLLM's name of the knob above, accepted as an alias (same values). When both are
    # given they must name the same algorithm.
    prefix_caching_hash_algo: str | None = None
    # Fraction of free accelerator memory given to weights + KV cache (CUDA only).
    gpu_memory_utilization: float = 0.9
    # KV cache size on CPU (on CUDA gpu_memory_utilization decides).
    kv_cache_memory_bytes: int = 512 * 1024**2
    # Exact number of KV blocks; overrides both sizing rules above.
    num_kv_blocks: int | None = None
    # "auto" = the activations' dtype; "fp8" / "fp8_e4m3" = float8 e4m3 (1 byte per element:
    # the same memory holds twice the fp16 blocks, four times the fp32 ones), stored as
    # x / scale with one K and one V scale per layer (vLLM's semantics, below).
    kv_cache_dtype: str = "auto"
    # fp8 only: compute each layer's K/V scales from the first forward pass
    # (amax(K) / 200, amax(V) / 100, as vLLM does); False = the checkpoint's scales
    # (``...self_attn.k_scale`` / ``v_scale`` and vLLM's other spellings) when it has
    # them, else 1.0.
    calculate_kv_scales: bool = False
    # Host memory (GiB) for swapped-out KV blocks (pinned on CUDA); needs preemption_mode="swap".
    swap_space_gb: float = 0.0
    # What a preempted sequence loses: "recompute" = its KV (freed; recomputed on resume,
    # with prefix hits on its cached blocks); "swap" = nothing (its private blocks are copied
    # to the swap_space_gb host pool and back, cached/shared ones kept by reference; when the
    # pool is full it is recomputed).
    preemption_mode: str = "recompute"
    # Host-memory KV tier (vLLM's --kv-offloading-size, GiB, summed over the tensor-parallel
    # ranks as in vLLM): evicted device blocks are kept in host memory (pinned on CUDA) and a
    # prefix lookup that misses on the device continues there (replica/kv/tiers.py). It shares
    # one host pool with swap_space_gb (each rank's pool holds both). None = no host tier.
    kv_offloading_size: float | None = None
    # vLLM's --kv-offloading-backend: "native" (the engine's own tier, the only one offered);
    # None = "native" when kv_offloading_size is set.
    kv_offloading_backend: str | None = None
    # Host/disk tier blocks copied back to the device per engine step, at most: a long prefix
    # beyond it is computed rather than stalling the running batch.
    kv_load_max_blocks_per_step: int = 512
    # Shared disk tier: a directory of content-addressed block files that every replica
    # pointing at it reads (replica/kv/disk_tier.py); needs kv_offloading_size. None = off.
    # Under tensor parallelism each rank writes and reads its own file of every block and
    # rank 0 decides; a block is a hit only when every rank's file verifies
    # (replica/executor/tp_disk.py). Replicas share files at one tensor_parallel_size only.
    kv_disk_path: str | None = None
    # The disk tier's bound (GiB of block files in kv_disk_path, every replica's together).
    kv_disk_size_gb: float = 16.0
    # A drain (SIGTERM, Serve's stop) writes the replica's most reused cached blocks that the
    # disk tier lacks to it for at most this long before the engine stops (0 = none).
    kv_drain_save_timeout_s: float = 3.0
    # None = the checkpoint's max_position_embeddings, capped at MAX_MODEL_LEN_CAP.
    max_model_len: int | None = None
    # Which free cached KV block is evicted first (replica/kv/block_pool.py EVICTION_POLICIES):
    # "slru" (default: blocks hit again are protected, one-shot ones leave first;
    # docs/benchmarks/eviction.md has the measurements), "lru" (vLLM's order), "lfu", "s3fifo".
    eviction_policy: str = "slru"
    # A finished request's blocks past its prompt (its answer) enter the cold end of the
    # eviction order, unless the request is a conversation turn (a chat with an earlier
    # assistant turn, or an X-Session-Id header): those come back in the next turn's
    # prompt. docs/benchmarks/eviction.md has the measurements; False = vLLM's order.
    evict_generated_first: bool = True
    # A chat request's static prefix (its leading system/developer messages, the prefix
    # the router keys on) is freed as reused content from its first request on: "slru"
    # puts it at protected's least recent end, so one-shot question blocks churn without
    # evicting a tenant's system prompt between its requests; the other policies ignore
    # it. docs/benchmarks/eviction.md, "The static prefix", has the measurements.
    protect_static_prefix: bool = True
    # prompt_cache_retention "24h" (replica/kv/pins.py): the share of the device's KV blocks that
    # retention pins may hold together (0 = none: such requests are served unpinned, and say so),
    # the share of that one owner (a tenant, else a client) may hold, and how long a pin lives
    # after its last hit. Pins give way to running requests before any preemption.
    cache_retention_budget: float = 0.5
    cache_retention_tenant_budget: float = 0.5
    cache_retention_ttl_s: float = 86400.0
    # Sliding-window attention: None = the checkpoint's (``sliding_window`` and per-layer
    # ``layer_types``); an int = that window on the checkpoint's windowed layers, or on every
    # layer of a checkpoint without any. Layers attend to the last ``sliding_window``
    # positions; when every layer is windowed, blocks wholly outside the window are freed
    # as decoding proceeds. max_model_len may exceed the window.
    sliding_window: int | None = None
    # Processes (GPUs on CUDA) one engine spans: query and KV heads, MLP columns and the
    # vocabulary are split over them (replica/executor/tensor_parallel.py); every sizing knob above
    # (gpu_memory_utilization, kv_cache_memory_bytes) applies to each rank, and the engine
    # gets the smallest block count any rank can hold.
    tensor_parallel_size: int = 1
    # Decode steps through static buffers replayed as CUDA graphs (replica/worker/graph_runner.py).
    # None = auto: on CUDA with tensor_parallel_size 1, eager elsewhere; True = always eager
    # (vLLM's enforce_eager); False = the static-buffer path wherever possible (uncaptured
    # on CPU and under tensor parallelism: the same code, for tests and debugging).
    enforce_eager: bool | None = None
    # Batch sizes captured (a decode batch is padded to the next one); None = 1, 2, 4, 8,
    # 16, 32, then every 32 up to max_num_seqs.
    cuda_graph_sizes: list[int] | None = None
    # Seconds any tensor-parallel collective may wait for a peer before the engine is
    # declared dead (a hung or lost worker fails loudly instead of stalling the replica).
    distributed_timeout_s: float = 120.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's --scheduling-policy: "fcfs" admits in arrival order and preempts the youngest;
    # "priority" admits by each request's ``priority`` (lower first, then arrival) and preempts
    # the lowest priority first (replica/core/scheduler.py). Under fcfs a request's priority
    # must be 0 (vLLM's 400 otherwise).
    scheduling_policy: str = "fcfs"
    # vLLM's --logprobs-mode: what a sampled token's logprobs are read from. "raw_logprobs" (vLLM
    # V1's default): the model's logits, before masks, bias, penalties, the grammar bitmask and
    # temperature; "processed_logprobs": those the token was drawn from; the "*_logits" variants
    # report the logits unnormalized (replica/sampling_params.py LOGPROBS_MODES).
    logprobs_mode: str = "raw_logprobs"
    # Bound on queued (not yet running) requests; beyond it add_request raises
    # EngineOverloadedError. None = unbounded.
    max_waiting_requests: int | None = 1024
    # After a fatal engine failure (model forward, KV invariants) in-flight requests fail and
    # the engine state is rebuilt around the loaded weights, at most this many times within
    # engine_restart_window_s; one more failure stops the engine for good (health checks fail).
    max_engine_restarts: int = 3
    engine_restart_window_s: float = 60.0
    # "auto" = float32 on CPU, the checkpoint's dtype (bf16 if fp32) on CUDA.
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    # "auto" = cuda when available, else cpu.
    device: str = "auto"
    # Structured output: a constraint whose grammar does not compile within this many seconds
    # is refused (400); compiled grammars are cached by (kind, spec), at most this many.
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    # What a constraint may ask before it is compiled (replica/structured_output/limits.py): a
    # counted repeat ({n}, {n,m}; nested ones multiplied) of at most max_grammar_repeat copies,
    # the squares of all of a spec's counts summing to at most its square (xgrammar's compile
    # time grows with the square: a{1000} in a schema pattern ~0.2 s, a{10000} 4.6 s), and
    # JSON-schema lengths and counts (maxLength, minItems, ...) of at most max_grammar_length.
    # Over either: 400 naming the knob.
    max_grammar_repeat: int = 1000
    max_grammar_length: int = 16384
    # The longest constraint spec (a schema's compact JSON, a regex, a grammar) compiled; at most
    # 65536 (what StructuredOutputsParams takes at all).
    max_grammar_spec_chars: int = 65536
    # The compile pool: grammar_compile_workers threads; one client's (API key or address)
    # compiles run on at most grammar_compile_workers_per_client of them, so one client's slow
    # schemas cannot hold every worker; at most grammar_compile_queue_size compiles wait,
    # grammar_compile_queue_per_client of one client; past either, 429 with Retry-After.
    grammar_compile_workers: int = 2
    grammar_compile_workers_per_client: int = 1
    grammar_compile_queue_size: int = 64
    grammar_compile_queue_per_client: int = 8
    # The most tools (function definitions) one chat request may carry: each is a JSON schema the
    # front end validates and text the template renders. More is a 400 before any of that
    # (OpenAI's limit, 128).
    max_tools_per_request: int = 128
    # The most nodes (objects, arrays, values) the tools' parameter schemas of one request may have
    # together: validating them costs about 0.1 ms a node, in a front-end worker thread; more is
    # a 400 before any is checked (128 tools of 10 string properties are ~5,600 nodes).
    max_tool_schema_nodes: int = 8192
    # Seconds the shared disk tier pauses its writes after a full disk (ENOSPC, EDQUOT, EFBIG):
    # the write is dropped, the directory trimmed, reads go on; then writes are tried again.
    kv_disk_full_backoff_s: float = 30.0
    # OpenTelemetry collector (vLLM's flag, e.g. http://127.0.0.1:4318): one llm_request span per
    # request with queue/prefill/decode children (common/tracing.py). None = no tracing.
    otlp_traces_endpoint: str | None = None
    # A Jinja chat template file (vLLM's --chat-template) that renders every chat request instead
    # of the checkpoint's; None = the checkpoint's, or, for a request with tools on a model whose
    # template renders none (SmolLM2's), the shipped ChatML/Hermes tool template
    # (replica/tool_calling/templates.py).
    chat_template: str | None = None
    # How generated text becomes tool calls (vLLM's --tool-call-parser names: "hermes",
    # "llama3_json"; replica/tool_calling/parsers.py). Needed, with enable_auto_tool_choice, for
    # tool_choice="auto"; "required" and a named function need neither.
    tool_call_parser: str | None = None
    # vLLM's --enable-auto-tool-choice: serve tool_choice="auto" (and requests with tools and no
    # tool_choice); without it they get vLLM's 400.
    enable_auto_tool_choice: bool = False
    # Per-step phase timers (replica/engine/step_timer.py): one clock read per phase per step
    # and around each KV manager call, exported as prefixserve:step_phase_seconds{phase}.
    # They never change a token; False skips the clock reads.
    enable_step_timers: bool = True
    # vLLM's async_scheduling: while one step's forward and sampling run on the engine's device
    # thread, the engine thread schedules the next step (the running sequences' next token a
    # placeholder filled from this step's sampled-token tensor) and processes the previous step's
    # outputs (replica/engine/step_pipeline.py). Same tokens as off; steps that need the last
    # tokens on the host first (n > 1, grammars, penalties, bad_words, prompt logprobs, a
    # possible preemption, the KV tiers) run synchronously. Off: on a CPU the forward's threads
    # already fill the cores, so overlap measured no faster there (docs/benchmarks/host_overhead.md).
    async_scheduling: bool = False
    # vLLM's --kv-events-config: a JSON object with vLLM's field names (enable_kv_cache_events,
    # publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic). Enabled, the
    # engine publishes every block stored and removed, one batch per step, in vLLM's ZMQ format
    # (replica/engine/kv_event_publisher.py) beside the routing-stats events. None = off.
    kv_events_config: str | None = None
    # LoRA adapters (vLLM's knobs; replica/lora/, docs/engine.md "LoRA adapters"): requests may
    # name a PEFT adapter on any of q/k/v/o/gate/up/down, mixed with base-model requests in one
    # batch. max_loras: adapters resident in the model's slots at once (a step's sequences use
    # at most this many; a request of another adapter waits); max_cpu_loras: adapters kept
    # loaded in host memory, least recently used evicted (None = max_loras); max_lora_rank: the
    # largest rank accepted. One rank only: refused with tensor_parallel_size > 1.
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    # Adapters served from the start, ``NAME=PATH`` each (vLLM's --lora-modules: several after one
    # flag, or the flag repeated): a request's ``model`` names one. Needs enable_lora.
    lora_modules: list[str] = field(default_factory=list, metadata={"several": True})

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        check_switches(self)  # also for LLM(**knobs), which does not go through from_dict
        check_endpoint(self.otlp_traces_endpoint, "otlp_traces_endpoint")
        if not self.model:
            raise ValueError("model must be a checkpoint directory, a .gguf file or 'smollm2'")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        self.prefix_hash_algo = resolve_hash_algo(self.prefix_hash_algo, self.prefix_caching_hash_algo)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("cache_retention_budget", "cache_retention_tenant_budget"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.cache_retention_ttl_s > 0:
            raise ValueError(f"cache_retention_ttl_s must be positive, got {self.cache_retention_ttl_s}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be at least 2 (or None to size from memory), got {self.num_kv_blocks}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}): raise it, lower max_model_len or enable chunked prefill"
            )
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1 (or None), got {self.max_waiting_requests}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        if not self.engine_restart_window_s > 0:
            raise ValueError(f"engine_restart_window_s must be positive, got {self.engine_restart_window_s}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}")
        if self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size must be at least 1, got {self.grammar_cache_size}")
        if not 1 <= self.max_grammar_spec_chars <= 65536:
            raise ValueError(f"max_grammar_spec_chars must be in [1, 65536], got {self.max_grammar_spec_chars}")
        if self.max_grammar_repeat < 1 or self.max_grammar_length < 1:
            raise ValueError(
                f"max_grammar_repeat and max_grammar_length must be at least 1, got {self.max_grammar_repeat} "
                f"and {self.max_grammar_length}"
            )
        if not 1 <= self.grammar_compile_workers_per_client <= self.grammar_compile_workers:
            raise ValueError(
                "grammar_compile_workers must be at least 1 and grammar_compile_workers_per_client in "
                f"[1, grammar_compile_workers], got {self.grammar_compile_workers} and "
                f"{self.grammar_compile_workers_per_client}"
            )
        if not self.kv_disk_full_backoff_s >= 0:
            raise ValueError(f"kv_disk_full_backoff_s must be >= 0, got {self.kv_disk_full_backoff_s}")
        if self.max_tool_schema_nodes < 1:
            raise ValueError(f"max_tool_schema_nodes must be at least 1, got {self.max_tool_schema_nodes}")
        if self.max_tools_per_request < 0:
            raise ValueError(f"max_tools_per_request must be >= 0, got {self.max_tools_per_request}")
        if not 0 <= self.grammar_compile_queue_per_client <= self.grammar_compile_queue_size:
            raise ValueError(
                "grammar_compile_queue_per_client must be in [0, grammar_compile_queue_size], got "
                f"{self.grammar_compile_queue_per_client} and {self.grammar_compile_queue_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        self._validate_lora()
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or not all(isinstance(n, int) and n >= 1 for n in self.cuda_graph_sizes)
        ):
            raise ValueError(
                f"cuda_graph_sizes must be a non-empty list of positive batch sizes (or None), "
                f"got {self.cuda_graph_sizes!r}"
            )
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                "calculate_kv_scales applies to an fp8 KV cache only: set kv_cache_dtype='fp8' "
                "or leave calculate_kv_scales off"
            )
        if self.preemption_mode == "swap" and not self.swap_space_gb > 0:
            raise ValueError(
                "preemption_mode='swap' needs a host swap pool: set swap_space_gb > 0 (e.g. 4, vLLM's default)"
            )
        if self.swap_space_gb > 0 and self.preemption_mode != "swap":
            raise ValueError(
                "swap_space_gb is used by swap preemption only: set preemption_mode='swap' or swap_space_gb=0"
            )
        self._validate_tiers()
        if self.tool_call_parser is not None:
            _choice("tool_call_parser", self.tool_call_parser, tuple(TOOL_CALL_PARSERS))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice needs a tool_call_parser (e.g. 'hermes') to read the model's tool calls"
            )
        if self.chat_template is not None:
            load_chat_template(self.chat_template)
        if self.kv_events_config is not None:
            if not isinstance(self.kv_events_config, str):
                raise ValueError(f"kv_events_config must be a JSON string, got {type(self.kv_events_config).__name__}")
            KVEventsConfig.from_json(self.kv_events_config)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None for the checkpoint's), got {self.sliding_window}")

    def _validate_tiers(self) -> None:
        if self.kv_offloading_backend is not None:
            _choice("kv_offloading_backend", self.kv_offloading_backend, KV_OFFLOADING_BACKENDS)
            if self.kv_offloading_size is None:
                raise ValueError(
                    "kv_offloading_backend is set but kv_offloading_size is not: give the tier a size (GiB)"
                )
        if self.kv_offloading_size is not None:
            if not self.kv_offloading_size > 0:
                raise ValueError(
                    f"kv_offloading_size must be > 0 GiB (or None for no host tier), got {self.kv_offloading_size}"
                )
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size keeps prefix-cache blocks: it needs enable_prefix_caching")
            if self.kv_offloading_backend is None:
                self.kv_offloading_backend = "native"
        if self.kv_load_max_blocks_per_step < 1:
            raise ValueError(f"kv_load_max_blocks_per_step must be >= 1, got {self.kv_load_max_blocks_per_step}")
        if not self.kv_drain_save_timeout_s >= 0:
            raise ValueError(f"kv_drain_save_timeout_s must be >= 0, got {self.kv_drain_save_timeout_s}")
        if self.kv_disk_path is not None:
            if not self.kv_disk_path:
                raise ValueError("kv_disk_path must be a directory path (or None for no disk tier)")
            if self.kv_offloading_size is None:
                raise ValueError("kv_disk_path needs the host tier (disk reads land in it): set kv_offloading_size")
            if not self.kv_disk_size_gb > 0:
                raise ValueError(f"kv_disk_size_gb must be > 0, got {self.kv_disk_size_gb}")
            if self.calculate_kv_scales:
                raise ValueError(
                    "kv_disk_path with calculate_kv_scales: each replica computes its own fp8 scales, so their "
                    "blocks are not interchangeable; use the checkpoint's scales (calculate_kv_scales off)"
                )

    def _validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every resident adapter is also held in memory"
            )
        if not isinstance(self.lora_modules, list) or not all(isinstance(m, str) for m in self.lora_modules):
            raise ValueError(f"lora_modules must be a list of NAME=PATH strings, got {self.lora_modules!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (start with --enable-lora)")
        names = []
        for module in self.lora_modules:
            name, sep, path = module.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules takes NAME=PATH, got {module!r}")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters kept loaded in host memory (max_cpu_loras, or max_loras when unset)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def host_tier_enabled(self) -> bool:
        """Whether the engine keeps evicted blocks in host memory (kv_offloading_size)."""
        return self.kv_offloading_size is not None

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed ``kv_events_config`` (None when unset)."""
        return None if self.kv_events_config is None else KVEventsConfig.from_json(self.kv_events_config)

    @property
    def model_name(self) -> str:
        """The name clients use for this model."""
        if self.served_model_name:
            return self.served_model_name
        name = self.model.rstrip("/").rsplit("/", 1)[-1]
        return name[:-5] if name.endswith(".gguf") else name

    # -- conversions -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from a mapping (Serve config, JSON); unknown keys are an error."""
        return from_dict(cls, data, "engine config")

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
        """Add one ``--kebab-case`` option per field (defaults from the dataclass), but those of ``exclude``."""
        only = [f.name for f in fields(cls) if f.name not in exclude] if exclude else None
        add_cli_arguments(parser, cls, "engine", _CHOICES, only=only)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """Build from a namespace parsed with :meth:`add_cli_arguments`."""
        return from_cli_args(cls, args)


_CHOICES = {
    "prefix_hash_algo": tuple(HASH_ALGO_ALIASES),
    "prefix_caching_hash_algo": tuple(HASH_ALGO_ALIASES),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "preemption_mode": PREEMPTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "logprobs_mode": LOGPROBS_MODES,
    "eviction_policy": EVICTION_POLICIES,
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "tool_call_parser": tuple(TOOL_CALL_PARSERS),
    "kv_offloading_backend": KV_OFFLOADING_BACKENDS,
}


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _hash_algo(name: str, value: object) -> str:
    if not isinstance(value, str) or value not in HASH_ALGO_ALIASES:
        raise ValueError(
            f"{name} must be one of {HASH_ALGOS} or one of vLLM's spellings "
            f"{tuple(a for a in HASH_ALGO_ALIASES if a not in HASH_ALGOS)}, got {value!r}"
        )
    return HASH_ALGO_ALIASES[value]


def resolve_hash_algo(ours: str, vllm_alias: str | None) -> str:
    """Our algorithm name for ``prefix_hash_algo`` / vLLM's ``prefix_caching_hash_algo``.

    Either knob accepts either spelling; when both are set (``ours`` not the default)
    they must agree.
    """
    algo = _hash_algo("prefix_hash_algo", ours)
    if vllm_alias is None:
        return algo
    alias = _hash_algo("prefix_caching_hash_algo", vllm_alias)
    if algo != alias and ours != DEFAULT_HASH_ALGO:
        raise ValueError(
            f"prefix_hash_algo={ours!r} and prefix_caching_hash_algo={vllm_alias!r} name "
            "different algorithms: set only one of them"
        )
    return alias
