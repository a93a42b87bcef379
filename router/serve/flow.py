"""Flow control in the Ray ingress: who a request's tenant is, and a slot held while it runs.

Job: :class:`IngressFlow` puts router/flow_control/'s FlowController on the ingress's request
path. The front end asks :meth:`IngressFlow.tenant_of` right after the API key (unknown tenant:
403 before the body is read); the ingress's stream asks :meth:`IngressFlow.admit` before its
first send to a replica (priority range: 400, quota: 429, queue: wait or 503) and releases the
lease with the request's usage when the stream ends, however it ends.

The band is the request's priority when it asks one, else its tenant's default; when the
engines run the priority scheduling policy the band is also the priority they schedule by.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.router.flow_control.controller import FlowConfig, FlowController, Lease
from prefixserve.router.flow_control.tenants import TenantTable
from prefixserve.router.serve.metrics import FlowMetrics

# Characters per token when estimating a prompt's tokens before the engine has tokenized it.
CHARS_PER_TOKEN = 4


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header as the client sent it (None: no such header)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    try:  # ASGI servers decode header bytes as latin-1: back to the client's bytes, read as UTF-8
        return token.strip().encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return None


def estimated_tokens(request: EngineRequest) -> int:
    """What a request may use, before it ran: its prompt's characters over CHARS_PER_TOKEN (token ids
    counted as they are) plus the completion tokens it may generate (all ``n`` choices)."""
    if isinstance(request.prompt, list):
        prompt = len(request.prompt)
    elif request.prompt is not None:
        prompt = len(request.prompt) // CHARS_PER_TOKEN
    else:
        prompt = sum(len(str(m.get("content") or "")) for m in request.messages or []) // CHARS_PER_TOKEN
    completion = request.max_tokens_default or request.sampling.max_tokens
    return prompt + completion * request.sampling.n


class IngressFlow:
    """One ingress replica's flow control (see the module docstring)."""

    def __init__(self, table: TenantTable, config: FlowConfig, deployment: str) -> None:
        self.controller = FlowController(table, config, FlowMetrics(deployment))

    def tenant_of(self, headers: Mapping[str, str]) -> str:
        """The tenant named by the request's API key or tenant header (UnknownTenantError: 403)."""
        return self.controller.tenant_of(bearer_token(headers.get("authorization")), headers).name

    async def admit(self, request: EngineRequest, engine_by_priority: bool) -> Lease:
        """Wait for the request's slot; its lease (FlowRefusal: 400, 429 or 503)."""
        assert request.tenant is not None, "tenant_of names every request's tenant first"
        tenant = self.controller.table.by_name(request.tenant)
        assert tenant is not None
        band = self.controller.band_of(tenant, request.priority or None)
        if engine_by_priority:
            request.priority = band
        return await self.controller.admit(tenant, band, estimated_tokens(request))
