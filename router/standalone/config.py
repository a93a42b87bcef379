"""The standalone router's settings: one dataclass, one ``prefixserve router`` flag per field.

Job: say which replicas the router fronts, which policy ranks them, how it checks
their health and load, how often it retries, and which requests it refuses before
reading them (the same head and body limits as ``prefixserve replica``, so a
request the router accepts is one a replica accepts), and its tenants (flow control).
Pure: no HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prefixserve.common.body_limits import DEFAULT_CLIENT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from prefixserve.router.flow_control.controller import FlowConfig
from prefixserve.router.flow_control.tenants import TenantTable, load_tenants
from prefixserve.router.policies import DEFAULT_POLICY, POLICIES, check_options, pick_options
from prefixserve.router.routing_key import PrefixKeyConfig
from prefixserve.router.standalone.http_server import ServerLimits

# A replica's head limits (replica/entrypoints/openai/server.py ServerConfig): the largest request line
# plus headers (uvicorn's h11 knob) and the most header fields. The router must not load the replica's
# HTTP front end, so these are stated here; tests/router/standalone compares them with the replica's.
DEFAULT_MAX_HEAD_BYTES = 32 * 1024
DEFAULT_MAX_HEADER_COUNT = 100
# Flow control's slots per replica when not given: the replicas' default batch (our max_num_seqs).
DEFAULT_SLOTS_PER_REPLICA = 64
# The router's default port: where ``prefixserve up`` serves the cluster's endpoint (the router is one).
DEFAULT_ROUTER_PORT = 8000


# ``--kv-events-hash``: how the replicas name their blocks (Contract 2 with either algorithm, or vLLM's).
# "prefixserve" is Contract 2 with the replicas' default digest (sha256), the same as "prefixserve-sha256".
HASH_SCHEMES = ("prefixserve", "prefixserve-sha256", "prefixserve-xxh3_128", "vllm")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def replica_name(url: str) -> str:
    """The ring name of the replica at ``url``: its ``host:port``, as nginx and ``prefixserve route`` name it.

    ValueError for anything but an ``http://`` or ``https://`` URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a replica must be an http:// or https:// URL with a host, got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"a replica URL has a bad port: {url!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


@dataclass(frozen=True)
class KVEventSpec:
    """One ``--kv-events`` value: a replica (its ring name) and its publisher's PUB and replay addresses."""

    replica: str
    endpoint: str
    replay_endpoint: str | None = None


def parse_kv_events(spec: str, replicas: Mapping[str, str]) -> KVEventSpec:
    """``REPLICA_URL=ENDPOINT[,REPLAY_ENDPOINT]`` (vllm-router's ``--kv-event-source WORKER_URL=ENDPOINT``,
    with the replay socket after a comma). ``replicas``: the router's ring names -> URLs; the URL must
    name one of them. ValueError for anything else."""
    url, sep, rest = spec.partition("=")
    if not sep or not url or not rest:
        raise ValueError(f"--kv-events takes REPLICA_URL=ENDPOINT[,REPLAY_ENDPOINT], got {spec!r}")
    name = replica_name(url)
    if name not in replicas:
        raise ValueError(f"--kv-events names {url!r}, which is not one of the --replica URLs")
    endpoint, _, replay = rest.partition(",")
    for address in (endpoint, replay):
        if address and not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"a KV event endpoint must be a tcp://, ipc:// or inproc:// address, got {address!r}")
        if "*" in address:
            raise ValueError(f"a KV event endpoint must name the replica's host, not a wildcard: {address!r}")
    return KVEventSpec(name, endpoint, replay or None)


