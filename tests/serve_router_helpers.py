"""Fakes for the Serve request router's tests: replicas, pending requests, a router on a fake clock."""

from __future__ import annotations

import asyncio
import random
import uuid

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from prefixserve.replica.contract.request import EngineRequest
from prefixserve.router.serve.metrics import RouterMetrics
from prefixserve.router.serve.request_router import PrefixRouter, replica_name

DEPLOYMENT = DeploymentID(name="Engine", app_name="prefixserve")


class FakeReplica:
    """RunningReplica's routing surface; ``queue_len`` is what the replica reports when probed."""

    def __init__(self, unique_id: str, queue_len: int = 0, max_ongoing_requests: int = 8) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.queue_len = queue_len
        self.max_ongoing_requests = max_ongoing_requests
        self.node_id = "node-1"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict = {}
        self.is_cross_language = False
        self.probes = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        return self.queue_len

    @property
    def name(self) -> str:
        return replica_name(self.replica_id)


def make_router(policy: str = "bounded_load", **kwargs) -> PrefixRouter:
    router = PrefixRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(policy=policy, metrics=RouterMetrics(), **kwargs)
    return router


def pending(key: str | None) -> PendingRequest:
    request = EngineRequest(messages=[{"role": "user", "content": "hi"}], routing_key=key)
    rid = uuid.uuid4().hex
    return PendingRequest(
        args=[request], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid, is_streaming=True)
    )


def random_keys(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(64):016x}" for _ in range(n)]


def replicas(rng: random.Random, n: int, **kwargs) -> list[FakeReplica]:
    return [FakeReplica(f"{rng.getrandbits(40):010x}", **kwargs) for _ in range(n)]


async def route(router: PrefixRouter, request: PendingRequest) -> FakeReplica:
    """Route one request through the base class's loop, as Serve's Router does."""
    return await asyncio.wait_for(router._choose_replica_for_request(request), timeout=10)
