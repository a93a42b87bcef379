"""The cluster layer: routing key, ring, policies, the Ray Serve router and ingress, nginx.

``prefix_hash`` and ``routing_key`` are Contract 1 of docs/design.md: the key any
client can compute to land on the replica that holds its prefix.
"""

from prefixserve.router.contracts.prefix import PrefixKeyConfig, prefix_hash, routing_key, static_prefix

__all__ = ["PrefixKeyConfig", "prefix_hash", "routing_key", "static_prefix"]
