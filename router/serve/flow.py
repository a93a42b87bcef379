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
from prefixserve.router.flow_control.estimate import estimated_tokens
from prefixserve.router.flow_control.metrics import FlowMetrics
from prefixserve.router.flow_control.tenants import TenantTable, bearer_token
from prefixserve.router.serve.metrics import router_metrics


class IngressFlow:
    """One ingress replica's flow control (see the module docstring)."""

    def __init__(self, table: TenantTable, config: FlowConfig, deployment: str) -> None:
        self.controller = FlowController(table, config, FlowMetrics(router_metrics().flow, deployment))

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
