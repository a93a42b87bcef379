"""A request's errors and their HTTP status: the engine's, and the API errors front ends answer.

Below the engine and the front ends (as vLLM's engine errors carry their status): the input
processor raises the API errors too, and the contract's stream items carry one across Ray
(replica/contract/stream.py), so none of them needs the OpenAI protocol module. Front ends
map every other exception onto an API error (``error_from_exception`` in
replica/entrypoints/openai/protocol.py). Plain Python: no pydantic, no HTTP framework.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

# --- the engine's errors ----------------------------------------------------------------


class RequestRejected(ValueError):
    """The request can never be served as asked."""

    status_code: ClassVar[int] = 400


class PromptTooLongError(RequestRejected):
    """Prompt (plus max_tokens) does not fit max_model_len.

    ``param``: the request field that is too long (``"messages"`` for a chat, ``"prompt"``
    for a completion), named in the error answer.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled across Ray with its param (BaseException's default keeps only args).
        return type(self), (str(self), self.param)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (answered with Retry-After)."""

    status_code: ClassVar[int] = 429

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The engine failed while serving this one request (``internal_error``).

    The engine freed the request's blocks and keeps serving every other request;
    the cause is chained (``__cause__``) and logged, not spelled in the message.
    """

    status_code: ClassVar[int] = 500


class EngineDeadError(RuntimeError):
    """The engine loop has stopped or restarted; in-flight requests fail."""

    status_code: ClassVar[int] = 503


# --- the API errors: what a front end answers ------------------------------------------


class APIError(Exception):
    """An error a front end answers with the OpenAI error body and ``status_code``.

    ``retry_after_s`` is set for overload answers (HTTP 429/503); the front end
    sends it as the ``Retry-After`` header (whole seconds, rounded up).
    """

    status_code: int = 400
    error_type: str = "invalid_request_error"
    # Every 4xx/5xx names a code; a raise site may give a more precise one.
    default_code: str = "invalid_request"

    def __init_subclass__(
        cls,
        *,
        status_code: int | None = None,
        error_type: str | None = None,
        default_code: str | None = None,
        **kwargs: Any,
    ) -> None:
        # Each error states only what differs from APIError, in its class line.
        super().__init_subclass__(**kwargs)
        if status_code is not None:
            cls.status_code = status_code
        if error_type is not None:
            cls.error_type = error_type
        if default_code is not None:
            cls.default_code = default_code

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``
        (protocol.py's ErrorResponse is its schema)."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class BadRequestError(APIError):
    """Malformed body, missing or out-of-range fields, prompt too long (400)."""


class AuthenticationError(APIError, status_code=401, error_type="authentication_error", default_code="invalid_api_key"):
    """Missing or wrong API key (401)."""


class ModelNotFoundError(APIError, status_code=404, default_code="model_not_found"):
    """The request names a model this server does not serve (404)."""


class NotFoundError(APIError, status_code=404, default_code="not_found"):
    """The request names something this server does not hold for its sender, such as a stored response (404)."""


class PayloadTooLargeError(APIError, status_code=413, default_code="payload_too_large"):
    """The request body exceeds the server's limit (413)."""


class RequestTimeoutError(APIError, status_code=408, default_code="request_timeout"):
    """The client did not send its request (head or body) within the server's timeout (408)."""

    def headers(self) -> dict[str, str]:
        # The rest of a late body may still come: the connection cannot carry another request.
        return {**super().headers(), "Connection": "close"}


class HeaderFieldsTooLargeError(APIError, status_code=431, default_code="request_header_fields_too_large"):
    """The request's head (request line and headers) exceeds the server's size or count limit (431)."""


class OverloadedError(APIError, status_code=429, error_type="rate_limit_error", default_code="queue_full"):
    """The engine's waiting queue is full; retry after ``retry_after_s`` (429)."""


class ServiceUnavailableError(
    APIError, status_code=503, error_type="service_unavailable", default_code="service_unavailable"
):
    """The engine loop has died; the replica cannot serve (503)."""


class InternalServerError(APIError, status_code=500, error_type="server_error", default_code="internal_error"):
    """The server failed to serve the request (500)."""
