"""Prometheus metrics of one engine, under vLLM V1's names, types, buckets and labels.

vLLM's own dashboards and alerts (vllm/v1/metrics/loggers.py's PrometheusStatLogger)
work unchanged: every ``vllm:*`` series carries ``model_name`` and ``engine`` (the
engine index inside its process; always "0" here, one engine per replica process),
but ``vllm:lora_requests_info``, labelled as vLLM labels it. Our additions are
``prefixserve:*``; the seeds' ``vllm:gpu_prefix_cache_hit_rate`` gauge (hit tokens /
queried tokens since start) is kept for compatibility with their dashboards; prefer
``rate(vllm:prefix_cache_hits_total) / rate(vllm:prefix_cache_queries_total)``.

Each engine owns its own ``CollectorRegistry`` (several engines may live in one
process: tests, the benchmark). The engine calls ``observe_step`` after each step,
``observe_finished`` per finished request, ``observe_abort`` per aborted one;
nothing here reads engine internals. Also ``EngineStats``, the snapshot that
``AsyncEngine.stats()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixserve.common.metric_series import LabeledSeries

# vLLM V1's buckets (vllm/v1/metrics/loggers.py), so that histogram_quantile answers match.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# fmt: on
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# The one engine of a replica process (vLLM numbers its data-parallel engines 0..N-1).
ENGINE_INDEX = "0"
# vLLM's finish reasons, each pre-created in request_success_total so that rates exist from the start.
FINISH_REASONS = ("stop", "length", "abort")
PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class SwapTotals:
    """Cumulative swap counts since the engine started (prefixserve:preemptions{mode}, swapped blocks)."""

    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_in_fallbacks: int = 0

    def __add__(self, other: SwapTotals) -> SwapTotals:
        return SwapTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class PinTotals:
    """Cumulative retention-pin counts since the engine started (replica/kv/pins.py)."""

    refused: int = 0  # requests served unpinned: the pin budget could not hold them
    expired: int = 0  # pins whose time to live ran out
    released_for_room: int = 0  # pins given up so that running requests had blocks

    def __add__(self, other: PinTotals) -> PinTotals:
        return PinTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's load and cache, for health checks and routing."""

    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1 of KV blocks in use
    prefix_cache_hit_rate: float  # hit tokens / queried prompt tokens since start
    prefix_cache_queries: int  # prompt tokens looked up (caching on)
    prefix_cache_hits: int
    num_preemptions: int
    num_kv_blocks: int
    # LoRA adapters held in host memory (their requests start without a load), least recently
    # used first, and the loads from their files since start (EngineConfig.enable_lora).
    lora_loaded: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_capacity: int = 0  # max_cpu_loras (0: LoRA off)


@dataclass(frozen=True)
class FinishedRequestStats:
    """The phases of one finished request, as vLLM's request histograms define them.

    queued: arrival to first scheduled; prefill: first scheduled to first token;
    decode: first token to finish; inference: first scheduled to finish.
    """

    finish_reason: str
    e2e_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    n: int


