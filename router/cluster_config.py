"""The cluster's configuration: the app args of the router, the ingress and the engine deployment.

Job: one home for every setting of the Serve application, free of Ray Serve, so
that the Serve config build (router/serve/app.py, ``serve deploy cluster.yaml``),
``prefixserve up`` (router/cli/up.py, whose flags are generated from these
fields with config_util.add_cli_arguments, as EngineConfig's are) and the
benchmarks share fields and defaults instead of copying them. Every section is
parsed strictly (config_util.from_dict: an unknown key is an error naming it
and the keys that exist).

The args (every key optional except ``engine``)::

    engine: {...}                  # EngineConfig fields (replica/config.py)
    models: []                     # more base models behind the same endpoint, each an engine
                                   #   section of its own (``model`` at least) plus its optional
                                   #   num_replicas: one engine deployment (and ring) per model
    num_replicas: 2                # or autoscaling: {min_replicas, max_replicas, ...}
    autoscaling: null              # Serve's autoscaling_config, passed through
    max_ongoing_requests: 64       # per engine replica; beyond it Serve tries the next ring replica
    ray_actor_options: {num_cpus: 1, num_gpus: 0}   # ONE tensor-parallel rank's resources (below)
    check_resources: true          # tensor_parallel_size > 1: refuse to build when no alive node
                                   #   can hold one replica's bundles (below); false for clusters
                                   #   whose autoscaler adds such nodes on demand
    health_check_period_s: 10
    health_check_timeout_s: 30
    drain_timeout_s: 30            # stopping: requests in flight run on this long, then end in-band;
                                   #   both deployments' Serve graceful_shutdown_timeout_s derive from it
    router:
      router_class: prefixserve    # | ray_llm_prefix_aware | "module:Class"
      policy: placed               # prefixserve router: round_robin, random, power_of_two,
                                   #   consistent_hash, bounded_load, placed (the default)
      epsilon: 0.1                 # any other key: an option of that policy, as its Options
                                   #   declares (router/policies/): epsilon, tau_s, precise, seed, ...
      kwargs: {}                   # other router classes: their initialize_state kwargs
      stats_period_s: 1.0          # how often replicas report record_routing_stats (load, KV events)
      stats_max_age_s: 10.0        # reports older than this are not used
    ingress:
      num_replicas: 1
      ray_actor_options: {num_cpus: 0}
      max_ongoing_requests: 1000000000   # Serve's cap per ingress replica: none, as Ray Serve LLM's
      api_keys: []                 # Bearer keys; empty = open
      max_body_bytes: 4194304
      max_attempts: 4              # sends per request while replicas die under it
      migrate_streams: true        # a stream whose replica dies or stops goes on on another one,
                                   #   token-exact (replica/contract/continuation.py)
      max_stream_migrations: 3     # ... at most this many times per request
      placement_sync_s: 2.0        # placed: how often ingress replicas agree on placements
      session_header: false        # multi-turn affinity: key by X-Session-Id (router/routing_key.py)
      key_turns: 0                 # multi-turn affinity: key by the first N turns too
      tenants: null                # flow control: {tenant_header, tenants: [...]}, the tenant file's
                                   #   shape (router/flow_control/tenants.py); null = none
      flow_max_in_flight: 0        # requests run at once per ingress replica before the fair queue
                                   #   holds them; 0 = the engines' batches (max_num_seqs) together
      queue_budget_s: 30           # the longest a request waits in the queue (then 503)
      max_queued: 1024             # waiting requests per ingress replica (one more: 503)
      flow_reserved_slots: 0       # of those slots, how many only the best band may take
      responses_max_entries: 10000 # /v1/responses: stored responses per ingress replica (LRU)
      responses_max_bytes: 268435456  # ... and their bytes

Invariants: the args are validated here, before anything is deployed, with
messages that say what to change; the engine config is checked with
EngineConfig's own validation; errors are ValueErrors (router/serve/app.py
turns them into the one-line AppArgsError Serve reports).

Imports no Ray: pure config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from prefixserve.common.body_limits import DEFAULT_CLIENT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from prefixserve.common.config_util import from_dict
from prefixserve.common.tracing import check_endpoint
from prefixserve.replica.config import EngineConfig
from prefixserve.router.flow_control.controller import FlowConfig
from prefixserve.router.flow_control.tenants import TenantTable, tenants_from_data
from prefixserve.router.policies import DEFAULT_POLICY, POLICIES, check_options
from prefixserve.router.routing_key import PrefixKeyConfig

# One replica's ranks share a node: rank 0 starts the others as local processes.
TP_PLACEMENT_STRATEGY = "STRICT_PACK"
# Serve's default num_cpus for a replica actor that does not say (ray/serve/_private/config.py).
SERVE_DEFAULT_NUM_CPUS = 1
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Serve's force-kill comes this long after the drain timeout: time to end what is left in-band and send it.
SHUTDOWN_MARGIN_S = 5.0
# How often a stopping replica looks whether its requests are done (Serve's default, 2 s, delays every stop).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5
# What Ray asks of a node for ``accelerator_type`` (ray/_common/utils.py, resources_from_ray_options).
ACCELERATOR_TYPE_RESOURCE = "accelerator_type:{}"
ACCELERATOR_TYPE_AMOUNT = 0.001


# The engine deployments' Serve names: the default model's, then "Engine-2", "Engine-3", ... for ``models``.
ENGINE_DEPLOYMENT = "Engine"
# Ray CPUs per engine replica (per tensor-parallel rank) unless ray_actor_options say otherwise.
DEFAULT_REPLICA_CPUS = 1
# Import path of prefixserve's request router for RequestRouterConfig(request_router_class=...).
ROUTER_CLASS_PATH = "prefixserve.router.serve.request_router:PrefixRouter"
# Ray Serve LLM's prefix-tree router (the comparison point of the cluster benchmark).
RAY_LLM_PREFIX_ROUTER_PATH = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)
# A replica's routing-stats report older than this (seconds since it arrived) is not used.
DEFAULT_STATS_MAX_AGE_S = 10.0
# Tries per request before a dead-replica failure is reported (one per replica
# that can die under it; Serve's controller replaces dead replicas meanwhile).
DEFAULT_MAX_ATTEMPTS = 4
# Moves of one stream to another replica (a replica dying under it each time).
DEFAULT_MAX_STREAM_MIGRATIONS = 3
# Requests one ingress replica takes at once (Ray Serve LLM's ingress default: unbounded).
INGRESS_MAX_ONGOING_REQUESTS = 10**9
# Seconds between placement exchanges of the ingress replicas (placed policy).
DEFAULT_PLACEMENT_SYNC_S = 2.0
# Each ingress replica's /v1/responses store: the standalone server's defaults (its response_store.py,
# which the router does not load).
DEFAULT_RESPONSES_MAX_ENTRIES = 10_000
DEFAULT_RESPONSES_MAX_BYTES = 256 * 1024 * 1024


def _cli(help: str, flag: str | None = None, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's metadata for config_util.add_cli_arguments: help text, option name, values."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    if choices is not None:
        meta["choices"] = choices
    return meta


ROUTER_CLASSES: dict[str, str] = {
    "prefixserve": ROUTER_CLASS_PATH,
    "ray_llm_prefix_aware": RAY_LLM_PREFIX_ROUTER_PATH,
}


@dataclass
class RouterArgs:
    """Which request router runs on the engine deployment, and its options.

    ``policy_options`` are the ``router`` section's keys that are not fields
    here: options of the prefixserve policy, checked against what the policy
    declares (router/policies/), so this file never lists which policy takes what.
    """

    router_class: str = "prefixserve"
    policy: str = field(default=DEFAULT_POLICY, metadata=_cli("routing policy", choices=tuple(sorted(POLICIES))))
    kwargs: dict[str, Any] = field(default_factory=dict)
    stats_period_s: float = 1.0
    stats_max_age_s: float | None = None  # None: the router's default (DEFAULT_STATS_MAX_AGE_S)
    # OpenTelemetry collector for the router's ``route`` spans (common/tracing.py); None = none.
    otlp_traces_endpoint: str | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RouterArgs:
        """The ``router`` section: its own keys, the rest the policy's options."""
        if data is not None and not isinstance(data, Mapping):
            raise ValueError(f"router must be a mapping of keys to values, got {type(data).__name__}")
        data = dict(data or {})
        own = {f.name for f in fields(cls)} - {"policy_options"}
        options = {k: data.pop(k) for k in list(data) if k not in own}
        return from_dict(cls, {**data, "policy_options": options}, "router")

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router.policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.router_class not in ROUTER_CLASSES and ":" not in self.router_class:
            raise ValueError(
                f"router.router_class must be one of {sorted(ROUTER_CLASSES)} or an import path "
                f"'module:Class', got {self.router_class!r}"
            )
        if self.stats_period_s <= 0:
            raise ValueError(f"router.stats_period_s must be positive, got {self.stats_period_s}")
        if self.stats_max_age_s is not None and self.stats_max_age_s <= 0:
            raise ValueError(f"router.stats_max_age_s must be positive, got {self.stats_max_age_s}")
        check_endpoint(self.otlp_traces_endpoint, "router.otlp_traces_endpoint")
        if self.router_class != "prefixserve":
            if self.policy != DEFAULT_POLICY or self.policy_options:
                raise ValueError(
                    f"router.policy and policy options ({sorted(self.policy_options)}) configure the prefixserve "
                    f"router; for {self.router_class!r} put its options in router.kwargs"
                )
            return
        if self.kwargs:
            raise ValueError("the prefixserve router takes policy and its options, not router.kwargs")
        try:
            check_options(self.policy, **self.policy_options)
        except ValueError as exc:
            own = sorted({f.name for f in fields(self)} - {"policy_options"})
            raise ValueError(f"router: {exc} (the router's own keys: {own})") from None


