"""Where an OpenAI endpoint listens, who may call it, how it logs: one config for both ways to serve.

Job: the fields ``prefixserve replica`` (one engine's server) and ``prefixserve up``
(the Ray Serve cluster) share, each flag generated from its field
(config_util.add_cli_arguments), so neither writes ``--host``, ``--port``,
``--api-key`` or ``--log-format`` by hand. The two differ only in the default
port: the cluster's endpoint is Serve's HTTP proxy (8000), and a standalone
replica takes the next port so that both run side by side.

Pure stdlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.common.logs import LOG_FORMATS

DEFAULT_HOST = "127.0.0.1"
# Serve's HTTP proxy's default port.
CLUSTER_PORT = 8000
REPLICA_PORT = 8001


@dataclass
class EndpointConfig:
    """The OpenAI endpoint of ``prefixserve up``: address, port, API keys, log format."""

    host: str = field(default=DEFAULT_HOST, metadata={"help": "address the OpenAI endpoint listens on"})
    port: int = field(default=CLUSTER_PORT, metadata={"help": "port of the OpenAI endpoint"})
    api_keys: list[str] = field(
        default_factory=list,
        metadata={"flag": "--api-key", "help": "require 'Authorization: Bearer KEY' on /v1/*"},
    )
    log_format: str = field(
        default="text",
        metadata={
            "choices": tuple(LOG_FORMATS),
            "help": "text lines, or one JSON object per line (time, level, request_id, replica, event); "
            "with the cluster, Serve's own logs too, in its JSON encoding (each line's request id is the "
            "X-Request-Id)",
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.api_keys, list) or any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {list(LOG_FORMATS)}, got {self.log_format!r}")


@dataclass
class ReplicaEndpointConfig(EndpointConfig):
    """The OpenAI endpoint of ``prefixserve replica``: the same fields on the replica's own port."""

    port: int = field(default=REPLICA_PORT, metadata={"help": "port of the OpenAI endpoint"})
