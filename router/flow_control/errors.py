"""The answers of flow control: each an OpenAI error with its status, code and reason header."""

from __future__ import annotations

from prefixserve.replica.errors import APIError

# Every refusal by flow control names its reason here (beside the error body's code).
REASON_HEADER = "X-Prefixserve-Reject-Reason"


class FlowRefusal(APIError):
    """A request flow control refuses; ``reason`` also goes in REASON_HEADER."""

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code, retry_after_s=retry_after_s)
        self.reason = reason

    def headers(self) -> dict[str, str]:
        return {**super().headers(), REASON_HEADER: self.reason}


class TenantRateLimitError(
    FlowRefusal, status_code=429, error_type="rate_limit_error", default_code="tenant_rate_limit_exceeded"
):
    """The tenant is over its requests or tokens per minute (429, Retry-After from its bucket)."""


class UnknownTenantError(FlowRefusal, status_code=403, error_type="permission_error", default_code="unknown_tenant"):
    """Neither the request's API key nor its tenant header names a tenant of the file (403)."""


class PriorityNotAllowedError(FlowRefusal, default_code="priority_not_allowed"):
    """The request asks a priority outside its tenant's range (400)."""


class QueueRefusal(FlowRefusal, status_code=503, error_type="service_unavailable", default_code="queue_timeout"):
    """The request waited its whole queue budget, or the queue is full (503, Retry-After)."""