class EngineMetrics:
    """One engine's Prometheus series (see the module docstring for names and labels)."""

    def __init__(self, model_name: str, max_model_len: int = 4096) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        series = LabeledSeries(self.registry, ["model_name", "engine"], (model_name, ENGINE_INDEX))
        g, c, h = series.gauge, series.counter, series.histogram
        token_buckets = build_1_2_5_buckets(max_model_len)
        # Scheduler state and cache
        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = c(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.hit_rate = g(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prefix-cache hit rate (tokens) since start. Kept for compatibility with earlier "
            "dashboards; prefer rate(vllm:prefix_cache_hits) / rate(vllm:prefix_cache_queries).",
        )
        # Counters
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = series.each(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FINISH_REASONS,
        )
        # Histograms of counts
        self.request_prompt_tokens = h(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = h(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = h(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = h(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        # Histograms of timing intervals
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        # vLLM's earlier name of the same per-token interval; its Grafana dashboard still queries it.
        self.tpot = h(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS
        )
        self.e2e = h(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue_time = h(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS
        )
        self.inference_time = h(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = h(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode_time = h(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS
        )
        # Ours
        # Swap preemption (preemption_mode="swap"): vLLM V0's gauges where it had them.
        self.swapped = g("vllm:num_requests_swapped", "Number of requests swapped to CPU.")
        self.cpu_cache_usage = g("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.")
        self.preemptions_by_mode = series.each(
            Counter,
            "prefixserve:preemptions",
            "Preemptions by how the sequence was set aside: swap (KV kept in the host pool) or recompute (KV dropped).",
            "mode",
            PREEMPTION_MODES,
        )
        self.swapped_out_blocks = c("prefixserve:swapped_out_blocks", "KV blocks copied to the host swap pool.")
        self.swapped_in_blocks = c("prefixserve:swapped_in_blocks", "KV blocks copied back from the host swap pool.")
        self.swap_in_fallbacks = c(
            "prefixserve:swap_in_fallbacks",
            "Swapped sequences resumed by recompute (they could not be swapped in even with nothing running).",
        )
        self._last_swap = SwapTotals()
        # Retention pins (prompt_cache_retention "24h"; replica/kv/pins.py).
        self.pinned_blocks = g("prefixserve:kv_pinned_blocks", "KV blocks held by prompt_cache_retention pins.")
        self.pin_refusals = c(
            "prefixserve:kv_pin_refusals",
            "Requests that asked for prompt_cache_retention 24h and were served unpinned (over the pin budget).",
        )
        self.pins_released = series.each(
            Counter,
            "prefixserve:kv_pins_released",
            "Pinned KV blocks unpinned: their time to live ran out (expired), or running requests needed the room.",
            "reason",
            ("expired", "room"),
        )
        self._last_pins = PinTotals()
        self.restarts = c(
            "prefixserve:engine_restarts", "Times the engine reset its state after a fatal step failure (weights kept)."
        )
        # Tool calling (replica/tool_calling/): finished sequences read for tool calls.
        self.tool_calls_parsed = c(
            "prefixserve:tool_calls_parsed", "Tool calls parsed from generated text (one per call returned)."
        )
        self.tool_call_parse_failures = c(
            "prefixserve:tool_call_parse_failures",
            "Sequences whose tool-call text did not parse (answered as content).",
        )
        # LoRA (replica/lora/): vLLM's info series, one sample whose labels name the adapters of the
        # running and the waiting requests (comma-joined, sorted) and max_loras, set to the time of
        # the last change (the previous label set is dropped, so one sample stands); plus the adapters
        # held in host memory and those in the model's slots.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests: the adapters of the running and the waiting requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._last_lora: tuple[str, str, str] | None = None
        self.loras_loaded = g("prefixserve:lora_adapters_loaded", "LoRA adapters held in host memory.")
        self.loras_resident = g("prefixserve:lora_adapters_resident", "LoRA adapters written in the model's slots.")
        # Which adapters are held (a router prefers a replica holding a request's adapter), as one
        # sample whose label names them, like vLLM's info series; and the loads from their files.
        self.lora_loaded_info = Gauge(
            "prefixserve:lora_adapters_loaded_info",
            "LoRA adapters held in host memory: one sample, its labels the adapter names (comma-joined, sorted) "
            "and how many it holds at most (max_cpu_loras).",
            ["loaded_lora_adapters", "max_cpu_loras"],
            registry=self.registry,
        )
        self._last_loaded: str | None = None
        self.lora_loads = Counter(
            "prefixserve:lora_adapter_loads",
            "LoRA adapters read from their files into host memory (the first time, and again after eviction).",
            registry=self.registry,
        )
        self._lora_loads_seen = 0
        # The front end's count of request fields it ignored (replica/entrypoints/openai/request_fields.py).
        self.ignored_fields = series.family(
            Counter,
            "prefixserve:ignored_request_fields",
            "Request fields this server does not know, ignored as vLLM ignores them, by field name "
            "(one per request that sent it).",
            "field",
        )
        self.startup = series.family(
            Gauge,
            "prefixserve:engine_startup_seconds",
            "Seconds this engine spent starting, by phase (see replica/model/startup.py).",
            "phase",
        )
        self.cache_bytes = series.family(
            Gauge,
            "prefixserve:request_cache_bytes",
            "Estimated bytes held by each memo or cache on the request path, by name (each is bounded in bytes).",
            "cache",
        )
        self._cache_config: Gauge | None = None
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    def observe_cache_config(self, info: Mapping[str, object]) -> None:
        """Publish ``vllm:cache_config_info`` (a gauge at 1 whose labels are the cache settings), once."""
        if self._cache_config is not None:
            return
        labels = {k: str(v) for k, v in info.items()}
        labels["engine"] = ENGINE_INDEX
        self._cache_config = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels), registry=self.registry
        )
        self._cache_config.labels(**labels).set(1)

    def observe_step(
        self,
        *,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        prefix_queries: int,
        prefix_hits: int,
        num_preemptions: int,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        """Record one step; the cumulative counters are passed as totals and turned into increments.

        A step that computed no tokens (an idle refresh after an abort or a reset) updates
        the gauges only, so ``vllm:iteration_tokens_total`` counts model iterations alone.
        """
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.prefix_queries.inc(prefix_queries - self._last_queries)
        self.prefix_hits.inc(prefix_hits - self._last_hits)
        self.preemptions.inc(num_preemptions - self._last_preemptions)
        self._last_queries, self._last_hits, self._last_preemptions = prefix_queries, prefix_hits, num_preemptions
        self.hit_rate.set(prefix_hits / prefix_queries if prefix_queries else 0.0)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)
        if num_prompt_tokens or num_generation_tokens:
            self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)

    def observe_lora(
        self,
        *,
        max_loras: int,
        running: Iterable[str],
        waiting: Iterable[str],
        loaded: Sequence[str],
        resident: int,
        num_loads: int,
        capacity: int,
    ) -> None:
        """Record which adapters the running and waiting requests use, the adapters held and the
        loads so far (``num_loads``: cumulative, turned into increments)."""
        labels = (str(max_loras), ",".join(sorted(set(waiting))), ",".join(sorted(set(running))))
        if labels != self._last_lora:
            self.lora_info.clear()
            self.lora_info.labels(*labels).set_to_current_time()
            self._last_lora = labels
        names = ",".join(sorted(loaded))
        if names != self._last_loaded:
            self.lora_loaded_info.clear()
            self.lora_loaded_info.labels(names, str(capacity)).set(1)
            self._last_loaded = names
        if num_loads > self._lora_loads_seen:
            self.lora_loads.inc(num_loads - self._lora_loads_seen)
            self._lora_loads_seen = num_loads
        self.loras_loaded.set(len(loaded))
        self.loras_resident.set(resident)

    def observe_swap(self, totals: SwapTotals, *, num_swapped: int, host_usage: float) -> None:
        """Record swap state; ``totals`` are cumulative and turned into increments."""
        self.swapped.set(num_swapped)
        self.cpu_cache_usage.set(host_usage)
        last = self._last_swap
        self.preemptions_by_mode["swap"].inc(totals.swap_preemptions - last.swap_preemptions)
        self.preemptions_by_mode["recompute"].inc(totals.recompute_preemptions - last.recompute_preemptions)
        self.swapped_out_blocks.inc(totals.swapped_out_blocks - last.swapped_out_blocks)
        self.swapped_in_blocks.inc(totals.swapped_in_blocks - last.swapped_in_blocks)
        self.swap_in_fallbacks.inc(totals.swap_in_fallbacks - last.swap_in_fallbacks)
        self._last_swap = totals

    def observe_pins(self, totals: PinTotals, *, num_pinned: int) -> None:
        """Record the retention pins; ``totals`` are cumulative and turned into increments."""
        self.pinned_blocks.set(num_pinned)
        last = self._last_pins
        self.pin_refusals.inc(totals.refused - last.refused)
        self.pins_released["expired"].inc(totals.expired - last.expired)
        self.pins_released["room"].inc(totals.released_for_room - last.released_for_room)
        self._last_pins = totals

    def observe_startup(self, phases: dict[str, float]) -> None:
        """Record the start-up time of each phase (StartupTimer.phases)."""
        for phase, seconds in phases.items():
            self.startup.labels(self.model_name, ENGINE_INDEX, phase).set(seconds)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def observe_finished(self, stats: FinishedRequestStats) -> None:
        """Record a request that finished (stop or length): its outcome, phases and sizes."""
        self.request_success[stats.finish_reason].inc()
        self.e2e.observe(stats.e2e_s)
        self.queue_time.observe(stats.queued_s)
        self.prefill_time.observe(stats.prefill_s)
        self.decode_time.observe(stats.decode_s)
        self.inference_time.observe(stats.inference_s)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        self.params_max_tokens.observe(stats.max_tokens)
        self.params_n.observe(stats.n)

    def observe_abort(self) -> None:
        """Count a request aborted before it finished (its client left); its timings are not recorded."""
        self.request_success["abort"].inc()

    def track_cache_bytes(self, cache: str, nbytes: Callable[[], float]) -> None:
        """Export ``nbytes()`` as ``prefixserve:request_cache_bytes{cache}``, read at each scrape."""
        self.cache_bytes.labels(self.model_name, ENGINE_INDEX, cache).set_function(nbytes)

    def observe_tool_calls(self, parsed: int, failures: int) -> None:
        """Count a finished request's parsed tool calls and its sequences whose tool calls did not parse."""
        if parsed:
            self.tool_calls_parsed.inc(parsed)
        if failures:
            self.tool_call_parse_failures.inc(failures)

    def observe_ignored_field(self, field: str) -> None:
        """Count one request that sent the unknown field ``field`` (a bounded label, see request_fields.py)."""
        self.ignored_fields.labels(self.model_name, ENGINE_INDEX, field).inc()

    def observe_restart(self) -> None:
        """Count one engine restart (AsyncEngine reset its state after a fatal failure)."""
        self.restarts.inc()
