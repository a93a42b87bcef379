"""Prometheus metrics of one engine, under vLLM's names so existing dashboards work.

Each engine owns its own ``CollectorRegistry`` (several engines may live in one
process: tests, the benchmark); every series carries a ``model_name`` label. The
engine calls ``observe_step`` after each step and ``observe_finished`` per request;
nothing here reads engine internals. Also ``EngineStats``, the snapshot that
``AsyncEngine.stats()`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


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


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def c(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def h(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.hit_rate = g("vllm:gpu_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens), since start.")
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix-cache hits, in prompt tokens.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                     LATENCY_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.startup = Gauge("prefixserve:engine_startup_seconds",
                             "Seconds this engine spent starting, by phase (see replica/model/startup.py).",
                             ["model_name", "phase"], registry=r)
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    def observe_step(self, *, num_running: int, num_waiting: int, kv_usage: float, prefix_queries: int,
                     prefix_hits: int, num_preemptions: int, num_prompt_tokens: int,
                     num_generation_tokens: int) -> None:
        """Record one step; the cumulative counters are passed as totals and turned into increments."""
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

    def observe_startup(self, phases: dict[str, float]) -> None:
        """Record the start-up time of each phase (StartupTimer.phases)."""
        for phase, seconds in phases.items():
            self.startup.labels(self.model_name, phase).set(seconds)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
