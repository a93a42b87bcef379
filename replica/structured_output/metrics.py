"""Prometheus series of structured output, on the engine's registry (``prefixserve:*``: vLLM has none)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from prefixserve.common.metric_series import LabeledSeries
from prefixserve.replica.structured_output.params import KINDS

# Compiles take ~1 ms (a cached tokenizer, a small schema) to seconds (large schemas, grammars).
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Why a constraint was refused: the backend cannot compile it, it took longer than the bound, it
# asks for more than the limits allow (limits.py), or too many compiles were waiting already.
FAILURE_REASONS = ("invalid", "timeout", "limit", "overloaded")


class StructuredOutputMetrics:
    """Structured-output requests by kind, compile time, grammar cache hits and misses, refusals."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0") -> None:
        series = LabeledSeries(registry, ["model_name", "engine"], (model_name, engine))
        self.requests = series.each(
            Counter,
            "prefixserve:structured_output_requests",
            "Requests with a structured-output constraint, by kind.",
            "kind",
            KINDS,
        )
        self.compile_time = series.histogram(
            "prefixserve:grammar_compile_seconds",
            "Seconds spent compiling a grammar (cache misses only).",
            COMPILE_BUCKETS,
        )
        self.cache_hits = series.counter(
            "prefixserve:grammar_cache_hits", "Grammar lookups answered by the compiled-grammar cache."
        )
        self.cache_misses = series.counter("prefixserve:grammar_cache_misses", "Grammar lookups that had to compile.")
        self.failures = series.each(
            Counter,
            "prefixserve:grammar_compile_failures",
            "Constraints refused: invalid, compiling past the time bound, over the limits, or the queue full.",
            "reason",
            FAILURE_REASONS,
        )
