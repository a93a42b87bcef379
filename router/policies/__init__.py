"""Routing policies: given candidate replicas, their in-flight counts and a key, rank them.

One module per policy family, all pure Python (no Ray, no HTTP framework, no torch):

* base.py: the replica view, ``Decision``, the options, the decision kinds (KIND_*);
* load.py: ``round_robin``, ``random``, ``power_of_two`` (load only);
* consistent.py: ``consistent_hash``, ``bounded_load`` (the ring);
* placed.py: ``placed``, the default, over placement.py's table and history.py's index.

This module is the catalogue: ``POLICIES`` by name, ``make_policy``, and the
option helpers every caller (the Serve router, the app's argument checks, the
simulator, the nginx placement replay) goes through, so no caller re-encodes
which policy takes which option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from prefixserve.common.config_util import from_dict
from prefixserve.router.policies.base import (
    KIND_FALLBACK,
    KIND_HISTORY,
    KIND_NEW_CONVERSATION,
    KIND_NO_KEY,
    KIND_NO_RING,
    KIND_OWNER,
    KIND_PLACED,
    KIND_REPLICATED,
    KIND_SPILL,
    Configured,
    Decision,
    NoOptions,
    Policy,
    Replica,
    ReplicaLoad,
    ReplicaView,
    RingOptions,
    SeedOptions,
    adapters_full,
    by_load,
    effective_in_flight,
    holds_adapter,
    landed_kind,
    load_of,
)
from prefixserve.router.policies.consistent import BoundedLoad, BoundedLoadOptions, ConsistentHash, RingPolicy
from prefixserve.router.policies.load import PowerOfTwo, Random, RoundRobin
from prefixserve.router.policies.placed import BALANCE_EPSILON, Placed, PlacedOptions, in_flight_cap

__all__ = [
    "BALANCE_EPSILON",
    "DEFAULT_POLICY",
    "KIND_FALLBACK",
    "KIND_HISTORY",
    "KIND_NEW_CONVERSATION",
    "KIND_NO_KEY",
    "KIND_NO_RING",
    "KIND_OWNER",
    "KIND_PLACED",
    "KIND_REPLICATED",
    "KIND_SPILL",
    "POLICIES",
    "RING_POLICIES",
    "BoundedLoad",
    "BoundedLoadOptions",
    "ConsistentHash",
    "Decision",
    "NoOptions",
    "Placed",
    "PlacedOptions",
    "Policy",
    "PowerOfTwo",
    "Random",
    "Replica",
    "ReplicaLoad",
    "ReplicaView",
    "RingOptions",
    "RoundRobin",
    "SeedOptions",
    "accepted_options",
    "by_load",
    "check_options",
    "effective_in_flight",
    "in_flight_cap",
    "landed_kind",
    "adapters_full",
    "holds_adapter",
    "load_of",
    "make_policy",
    "pick_options",
    "policy_class",
]

POLICIES: dict[str, type[Configured]] = {
    RoundRobin.name: RoundRobin,
    Random.name: Random,
    PowerOfTwo.name: PowerOfTwo,
    ConsistentHash.name: ConsistentHash,
    BoundedLoad.name: BoundedLoad,
    Placed.name: Placed,
}
DEFAULT_POLICY = Placed.name
# Policies that place keys on the ring (their decisions report owners and spills).
RING_POLICIES = tuple(name for name, cls in POLICIES.items() if issubclass(cls, RingPolicy))


def policy_class(name: str) -> type[Configured]:
    """The policy class called ``name`` (ValueError lists the names)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


def accepted_options(name: str) -> tuple[str, ...]:
    """The option names policy ``name`` takes, as its ``Options`` declares them."""
    return tuple(f.name for f in fields(policy_class(name).Options))


def check_options(name: str, **options: Any) -> Any:
    """Validate ``options`` for policy ``name`` without building it; returns its Options."""
    return from_dict(policy_class(name).Options, options, f"{name} policy option")


def pick_options(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Of a caller's ``settings``, those policy ``name`` takes (None values left to the policy's default)."""
    taken = accepted_options(name)
    return {k: v for k, v in settings.items() if k in taken and v is not None}


def make_policy(name: str = DEFAULT_POLICY, **options: Any) -> Policy:
    """Build a policy by name; ``options`` must be among those its ``Options`` declares.

    Unknown options, and bad values, raise ValueError naming them.
    """
    return policy_class(name)(**options)
