"""Connection-level limits of the standalone server: what a reverse proxy bounds before the application runs.

Job: an h11 protocol for uvicorn (:func:`limited_protocol`) that refuses, before
any ASGI code (and so before the API-key check) sees the request:

* a request head (request line and headers) larger than
  ``h11_max_incomplete_event_size`` bytes: 431, as soon as that many bytes are
  buffered without a complete head, so an endless header costs at most that
  much memory per connection (vLLM's fix of CVE-2025-48956 uses the same h11
  limit; uvicorn's httptools parser has none, so this protocol is always h11);
* more than ``h11_max_header_count`` header fields: 431;
* a head not complete ``client_header_timeout_s`` after the connection opened or
  the request's first byte arrived: 408 (nginx's ``client_header_timeout``);
* a request on a connection beyond ``limit_concurrency`` open connections (or
  while that many requests run): 503 with ``Retry-After`` (uvicorn's knob, with
  the OpenAI error body instead of uvicorn's plain text);

and closes a connection whose client has read nothing for ``send_timeout_s``
while the server had output waiting (nginx's ``send_timeout``): the application
then sees the client disconnect, so a stream it serves is aborted in the engine
and its KV blocks freed. The refusals carry the OpenAI error body and
``Connection: close``.

Imports uvicorn, h11 and the protocol models; no FastAPI, no engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from prefixserve.replica.errors import (
    APIError,
    BadRequestError,
    HeaderFieldsTooLargeError,
    RequestTimeoutError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits :func:`limited_protocol` enforces (None: unlimited); see the module docstring."""

    h11_max_incomplete_event_size: int
    h11_max_header_count: int
    client_header_timeout_s: float
    send_timeout_s: float
    limit_concurrency: int | None = None
    retry_after_s: float = 1.0


def limited_protocol(limits: ConnectionLimits) -> Any:
    """What uvicorn's ``Config(http=...)`` takes: a factory of :class:`LimitedH11Protocol` with ``limits``."""
    return functools.partial(LimitedH11Protocol, limits=limits)


def error_bytes(err: APIError) -> bytes:
    """A whole HTTP/1.1 answer carrying ``err``'s OpenAI error body, then ``Connection: close``."""
    body = json.dumps(err.body()).encode("utf-8")
    head = [
        f"HTTP/1.1 {err.status_code} {STATUS_PHRASES[err.status_code].decode()}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{name}: {value}" for name, value in _closing_headers(err).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def refusal_app(err: APIError) -> Any:
    """An ASGI app answering every request with ``err`` (and closing the connection)."""
    body = json.dumps(err.body()).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in _closing_headers(err).items()),
    ]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


def _closing_headers(err: APIError) -> dict[str, str]:
    return {"Connection": "close", **err.headers()}


class _HeadWatchingConnection(h11.Connection):
    """h11's server connection that reports each request head and remembers the last protocol error."""

    def __init__(self, max_incomplete_event_size: int, on_request: Any) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._on_request = on_request
        self.last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise
        if isinstance(event, h11.Request):
            self._on_request(event)
        return event


class _TimedFlowControl(FlowControl):
    """uvicorn's write flow control, but a client that reads nothing for ``timeout_s`` is disconnected."""

    def __init__(self, transport: asyncio.Transport, timeout_s: float) -> None:
        super().__init__(transport)
        self._timeout_s = timeout_s

    async def drain(self) -> None:
        try:
            await asyncio.wait_for(self._is_writable_event.wait(), self._timeout_s)
        except TimeoutError:
            log.warning("closing a connection whose client read nothing for %g s (send_timeout_s)", self._timeout_s)
            self._transport.abort()
            # abort() reports the lost connection on the next loop turn; let it mark the request disconnected.
            await asyncio.sleep(0)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = _HeadWatchingConnection(limits.h11_max_incomplete_event_size, self._on_request_head)
        self._app = self.app
        # Checked in _on_request_head instead, to answer with the OpenAI error body.
        self.limit_concurrency = None
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the request head ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _TimedFlowControl(transport, self.limits.send_timeout_s)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.client_header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is being sent: the head is not what we wait for
        if self.conn.trailing_data[0]:  # a client that began a request and stalled
            log.info(
                "closing a connection whose request head took over %g s (client_header_timeout_s)",
                self.limits.client_header_timeout_s,
            )
            self._refuse(
                RequestTimeoutError(f"the request head did not arrive within {self.limits.client_header_timeout_s:g} s")
            )
        else:  # nothing sent: close quietly, as an idle keep-alive connection is closed
            self.transport.close()

    def _on_request_head(self, event: h11.Request) -> None:
        """Choose the app of this request: the real one, or a refusal (too many headers, too many connections)."""
        self._disarm_head_timer()
        self.app = self._app
        limits = self.limits
        head_bytes = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if head_bytes > limits.h11_max_incomplete_event_size:
            # h11 bounds only a head still incomplete; one that arrived whole in one read is measured here.
            log.info(
                "refused a request head of %d bytes (h11_max_incomplete_event_size=%d)",
                head_bytes,
                limits.h11_max_incomplete_event_size,
            )
            self.app = refusal_app(self._head_too_large())
        elif len(event.headers) > limits.h11_max_header_count:
            log.info(
                "refused a request with %d header fields (h11_max_header_count=%d)",
                len(event.headers),
                limits.h11_max_header_count,
            )
            self.app = refusal_app(
                HeaderFieldsTooLargeError(
                    f"the request has {len(event.headers)} header fields; this server accepts at most "
                    f"{limits.h11_max_header_count}"
                )
            )
        elif limits.limit_concurrency is not None and (
            len(self.connections) > limits.limit_concurrency or len(self.tasks) >= limits.limit_concurrency
        ):
            log.warning(
                "refused a request over limit_concurrency=%d (%d connections, %d requests)",
                limits.limit_concurrency,
                len(self.connections),
                len(self.tasks),
            )
            self.app = refusal_app(
                ServiceUnavailableError(
                    f"this server holds its maximum of {limits.limit_concurrency} connections (limit_concurrency); "
                    "retry later",
                    code="too_many_connections",
                    retry_after_s=limits.retry_after_s,
                )
            )

    def send_400_response(self, msg: str) -> None:
        """h11 refused what the client sent: 431 for a head over the size limit, else 400."""
        error = self.conn.last_error
        if error is not None and error.error_status_hint == 431:
            log.info(
                "refused a request head over h11_max_incomplete_event_size=%d bytes",
                self.limits.h11_max_incomplete_event_size,
            )
            self._refuse(self._head_too_large())
        else:
            self._refuse(BadRequestError(f"invalid HTTP request: {error or msg}", code="invalid_http_request"))

    def _head_too_large(self) -> APIError:
        return HeaderFieldsTooLargeError(
            f"the request line and headers exceed {self.limits.h11_max_incomplete_event_size} bytes, "
            "the most this server accepts"
        )

    def _refuse(self, err: APIError) -> None:
        """Answer ``err`` outside h11's state machine (the head was never complete) and close."""
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(error_bytes(err))
            self.transport.close()