@dataclass
class StandaloneRouterConfig:
    """What ``prefixserve router`` is told (its endpoint's host and port are common/endpoint_config.py's).

    Health: a replica is ejected (takes no new request) after ``unhealthy_after``
    failed ``GET /health`` probes in a row, or at once when it dies under a request
    (a connection refused or broken mid-answer); it is admitted again after
    ``healthy_after`` good probes in a row. Load: ``GET /metrics`` every
    ``metrics_interval_s``; a report older than ``load_max_age_s`` is not used.
    Retries: before the first byte of an answer, a connection error, 429 or 503
    moves the request to the next replica of the policy's ranking, at most
    ``max_attempts`` replicas in all.
    """

    replicas: list[str] = field(
        default_factory=list,
        metadata={"flag": "--replica", "help": "an OpenAI-compatible replica's base URL (http://host:port)"},
    )
    policy: str = field(
        default=DEFAULT_POLICY, metadata={"choices": tuple(POLICIES), "help": "the routing policy (router/policies/)"}
    )
    epsilon: float | None = field(
        default=None, metadata=_help("bounded_load's and placed's epsilon (default: the policy's)")
    )
    session_header: bool = field(
        default=False, metadata=_help("multi-turn affinity: key chat requests by X-Session-Id too")
    )
    key_turns: int = field(
        default=0, metadata=_help("multi-turn affinity: key chat requests by their first N turns too (0: off)")
    )
    health_interval_s: float = field(default=2.0, metadata=_help("seconds between GET /health probes of a replica"))
    health_timeout_s: float = field(default=2.0, metadata=_help("seconds a health probe may take before it fails"))
    unhealthy_after: int = field(default=3, metadata=_help("failed probes in a row that eject a replica"))
    healthy_after: int = field(default=2, metadata=_help("good probes in a row that admit an ejected replica again"))
    metrics_interval_s: float = field(
        default=1.0, metadata=_help("seconds between reads of a replica's /metrics (its running and waiting requests)")
    )
    load_max_age_s: float = field(default=10.0, metadata=_help("seconds a replica's load report is used for"))
    max_attempts: int = field(
        default=3, metadata=_help("replicas a request is tried on before its first byte (connect error, 429, 503)")
    )
    migrate_streams: bool = field(
        default=True,
        metadata=_help(
            "continue a stream on another prefixserve replica when its replica dies or stops mid-stream "
            "(replicas that list their models as owned by prefixserve)"
        ),
    )
    max_stream_migrations: int = field(default=3, metadata=_help("most times one stream moves to another replica"))
    connect_timeout_s: float = field(default=5.0, metadata=_help("seconds to connect to a replica"))
    read_timeout_s: float = field(
        default=600.0, metadata=_help("seconds a replica may send nothing while it answers (then the answer fails)")
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=_help("on SIGTERM, seconds the answers in flight may still run before the router stops"),
    )
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=_help("largest accepted request body (413)"))
    client_body_timeout_s: float = field(
        default=DEFAULT_CLIENT_BODY_TIMEOUT_S,
        metadata=_help("seconds a client may take to send a whole request body (408)"),
    )
    h11_max_incomplete_event_size: int = field(
        default=DEFAULT_MAX_HEAD_BYTES, metadata=_help("largest request line plus headers, in bytes (431)")
    )
    h11_max_header_count: int = field(
        default=DEFAULT_MAX_HEADER_COUNT, metadata=_help("most header fields a request may carry (431)")
    )
    kv_events: list[str] = field(
        default_factory=list,
        metadata={
            "flag": "--kv-events",
            "help": "a replica's KV event publisher: REPLICA_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT] "
            "(repeat per replica; needs --policy placed and --tokenizer)",
        },
    )
    kv_events_block_size: int = field(default=16, metadata=_help("the replicas' KV block size, in tokens"))
    kv_events_hash: str = field(
        default="prefixserve",
        metadata={
            "choices": HASH_SCHEMES,
            "help": "how the replicas hash blocks: prefixserve's Contract 2 (default sha256, or xxh3_128) "
            "or vLLM's sha256_cbor",
        },
    )
    kv_events_seed: str | None = field(
        default=None,
        metadata=_help("the replicas' hash seed (default: prefixserve-v1, or vLLM's unset-PYTHONHASHSEED seed)"),
    )
    kv_events_max_entries: int = field(
        default=1_000_000, metadata=_help("most (block, replica) pairs the KV event index holds")
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_help("the replicas' tokenizer folder (tokenizer.json and chat template), to hash prompts"),
    )
    tenants: str | None = field(
        default=None,
        metadata=_help(
            "tenant file (YAML or JSON, docs/flow_control.md): quotas, weights and priority bands per tenant, "
            "and a fair queue in front of the replicas; none: no flow control"
        ),
    )
    flow_max_in_flight: int = field(
        default=0,
        metadata=_help(
            f"flow control: requests forwarded at once before the fair queue holds the rest "
            f"(0: {DEFAULT_SLOTS_PER_REPLICA} per replica, the replicas' default batch)"
        ),
    )
    flow_reserved_slots: int = field(
        default=0, metadata=_help("flow control: of those slots, how many only the best priority band may take")
    )
    queue_budget_s: float = field(
        default=FlowConfig().queue_budget_s, metadata=_help("flow control: longest wait for a slot before a 503")
    )
    max_queued: int = field(
        default=FlowConfig().max_queued, metadata=_help("flow control: most requests waiting at once (then 503)")
    )

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, list) or not self.replicas:
            raise ValueError("the router needs at least one replica (--replica URL)")
        names = [replica_name(u) for u in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replicas must be distinct host:port, got {names}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        check_options(self.policy, **self.policy_options)
        _ = self.key_config  # PrefixKeyConfig refuses a bad key_turns: here, before the router starts
        for name in ("unhealthy_after", "healthy_after", "max_attempts", "max_body_bytes"):
            _check_int(name, getattr(self, name))
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            _check_int(name, getattr(self, name))
        if not isinstance(self.kv_events, list):
            raise ValueError("kv_events must be a list of REPLICA_URL=ENDPOINT[,REPLAY_ENDPOINT]")
        for name in ("kv_events_block_size", "kv_events_max_entries"):
            _check_int(name, getattr(self, name))
        if self.kv_events_hash not in HASH_SCHEMES:
            raise ValueError(f"kv_events_hash must be one of {', '.join(HASH_SCHEMES)}, got {self.kv_events_hash!r}")
        if self.tenants is not None:
            self.tenant_table()  # a malformed file stops the router before it starts, with the line
        if isinstance(self.max_stream_migrations, bool) or not isinstance(self.max_stream_migrations, int):
            raise ValueError(f"max_stream_migrations must be an integer >= 0, got {self.max_stream_migrations!r}")
        if self.max_stream_migrations < 0:
            raise ValueError(f"max_stream_migrations must be an integer >= 0, got {self.max_stream_migrations}")
        if isinstance(self.flow_max_in_flight, bool) or not isinstance(self.flow_max_in_flight, int):
            raise ValueError(f"flow_max_in_flight must be an integer >= 0, got {self.flow_max_in_flight!r}")
        self.flow_config()
        if self.kv_events:
            specs = self.kv_event_specs
            if len({s.replica for s in specs}) != len(specs):
                raise ValueError("--kv-events names a replica twice")
            if self.policy != "placed":
                raise ValueError("--kv-events feeds the placed policy: use --policy placed")
            if not self.tokenizer:
                raise ValueError("--kv-events needs --tokenizer (the replicas' tokenizer folder) to hash prompts")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "metrics_interval_s",
            "load_max_age_s",
            "connect_timeout_s",
            "read_timeout_s",
            "client_body_timeout_s",
            "drain_timeout_s",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    @property
    def policy_options(self) -> dict[str, object]:
        """The options given that the policy takes (router/policies/ ``pick_options``)."""
        # KV events say which replica holds a key's prefix: placed's precise mode uses it.
        return pick_options(self.policy, {"epsilon": self.epsilon, "precise": True if self.kv_events else None})

    @property
    def key_config(self) -> PrefixKeyConfig:
        """How a request's routing key is derived (router/routing_key.py)."""
        return PrefixKeyConfig(session_header=self.session_header, key_turns=self.key_turns)

    @property
    def kv_event_specs(self) -> list[KVEventSpec]:
        """The ``--kv-events`` values, parsed (ValueError for a bad one)."""
        urls = self.replica_urls
        return [parse_kv_events(spec, urls) for spec in self.kv_events]

    def tenant_table(self) -> TenantTable | None:
        """The tenants of ``--tenants`` (TenantFileError, a ValueError, naming the line); None without."""
        return load_tenants(self.tenants) if self.tenants is not None else None

    def server_limits(self) -> ServerLimits:
        """The head limits its HTTP server enforces (the replica's, so a forwarded head is one a replica reads)."""
        return ServerLimits(self.h11_max_incomplete_event_size, self.h11_max_header_count)

    def flow_config(self) -> FlowConfig:
        """Flow control's knobs (ValueError for bad ones)."""
        return FlowConfig(
            max_in_flight=self.flow_max_in_flight or DEFAULT_SLOTS_PER_REPLICA * max(1, len(self.replicas)),
            queue_budget_s=self.queue_budget_s,
            max_queued=self.max_queued,
            reserved_slots=self.flow_reserved_slots,
        )

    @property
    def replica_urls(self) -> dict[str, str]:
        """Each replica's ring name -> its base URL (no trailing slash), in the order given."""
        return {replica_name(u): u.rstrip("/") for u in self.replicas}


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
