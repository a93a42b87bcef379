"""OpenTelemetry traces (common/tracing.py): the engine's llm_request spans and the router's route spans.

The spans go to OpenTelemetry's own in-memory exporter; the engine runs a tiny
random Llama and the router runs inside Ray Serve's real RequestRouter base class
(test_serve_router.py's doubles), so what is checked is what a collector would get.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
from model_helpers import tiny_checkpoint
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from serve_router_helpers import make_router, pending, replicas

from prefixserve.common.tracing import RequestTracer, build_tracer, trace_headers
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.core import LLMEngine
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.router.ring import HashRing

# A client's W3C trace context: trace 4bf9..., its span 00f0...
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model = tiny_checkpoint(tmp_path_factory.mktemp("tracing") / "tiny")
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, max_model_len=256))


def run_to_end(engine: LLMEngine, prompt: list[int], params: SamplingParams, headers: dict | None) -> None:
    engine.add_request(None, prompt, params, trace_headers=headers)
    while engine.has_unfinished_requests():
        engine.step()


@contextlib.contextmanager
def traced_engine(engine: LLMEngine) -> Iterator[InMemorySpanExporter]:
    """The engine traced into an in-memory exporter for the block's duration."""
    exporter = InMemorySpanExporter()
    engine.tracer = RequestTracer(build_tracer("test", exporter=exporter), engine.model_name)
    try:
        yield exporter
    finally:
        engine.tracer = None


def test_engine_span_per_request_with_phases_under_the_callers_trace(engine):
    with traced_engine(engine) as exporter:
        prompt = list(range(5, 45))
        run_to_end(
            engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), {"traceparent": TRACEPARENT}
        )
        run_to_end(engine, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), None)
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "llm_request"]
    assert len(requests) == 2
    traced, untraced = requests
    assert traced.kind is SpanKind.SERVER
    assert format(traced.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(traced.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    assert untraced.parent is None and untraced.context.trace_id != traced.context.trace_id
    a = traced.attributes
    assert a["gen_ai.usage.prompt_tokens"] == 40 and a["gen_ai.usage.completion_tokens"] == 6
    assert a["gen_ai.response.finish_reason"] == "length"
    # The second request repeats the first one's prompt: its full blocks come from the cache.
    assert untraced.attributes["prefixserve.cached_prompt_tokens"] > 0
    for request in requests:
        phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id}
        assert sorted(phases) == ["decode", "prefill", "queue"]
        # The phases tile the request: queue, then prefill, then decode, inside the request's span.
        assert request.start_time == phases["queue"].start_time
        assert phases["queue"].end_time == phases["prefill"].start_time
        assert phases["prefill"].end_time == phases["decode"].start_time
        assert phases["decode"].end_time == request.end_time
        assert all(s.start_time <= s.end_time for s in phases.values())
    lat = traced.attributes
    assert lat["gen_ai.latency.e2e"] == pytest.approx(
        lat["gen_ai.latency.time_in_queue"]
        + lat["gen_ai.latency.time_in_model_prefill"]
        + lat["gen_ai.latency.time_in_model_decode"]
    )


def test_an_untraced_engine_records_nothing(engine):
    assert engine.tracer is None  # no otlp_traces_endpoint: the finish path skips tracing entirely
    run_to_end(engine, list(range(3, 20)), SamplingParams(temperature=0, max_tokens=2), {"traceparent": TRACEPARENT})


def test_trace_headers_keep_only_the_w3c_context():
    assert trace_headers({"traceparent": TRACEPARENT, "tracestate": "a=1", "authorization": "x"}) == {
        "traceparent": TRACEPARENT,
        "tracestate": "a=1",
    }
    assert trace_headers({"x-request-id": "r1"}) is None


def test_endpoint_must_be_an_http_url():
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        EngineConfig(otlp_traces_endpoint="localhost:4318")


async def test_route_span_per_decision_becomes_the_engines_parent():
    exporter = InMemorySpanExporter()
    router = make_router(tracer=build_tracer("router-test", exporter=exporter))
    rng = random.Random(21)
    reps = replicas(rng, 3)
    router.update_replicas(reps)
    key = f"{rng.getrandbits(64):016x}"
    request = pending(key)
    request.args[0].trace_headers = {"traceparent": TRACEPARENT}
    await router.choose_replicas(reps, request)
    (span,) = exporter.get_finished_spans()
    assert span.name == "route"
    assert format(span.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    owner = HashRing(sorted(r.name for r in reps)).owner(key)
    assert span.attributes["prefixserve.routing_key"] == key
    assert span.attributes["prefixserve.owner"] == owner == span.attributes["prefixserve.chosen"]
    # The request now carries the route span as its parent, for the engine replica.
    carried = request.args[0].trace_headers["traceparent"].split("-")
    assert carried[1] == TRACEPARENT.split("-")[1] and carried[2] == format(span.context.span_id, "016x")


async def test_an_untraced_router_leaves_the_request_alone():
    router = make_router()
    rng = random.Random(22)
    reps = replicas(rng, 2)
    router.update_replicas(reps)
    request = pending("k1")
    await router.choose_replicas(reps, request)
    assert request.args[0].trace_headers is None


def test_constrained_request_span_names_its_constraint_kind(engine):
    from prefixserve.replica.structured_output.params import StructuredOutputsParams

    with traced_engine(engine) as exporter:
        prompt = list(range(5, 25))
        run_to_end(
            engine,
            prompt,
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=(StructuredOutputsParams(regex="[0-9]{2}"))),
            None,
        )
        run_to_end(engine, prompt, SamplingParams(temperature=0, max_tokens=2), None)
    constrained, free = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert constrained.attributes["prefixserve.structured_output.kind"] == "regex"
    assert "prefixserve.structured_output.kind" not in free.attributes
