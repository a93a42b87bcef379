"""OpenTelemetry traces of requests, as vLLM exports them (``--otlp-traces-endpoint``).

Job: when a component is given an OTLP endpoint, record one span per decision or
request with the W3C trace context the request arrived with as its parent:

* the engine: an ``llm_request`` span (SERVER) per finished request, from arrival to
  finish, with vLLM's ``gen_ai.*`` attributes and three children, ``queue``,
  ``prefill`` and ``decode``, laid out from the request's own timestamps (the
  engine records them anyway for its metrics, so tracing adds no clock reads on
  the hot path: the spans are built once, when the request ends);
* the router: a ``route`` span per routing decision (router/serve/request_router.py),
  whose context it passes on to the engine, so a trace reads client -> route ->
  llm_request -> queue/prefill/decode.

The trace context crosses processes as the W3C headers ``traceparent`` and
``tracestate`` (a plain dict on the EngineRequest), so only processes that trace
need OpenTelemetry installed (``pip install prefixserve[tracing]``).
Without an endpoint nothing here runs and nothing is imported.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

# The W3C trace-context headers carried from the client to the engine.
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers among ``headers`` (None when there are none)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def check_endpoint(endpoint: str | None, where: str) -> None:
    """Raise ValueError unless ``endpoint`` is None or an http(s) URL (``where`` names the setting)."""
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"{where} must be an http(s) URL, got {endpoint!r}")


def build_tracer(service_name: str, endpoint: str | None = None, exporter: SpanExporter | None = None) -> Tracer:
    """A tracer exporting to ``endpoint`` over OTLP/HTTP (batched), or to ``exporter`` (tests: synchronous).

    Raises RuntimeError naming the missing packages when OpenTelemetry is not installed.
    """
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "otlp_traces_endpoint needs OpenTelemetry: pip install 'prefixserve[tracing]' "
            "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
        ) from exc
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        if endpoint is None:
            raise ValueError("build_tracer needs an endpoint or an exporter")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError(
                "otlp_traces_endpoint needs opentelemetry-exporter-otlp-proto-http: pip install 'prefixserve[tracing]'"
            ) from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=_traces_url(endpoint))))
    # A provider of our own, not the process-global one: two engines in one process
    # (tests, offline use) each keep their own endpoint.
    return provider.get_tracer("prefixserve")


def _traces_url(endpoint: str) -> str:
    # vLLM's flag names the collector (http://host:4318); OTLP/HTTP posts spans to /v1/traces.
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def _parent_context(headers: Mapping[str, str] | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(headers or {}))


def _epoch_ns(monotonic_s: float, now_monotonic: float, now_epoch_ns: int) -> int:
    return now_epoch_ns - int((now_monotonic - monotonic_s) * 1e9)


@dataclass(frozen=True)
class RequestTiming:
    """When one request went through the engine's phases (``time.monotonic()`` seconds)."""

    arrival: float
    scheduled: float
    first_token: float
    finished: float


class RequestTracer:
    """The engine's spans: one ``llm_request`` with ``queue``/``prefill``/``decode`` children per request."""

    def __init__(self, tracer: Tracer, model_name: str) -> None:
        self._tracer = tracer
        self._model_name = model_name

    def record(
        self,
        request_id: str,
        timing: RequestTiming,
        attributes: Mapping[str, Any],
        parent_headers: Mapping[str, str] | None,
    ) -> None:
        """Emit the finished request's spans (called once, when it finishes)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        now_mono, now_ns = time.monotonic(), time.time_ns()

        def ns(t: float) -> int:
            return _epoch_ns(t, now_mono, now_ns)

        span = self._tracer.start_span(
            "llm_request", context=_parent_context(parent_headers), kind=SpanKind.SERVER, start_time=ns(timing.arrival)
        )
        span.set_attributes(
            {
                "gen_ai.request.id": request_id,
                "gen_ai.response.model": self._model_name,
                **attributes,
                "gen_ai.latency.time_in_queue": timing.scheduled - timing.arrival,
                "gen_ai.latency.time_to_first_token": timing.first_token - timing.arrival,
                "gen_ai.latency.time_in_model_prefill": timing.first_token - timing.scheduled,
                "gen_ai.latency.time_in_model_decode": timing.finished - timing.first_token,
                "gen_ai.latency.e2e": timing.finished - timing.arrival,
            }
        )
        inside = set_span_in_context(span)
        for name, start, end in (
            ("queue", timing.arrival, timing.scheduled),
            ("prefill", timing.scheduled, timing.first_token),
            ("decode", timing.first_token, timing.finished),
        ):
            self._tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(end))
        span.end(end_time=ns(timing.finished))


@contextmanager
def route_span(
    tracer: Tracer | None, parent_headers: Mapping[str, str] | None, attributes: Mapping[str, Any]
) -> Iterator[tuple[Span | None, dict[str, str] | None]]:
    """A ``route`` span around one routing decision; yields it and the headers that make it the parent.

    With no tracer it yields ``(None, parent_headers)`` and costs nothing.
    """
    if tracer is None:
        yield None, dict(parent_headers) if parent_headers else None
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with tracer.start_as_current_span(
        "route", context=_parent_context(parent_headers), kind=SpanKind.INTERNAL, attributes=dict(attributes)
    ) as span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        yield span, carrier
