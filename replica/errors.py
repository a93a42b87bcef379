"""Errors the engine raises for a request, so front ends map them to status codes."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served as asked (HTTP 400)."""


class PromptTooLongError(RequestRejected):
    """Prompt (plus max_tokens) does not fit max_model_len (HTTP 400).

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
    """The waiting queue is full; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The engine failed while serving this one request (HTTP 500, ``internal_error``).

    The engine freed the request's blocks and keeps serving every other request;
    the cause is chained (``__cause__``) and logged, not spelled in the message.
    """


class EngineDeadError(RuntimeError):
    """The engine loop has stopped or restarted; in-flight requests fail (HTTP 503)."""