@dataclass
class IngressConfig:
    """Knobs of the ingress deployment (the ``ingress`` section of the app args, beside IngressArgs' own)."""

    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    completion_prefix_chars: int = PrefixKeyConfig().completion_prefix_chars
    honor_prefix_header: bool = True
    # Multi-turn affinity (router/routing_key.py): key by X-Session-Id / by the leading turns.
    session_header: bool = field(
        default=False, metadata=_cli("multi-turn affinity: key chat requests by X-Session-Id too")
    )
    key_turns: int = field(
        default=0, metadata=_cli("multi-turn affinity: key chat requests by their first N turns too (0: off)")
    )
    placement_sync_s: float = DEFAULT_PLACEMENT_SYNC_S
    # A stream whose engine replica dies or stops mid-stream goes on on another replica, from the
    # tokens its client has (replica/contract/continuation.py), at most this many times per request.
    migrate_streams: bool = field(
        default=True, metadata=_cli("continue a stream on another replica when its replica dies or stops")
    )
    max_stream_migrations: int = field(
        default=DEFAULT_MAX_STREAM_MIGRATIONS, metadata=_cli("most times one stream moves to another replica")
    )
    # Seconds a client may take to send a whole request body (408); Serve's proxy itself has no such bound.
    client_body_timeout_s: float = DEFAULT_CLIENT_BODY_TIMEOUT_S
    # 431 above these, before the API key is checked (the standalone server's knobs and defaults). Serve's
    # proxy has read the whole head by then: this bounds what reaches the engines, not the proxy's memory.
    h11_max_header_count: int = 100
    h11_max_incomplete_event_size: int = 32 * 1024
    # Unknown top-level request fields: ignored as vLLM ignores them (logged once per name, counted in
    # prefixserve_router_ignored_request_fields_total), or refused with a 400 naming the field.
    strict_request_fields: bool = False
    # Flow control (router/flow_control/): the tenant file's mapping (``prefixserve up --tenants FILE``
    # reads it; a Serve config writes it inline). None: no tenants, no quotas, no queue at the ingress.
    tenants: dict[str, Any] | None = None
    # Requests one ingress replica runs at once before the fair queue holds the rest (0: the engine
    # replicas' batches together, shared among the ingress replicas: AppArgs.flow_max_in_flight).
    flow_max_in_flight: int = 0
    queue_budget_s: float = field(
        default=FlowConfig().queue_budget_s, metadata=_cli("flow control: longest wait for a slot before a 503")
    )
    max_queued: int = FlowConfig().max_queued
    # Slots of each ingress replica only the best band (the lowest priority a tenant defaults to) may take.
    flow_reserved_slots: int = 0
    # The ingress replicas that share the traffic, each holding its part of every tenant's quota
    # (set by the app build from ingress.num_replicas: AppArgs.ingress_config).
    flow_ingress_replicas: int = 1
    # /v1/responses: each ingress replica's store of answered responses (previous_response_id, GET).
    responses_max_entries: int = field(
        default=DEFAULT_RESPONSES_MAX_ENTRIES,
        metadata=_cli("most responses each ingress replica keeps for previous_response_id (least recently used go)"),
    )
    responses_max_bytes: int = field(
        default=DEFAULT_RESPONSES_MAX_BYTES,
        metadata=_cli("most bytes of responses each ingress replica keeps (least recently used go)"),
    )

    def __post_init__(self) -> None:
        if self.tenants is not None:
            self.tenant_table()  # refused at start, with the entry
        if self.flow_ingress_replicas < 1:
            raise ValueError(f"flow_ingress_replicas must be >= 1, got {self.flow_ingress_replicas}")
        if self.flow_max_in_flight < 0:
            raise ValueError(f"flow_max_in_flight must be >= 0, got {self.flow_max_in_flight}")
        if self.flow_reserved_slots < 0:
            raise ValueError(f"flow_reserved_slots must be >= 0, got {self.flow_reserved_slots}")
        self.flow_config(self.flow_reserved_slots + 1)
        if not isinstance(self.placement_sync_s, (int, float)) or not self.placement_sync_s > 0:
            raise ValueError(f"placement_sync_s must be a number > 0, got {self.placement_sync_s!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not isinstance(self.strict_request_fields, bool):
            raise ValueError(f"strict_request_fields must be true or false, got {self.strict_request_fields!r}")
        for name in ("responses_max_entries", "responses_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not isinstance(self.migrate_streams, bool):
            raise ValueError(f"migrate_streams must be true or false, got {self.migrate_streams!r}")
        if isinstance(self.max_stream_migrations, bool) or not isinstance(self.max_stream_migrations, int):
            raise ValueError(f"max_stream_migrations must be an integer, got {self.max_stream_migrations!r}")
        if self.max_stream_migrations < 0:
            raise ValueError(f"max_stream_migrations must be >= 0, got {self.max_stream_migrations}")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> IngressConfig:
        """Strictly from a mapping (unknown keys named)."""
        return from_dict(cls, data, "ingress config")

    def tenant_table(self) -> TenantTable | None:
        """The tenants (TenantFileError, a ValueError, when the mapping is malformed); None without."""
        return tenants_from_data(self.tenants, "ingress.tenants") if self.tenants is not None else None

    def flow_config(self, default_max_in_flight: int) -> FlowConfig:
        """Flow control's knobs, ``default_max_in_flight`` where flow_max_in_flight is 0."""
        return FlowConfig(
            max_in_flight=self.flow_max_in_flight or default_max_in_flight,
            queue_budget_s=self.queue_budget_s,
            max_queued=self.max_queued,
            quota_share=1.0 / self.flow_ingress_replicas,
            reserved_slots=self.flow_reserved_slots,
        )


@dataclass
class IngressArgs:
    """The ingress deployment: Serve options plus IngressConfig's fields."""

    num_replicas: int = field(default=1, metadata=_cli("ingress replicas", flag="--ingress-replicas"))
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    config: IngressConfig = field(default_factory=IngressConfig)
    # Serve's cap of one ingress replica. Serve's own default (5) would make its proxy hold every
    # request past the fifth in a first-come queue before the ingress sees it; the ingress only
    # awaits the engines, so, as Ray Serve LLM's ingress, it takes all (the engines' caps and flow
    # control are what bound the work).
    max_ongoing_requests: int = INGRESS_MAX_ONGOING_REQUESTS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> IngressArgs:
        """The ``ingress`` section: the deployment's keys, the rest IngressConfig's."""
        if data is not None and not isinstance(data, Mapping):
            raise ValueError(f"ingress must be a mapping of keys to values, got {type(data).__name__}")
        data = dict(data or {})
        default = cls()
        num_replicas = data.pop("num_replicas", default.num_replicas)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"ingress.num_replicas must be an integer >= 1, got {num_replicas!r}")
        options = data.pop("ray_actor_options", default.ray_actor_options)
        max_ongoing = data.pop("max_ongoing_requests", default.max_ongoing_requests)
        if isinstance(max_ongoing, bool) or not isinstance(max_ongoing, int) or max_ongoing < 1:
            raise ValueError(f"ingress.max_ongoing_requests must be an integer >= 1, got {max_ongoing!r}")
        return cls(num_replicas, dict(options), IngressConfig.from_dict(data), max_ongoing)


@dataclass(frozen=True)
class ModelDeployment:
    """One base model's engine deployment: its Serve name, its engine section and replica count."""

    name: str
    engine: dict[str, Any]
    num_replicas: int | None

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine.get("tensor_parallel_size", 1))


