"""Locust users speaking the OpenAI streaming chat API, recording TTFT and end-to-end latency.

Run it against ``prefixserve up`` (port 8000), nginx, or one ``prefixserve replica``::

    PREFIXSERVE_WORKLOAD=zipf_tenants PREFIXSERVE_WORKLOAD_PARAMS="num_tenants=20,num_requests=500" \\
    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 --csv results/load

Each request is reported as three locust entries: ``POST /v1/chat/completions``
(the whole HTTP exchange, as locust normally does), ``TTFT`` (time to the first
streamed content token) and ``E2E`` (time to the end of the stream), so the CSV
and the web UI show TTFT percentiles apart from end-to-end latency.

Environment variables (read when the locustfile is loaded):

* ``PREFIXSERVE_WORKLOAD``: a name from ``prefixserve.loadtest.workloads.WORKLOADS``
  (default ``shared_prefix``), or ``PREFIXSERVE_WORKLOAD_FILE``: a JSONL written
  by ``python -m prefixserve.loadtest.workloads`` (it wins when both are set);
* ``PREFIXSERVE_WORKLOAD_PARAMS``: ``"name=value,..."`` or a JSON object of the
  workload config's fields; ``PREFIXSERVE_SEED``: its seed;
* ``PREFIXSERVE_MODEL``: overrides every body's ``model`` (the served model name);
* ``PREFIXSERVE_SEND_PREFIX_HASH=1``: send ``X-Prefix-Hash`` (router/routing_key.py's
  key), for nginx's ``hash $http_x_prefix_hash consistent``;
* ``PREFIXSERVE_API_KEY``: sent as ``Authorization: Bearer ...``;
* ``PREFIXSERVE_STREAM=0``: non-streaming requests (TTFT then equals E2E).

Users take requests in workload order from one shared cursor (wrapping), so a
run replays the workload's sequence however many users there are.

This is the only module that imports locust (gevent monkey-patches the process).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

from locust import HttpUser, between, events, task

from prefixserve.loadtest.harness.sse import iter_events, starts_output
from prefixserve.loadtest.workloads import WorkloadRequest, generate, parse_params, read_jsonl
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, routing_key

CHAT_PATH = "/v1/chat/completions"


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def load_requests() -> list[WorkloadRequest]:
    """The workload chosen by the environment variables (see the module docstring)."""
    path = os.environ.get("PREFIXSERVE_WORKLOAD_FILE")
    if path:
        requests = read_jsonl(path)
    else:
        params: dict[str, Any] = parse_params(os.environ.get("PREFIXSERVE_WORKLOAD_PARAMS", ""))
        if "PREFIXSERVE_SEED" in os.environ:
            params["seed"] = os.environ["PREFIXSERVE_SEED"]
        requests = generate(os.environ.get("PREFIXSERVE_WORKLOAD", "shared_prefix"), params)
    if not requests:
        raise ValueError("the workload has no requests: check PREFIXSERVE_WORKLOAD_PARAMS")
    model = os.environ.get("PREFIXSERVE_MODEL")
    stream = _flag("PREFIXSERVE_STREAM", True)
    out = []
    for req in requests:
        body = dict(req.body)
        if model:
            body["model"] = model
        body["stream"] = stream
        out.append(WorkloadRequest(body, req.tenant, req.workload))
    return out


REQUESTS = load_requests()
SEND_PREFIX_HASH = _flag("PREFIXSERVE_SEND_PREFIX_HASH")
API_KEY = os.environ.get("PREFIXSERVE_API_KEY")
_cursor = itertools.count()


def _fire(request_type: str, name: str, seconds: float, length: int, exc: BaseException | None, **ctx: Any) -> None:
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=seconds * 1000.0,
        response_length=length,
        exception=exc,
        context=ctx,
    )


class ChatUser(HttpUser):
    """One client: sends the workload's next chat request and times its stream."""

    wait_time = between(0.0, 0.05)

    def headers_for(self, req: WorkloadRequest) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if API_KEY:
            headers["Authorization"] = f"Bearer {API_KEY}"
        if SEND_PREFIX_HASH:
            key = routing_key(req.body)
            if key is not None:
                headers[PREFIX_HASH_HEADER] = key
        return headers

    @task
    def chat(self) -> None:
        req = REQUESTS[next(_cursor) % len(REQUESTS)]
        name = req.workload or "chat"
        start = time.perf_counter()
        first: float | None = None
        chunks = 0
        error: BaseException | None = None
        with self.client.post(
            CHAT_PATH,
            data=json.dumps(req.body),
            headers=self.headers_for(req),
            stream=bool(req.body.get("stream")),
            catch_response=True,
            name=CHAT_PATH,
        ) as resp:
            try:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                if req.body.get("stream"):
                    first, chunks = self._read_stream(resp)
                else:
                    payload = resp.json()
                    if not payload.get("choices"):
                        raise RuntimeError("response has no choices")
                    first = time.perf_counter()
                    chunks = 1
                if first is None:
                    raise RuntimeError("the stream ended without a content token")
                resp.success()
            except Exception as exc:  # every failure is reported to locust, none kills the user
                error = exc
                resp.failure(exc)
        end = time.perf_counter()
        if error is None and first is not None:
            _fire("TTFT", name, first - start, 0, None, tenant=req.tenant)
            _fire("E2E", name, end - start, chunks, None, tenant=req.tenant)
        else:
            _fire("TTFT", name, end - start, 0, error, tenant=req.tenant)
            _fire("E2E", name, end - start, 0, error, tenant=req.tenant)

    @staticmethod
    def _read_stream(resp: Any) -> tuple[float | None, int]:
        """Read SSE lines; return the time of the first content delta and the number of chunks."""
        first = None
        chunks = 0
        for event in iter_events(resp.iter_lines()):
            if "error" in event:
                raise RuntimeError(f"error event in stream: {event['error']}")
            chunks += 1
            if first is None and starts_output(event):
                first = time.perf_counter()
        return first, chunks
