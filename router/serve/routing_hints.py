"""What the request router reads of a request: the typed hints the ingress attached.

Job: the one reader of a pending request's routing inputs. The ingress computes the
routing key (router/routing_key.py, Contract 1) and sets it on the EngineRequest it
sends (replica/contract/request.py) as the engine call's first positional argument.
Serve 2.60 gives no typed slot of its own for it: a ``PendingRequest`` carries the
call's args and kwargs and a ``RequestMetadata`` whose free fields are strings with
Serve meanings (``multiplexed_model_id`` steers Serve's own routing, ``session_id``),
and an extra argument would reach the engine's ``generate``. So the key rides on the
EngineRequest and :func:`routing_hints` reads it, by type.

Pure Python: Ray only for type checking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.replica.contract.request import EngineRequest

if TYPE_CHECKING:
    from ray.serve.request_router import PendingRequest


@dataclass(frozen=True)
class RoutingHints:
    """A generation request as the router sees it.

    key: the routing key the ingress computed (None: no affinity);
    request: the EngineRequest itself, whose prompt the router hashes for ``placed``'s
    history and whose trace context it replaces with its route span's.
    """

    key: str | None
    request: EngineRequest


def routing_hints(pending_request: PendingRequest | None) -> RoutingHints | None:
    """The hints of a generation request; None for anything else (no request, a control call)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if not isinstance(request, EngineRequest):
        return None
    return RoutingHints(request.routing_key or None, request)


def request_routing_key(pending_request: PendingRequest | None) -> str | None:
    """The routing key the request carries (None: no affinity, or not a generation request)."""
    hints = routing_hints(pending_request)
    return hints.key if hints is not None else None


def is_generation(pending_request: PendingRequest | None) -> bool:
    """True for a generation request (an EngineRequest first argument), not a control call."""
    return routing_hints(pending_request) is not None