@dataclass
class AppArgs:
    """Everything ``build_app`` takes (see the module docstring)."""

    engine: dict[str, Any]
    models: list[dict[str, Any]] = field(default_factory=list)
    num_replicas: int | None = field(default=2, metadata=_cli("engine replicas", flag="--replicas"))
    autoscaling: dict[str, Any] | None = None
    max_ongoing_requests: int = field(
        default=64, metadata=_cli("requests per engine replica before Serve tries the key's next replica")
    )
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": DEFAULT_REPLICA_CPUS})
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    drain_timeout_s: float = field(
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metadata=_cli(
            "on Ctrl-C or SIGTERM, seconds requests in flight may still run before they end with an error event"
        ),
    )
    check_resources: bool = True
    router: RouterArgs = field(default_factory=RouterArgs)
    ingress: IngressArgs = field(default_factory=IngressArgs)

    @classmethod
    def from_dict(cls, args: Mapping[str, Any]) -> AppArgs:
        """Parse and validate the whole args mapping (ValueError saying what to change)."""
        data = dict(args)
        if "engine" not in data:
            raise ValueError("the app args need an 'engine' section (EngineConfig fields, at least 'model')")
        router = RouterArgs.from_dict(data.pop("router", None))
        ingress = IngressArgs.from_dict(data.pop("ingress", None))
        if data.get("autoscaling") is not None and "num_replicas" not in args:
            data["num_replicas"] = None  # autoscaling replaces the default count
        parsed = from_dict(cls, data, "app args")
        parsed.router = router
        parsed.ingress = ingress
        parsed.validate()
        return parsed

    @property
    def tensor_parallel_size(self) -> int:
        """The default model's engine's tensor-parallel size (ranks per replica)."""
        return self.deployments()[0].tensor_parallel_size

    def deployments(self) -> list[ModelDeployment]:
        """Every base model's engine deployment, the default model's (``engine``) first."""
        out = [ModelDeployment(ENGINE_DEPLOYMENT, dict(self.engine), self.num_replicas)]
        for i, entry in enumerate(self.models, start=2):
            engine = dict(entry)
            replicas = engine.pop("num_replicas", self.num_replicas)
            out.append(ModelDeployment(f"{ENGINE_DEPLOYMENT}-{i}", engine, replicas))
        return out

    def validate(self) -> None:
        """ValueError for settings Serve or the engine would refuse, before anything is deployed."""
        if not isinstance(self.models, list) or not all(isinstance(m, Mapping) for m in self.models):
            raise ValueError("models must be a list of engine sections (EngineConfig fields, 'model' at least)")
        if not isinstance(self.check_resources, bool):
            raise ValueError(f"check_resources must be true or false, got {self.check_resources!r}")
        if not isinstance(self.ray_actor_options, Mapping):
            raise ValueError(f"ray_actor_options must be a mapping, got {type(self.ray_actor_options).__name__}")
        names: dict[str, str] = {}  # served name (model or adapter) -> the deployment serving it
        for deployment in self.deployments():
            where = "engine" if deployment.name == ENGINE_DEPLOYMENT else f"models[{deployment.name}]"
            if deployment.name != ENGINE_DEPLOYMENT:
                if "model" not in deployment.engine:
                    raise ValueError(f"each entry of models needs a 'model', got {sorted(deployment.engine)}")
                n = deployment.num_replicas
                if self.autoscaling is None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                    raise ValueError(f"{where}: num_replicas must be an integer >= 1, got {n!r}")
            engine = EngineConfig.from_dict(dict(deployment.engine))
            if engine.tensor_parallel_size > 1:
                check_rank_options(engine.tensor_parallel_size, engine.device, self.ray_actor_options)
            served = [engine.model_name, *(m.partition("=")[0] for m in engine.lora_modules)]
            for name in served:
                if name in names:
                    raise ValueError(
                        f"{name!r} is served by two engine deployments ({names[name]} and {deployment.name}): "
                        "give each model its own served_model_name and each adapter its own name"
                    )
                names[name] = deployment.name
        if self.autoscaling is not None and self.num_replicas is not None:
            raise ValueError("set either num_replicas or autoscaling, not both (Serve refuses both)")
        if self.autoscaling is None and (not isinstance(self.num_replicas, int) or self.num_replicas < 1):
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        self.ingress.config.flow_config(self.flow_max_in_flight())  # reserved slots within the slots
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_period_s and health_check_timeout_s must be positive")
        if (
            isinstance(self.drain_timeout_s, bool)
            or not isinstance(self.drain_timeout_s, (int, float))
            or not self.drain_timeout_s >= 0
        ):
            raise ValueError(f"drain_timeout_s must be a number >= 0, got {self.drain_timeout_s!r}")

    def ingress_config(self) -> dict[str, Any]:
        """What each ingress replica is built with: its config, the flow-control shares filled in."""
        return {
            **vars(self.ingress.config),
            "flow_max_in_flight": self.flow_max_in_flight(),
            "flow_ingress_replicas": self.ingress.num_replicas,
        }

    def flow_max_in_flight(self) -> int:
        """Slots per ingress replica: what every engine replica runs at once (its max_num_seqs, within
        Serve's max_ongoing_requests; the most replicas, under autoscaling), shared among the ingress
        replicas (rounded up). Past that, requests wait in the fair queue rather than in an engine's
        waiting queue or in Serve's, which is first come, first served."""
        if self.ingress.config.flow_max_in_flight:
            return self.ingress.config.flow_max_in_flight
        total = 0
        for deployment in self.deployments():
            replicas = deployment.num_replicas if self.autoscaling is None else self.autoscaling.get("max_replicas", 1)
            per_replica = min(EngineConfig.from_dict(dict(deployment.engine)).max_num_seqs, self.max_ongoing_requests)
            total += int(replicas or 1) * per_replica
        return max(1, -(-total // self.ingress.num_replicas))

    def shutdown_options(self) -> dict[str, float]:
        """Serve's graceful-shutdown options of both deployments: a stopping replica waits for its
        requests up to the drain timeout plus SHUTDOWN_MARGIN_S before Serve kills it."""
        return {
            "graceful_shutdown_timeout_s": float(self.drain_timeout_s) + SHUTDOWN_MARGIN_S,
            "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        }


def rank_bundle(ray_actor_options: Mapping[str, Any]) -> dict[str, float]:
    """One tensor-parallel rank's placement-group bundle: the resources ``ray_actor_options`` ask for.

    The same conversion Ray applies to an actor's options, so the replica actor
    (rank 0, same options) fits its bundle 0 exactly; zero amounts are left out.
    """
    num_cpus = ray_actor_options.get("num_cpus")
    bundle: dict[str, float] = {
        "CPU": SERVE_DEFAULT_NUM_CPUS if num_cpus is None else num_cpus,
        "GPU": ray_actor_options.get("num_gpus") or 0,
        **dict(ray_actor_options.get("resources") or {}),
    }
    if ray_actor_options.get("memory"):
        bundle["memory"] = ray_actor_options["memory"]
    if ray_actor_options.get("accelerator_type"):
        bundle[ACCELERATOR_TYPE_RESOURCE.format(ray_actor_options["accelerator_type"])] = ACCELERATOR_TYPE_AMOUNT
    return {name: amount for name, amount in bundle.items() if amount}


def check_rank_options(tp_size: int, device: str, ray_actor_options: Mapping[str, Any]) -> None:
    """Refuse ray_actor_options that cannot be one rank's (ValueError saying what to write)."""
    for name in ("num_cpus", "num_gpus"):
        value = ray_actor_options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"ray_actor_options.{name} must be a number >= 0, got {value!r}")
    num_gpus = ray_actor_options.get("num_gpus") or 0
    num_cpus = ray_actor_options.get("num_cpus")
    cpus = SERVE_DEFAULT_NUM_CPUS if num_cpus is None else num_cpus
    if num_gpus > 1:
        # A rank drives one device; more than one GPU per rank is a per-replica total.
        per_rank = {"num_cpus": number_text(cpus / tp_size), "num_gpus": number_text(num_gpus / tp_size)}
        raise ValueError(
            f"ray_actor_options describe ONE tensor-parallel rank (the replica reserves tensor_parallel_size="
            f"{tp_size} bundles of them, STRICT_PACK on one node), and a rank uses one GPU: num_gpus: "
            f"{number_text(num_gpus)} looks like the replica's total. Write ray_actor_options: "
            f"{{num_cpus: {per_rank['num_cpus']}, num_gpus: {per_rank['num_gpus']}}} for "
            f"{number_text(cpus)} CPUs and {number_text(num_gpus)} GPUs per replica"
        )
    if device.startswith("cuda") and not num_gpus:
        raise ValueError(
            f"device {device!r} with tensor_parallel_size={tp_size} needs ray_actor_options.num_gpus "
            f"(per rank, e.g. 1): without it Ray reserves no GPU for the ranks"
        )
    if not rank_bundle(ray_actor_options):
        raise ValueError(
            f"with tensor_parallel_size={tp_size}, ray_actor_options (one rank's resources) must ask for some "
            f"CPU or GPU: Ray refuses empty placement-group bundles"
        )


def number_text(value: float) -> float | int:
    """A resource amount as written in messages: an int when whole, else 4 decimals."""
    return int(value) if float(value).is_integer() else round(float(value), 4)
