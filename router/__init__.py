"""The cluster layer, one subpackage per concern.

* routing_key.py: the routing key (Contract 1); ring.py: the consistent-hash ring (Contract 3);
* policies/: the routing policies, one module per family, with placed's placement table and history;
* cluster_config.py: the app args of router, ingress and engine deployment (no Ray);
* serve/: the Ray Serve glue (request router, registry, ingress, app builder, metrics, drain);
* nginx/: nginx.conf rendering and the placement replay of nginx's key log;
* cli/: the ``prefixserve`` command and its ``up`` and ``route`` subcommands.

``prefix_hash`` and ``routing_key`` are Contract 1 of docs/design.md: the key any
client can compute to land on the replica that holds its prefix.
"""

from prefixserve.router.routing_key import (
    PrefixKeyConfig,
    adapter_key,
    prefix_hash,
    prompt_cache_key_hash,
    routing_key,
    static_prefix,
)

__all__ = ["PrefixKeyConfig", "adapter_key", "prefix_hash", "prompt_cache_key_hash", "routing_key", "static_prefix"]
