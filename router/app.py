"""Builds the prefixserve Serve application: the OpenAI ingress over the engine deployment.

Job: turn one args dict (``serve run prefixserve.router.app:build_app``, the ``args`` of an
application in a ``serve deploy`` config such as cluster.yaml, or
``prefixserve up``) into a ``serve.Application``: the engine deployment
(replica/entrypoints/serve/deployment.py) with its request router (router/serve_router.py, or
Ray Serve LLM's PrefixCacheAffinityRouter for comparison), and the ingress
(router/ingress.py) bound to its handle.

The args (every key optional except ``engine``)::

    engine: {...}                  # EngineConfig fields (replica/config.py)
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
                                   #   declares (router/policies.py): epsilon, tau_s, precise, seed, ...
      kwargs: {}                   # other router classes: their initialize_state kwargs
      stats_period_s: 1.0          # how often replicas report record_routing_stats (load, KV events)
      stats_max_age_s: 10.0        # reports older than this are not used
    ingress:
      num_replicas: 1
      ray_actor_options: {num_cpus: 0}
      api_keys: []                 # Bearer keys; empty = open
      max_body_bytes: 4194304
      max_attempts: 4              # sends per request while replicas die under it
      placement_sync_s: 2.0        # placed: how often ingress replicas agree on placements
      session_header: false        # multi-turn affinity: key by X-Session-Id (router/prefix.py)
      key_turns: 0                 # multi-turn affinity: key by the first N turns too

Tensor parallelism (``engine.tensor_parallel_size`` N > 1). One engine replica
is N ranks: the replica actor is rank 0 and starts ranks 1..N-1 as local
processes (replica/executor/tensor_parallel.py), so all N must be on one node. The
replica asks Serve for one placement-group bundle per rank
(``placement_group_bundles``, ``placement_group_strategy: STRICT_PACK``, Serve
2.60's deployment options), and:

* ``ray_actor_options`` describe ONE rank. Each bundle is ``{"CPU": num_cpus,
  "GPU": num_gpus}`` (GPU left out when 0; ``memory``, ``resources`` and
  ``accelerator_type`` carried over as Ray turns them into resources), and the
  replica actor itself is scheduled into bundle 0, where its own
  ``ray_actor_options`` must fit (Serve checks that). TP 4 on 4 GPUs is
  ``num_gpus: 1``, and the replica reserves 4 x ``num_cpus`` CPUs in all.
  ``num_gpus`` > 1 with N > 1 is refused as a per-replica total, with the
  per-rank options to write instead.
* The ranks learn what their bundle holds from replica/executor/ray_bundles.py.
* ``check_resources``: the Serve controller builds the app inside the Ray
  cluster, so build_app can see every alive node; when none has the N bundles'
  resources together it refuses with an error naming them and the most any node
  has, instead of leaving replicas pending forever. Autoscaling clusters whose
  GPU nodes do not exist yet set ``check_resources: false``.
* Change a TP replica's resources through these args, not a ``deployments:``
  override of ``ray_actor_options`` (the bundles come from the args).

With N = 1 there is no placement group: ``ray_actor_options`` are the replica
actor's, as before.

Invariants: the args are validated here, before anything is deployed, with
messages that say what to change; the engine config is checked with
EngineConfig's own validation. Every error build_app raises is an
:class:`AppArgsError`, a ValueError that Serve reports as its one-line message
(``serve status``: "Deploying app '...' failed with exception: <message>"); any
other exception type leaves a traceback there and is retried by Serve.

Imports Ray Serve and the deployments; the model loads only in engine replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException

from prefixserve.common.config_util import from_dict
from prefixserve.common.tracing import check_endpoint
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.entrypoints.serve.deployment import EngineDeployment
from prefixserve.router.ingress import IngressConfig, OpenAIIngress
from prefixserve.router.policies import DEFAULT_POLICY, POLICIES, check_options
from prefixserve.router.serve_router import RAY_LLM_PREFIX_ROUTER_PATH, ROUTER_CLASS_PATH

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


class AppArgsError(RayServeException, ValueError):
    """Bad app args or a cluster that cannot hold the app: the message says what to change.

    A RayServeException, so Serve's build task reports the message alone as the
    app's status (ray/serve/_private/application_state.py build_serve_application)
    rather than a traceback after three retries; a ValueError for every other caller.
    """


ROUTER_CLASSES = {
    "prefixserve": ROUTER_CLASS_PATH,
    "ray_llm_prefix_aware": RAY_LLM_PREFIX_ROUTER_PATH,
}


@dataclass
class RouterArgs:
    """Which request router runs on the engine deployment, and its options.

    ``policy_options`` are the ``router`` section's keys that are not fields
    here: options of the prefixserve policy, checked against what the policy
    declares (router/policies.py), so this file never lists which policy takes what.
    """

    router_class: str = "prefixserve"
    policy: str = DEFAULT_POLICY
    kwargs: dict[str, Any] = field(default_factory=dict)
    stats_period_s: float = 1.0
    stats_max_age_s: float | None = None  # None: the router's default (DEFAULT_STATS_MAX_AGE_S)
    # OpenTelemetry collector for the router's ``route`` spans (common/tracing.py); None = none.
    otlp_traces_endpoint: str | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RouterArgs:
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

    def request_router_config(self) -> RequestRouterConfig:
        if self.router_class == "prefixserve":
            kwargs: dict[str, Any] = {"policy": self.policy, **self.policy_options}
            if self.stats_max_age_s is not None:
                kwargs["stats_max_age_s"] = self.stats_max_age_s
            if self.otlp_traces_endpoint is not None:
                kwargs["otlp_traces_endpoint"] = self.otlp_traces_endpoint
        else:
            kwargs = dict(self.kwargs)
        return RequestRouterConfig(
            request_router_class=ROUTER_CLASSES.get(self.router_class, self.router_class),
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=self.stats_period_s,
        )


@dataclass
class IngressArgs:
    """The ingress deployment: Serve options plus IngressConfig's fields."""

    num_replicas: int = 1
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    config: IngressConfig = field(default_factory=IngressConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> IngressArgs:
        data = dict(data or {})
        num_replicas = data.pop("num_replicas", 1)
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"ingress.num_replicas must be an integer >= 1, got {num_replicas!r}")
        options = data.pop("ray_actor_options", {"num_cpus": 0})
        return cls(num_replicas, dict(options), IngressConfig.from_dict(data))


@dataclass
class AppArgs:
    """Everything ``build_app`` takes (see the module docstring)."""

    engine: dict[str, Any]
    num_replicas: int | None = 2
    autoscaling: dict[str, Any] | None = None
    max_ongoing_requests: int = 64
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    check_resources: bool = True
    router: RouterArgs = field(default_factory=RouterArgs)
    ingress: IngressArgs = field(default_factory=IngressArgs)

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> AppArgs:
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
        return int(self.engine.get("tensor_parallel_size", 1))

    def validate(self) -> None:
        engine = EngineConfig.from_dict(dict(self.engine))
        if not isinstance(self.check_resources, bool):
            raise ValueError(f"check_resources must be true or false, got {self.check_resources!r}")
        if not isinstance(self.ray_actor_options, Mapping):
            raise ValueError(f"ray_actor_options must be a mapping, got {type(self.ray_actor_options).__name__}")
        if engine.tensor_parallel_size > 1:
            check_rank_options(engine.tensor_parallel_size, engine.device, self.ray_actor_options)
        if self.autoscaling is not None and self.num_replicas is not None:
            raise ValueError("set either num_replicas or autoscaling, not both (Serve refuses both)")
        if self.autoscaling is None and (not isinstance(self.num_replicas, int) or self.num_replicas < 1):
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_period_s and health_check_timeout_s must be positive")
        if (
            isinstance(self.drain_timeout_s, bool)
            or not isinstance(self.drain_timeout_s, (int, float))
            or not self.drain_timeout_s >= 0
        ):
            raise ValueError(f"drain_timeout_s must be a number >= 0, got {self.drain_timeout_s!r}")

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
        per_rank = {"num_cpus": _number(cpus / tp_size), "num_gpus": _number(num_gpus / tp_size)}
        raise ValueError(
            f"ray_actor_options describe ONE tensor-parallel rank (the replica reserves tensor_parallel_size="
            f"{tp_size} bundles of them, STRICT_PACK on one node), and a rank uses one GPU: num_gpus: "
            f"{_number(num_gpus)} looks like the replica's total. Write ray_actor_options: "
            f"{{num_cpus: {per_rank['num_cpus']}, num_gpus: {per_rank['num_gpus']}}} for "
            f"{_number(cpus)} CPUs and {_number(num_gpus)} GPUs per replica"
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


def engine_bundles(args: AppArgs) -> list[dict[str, float]] | None:
    """The engine replica's placement-group bundles (one per rank), or None when TP is 1."""
    tp_size = args.tensor_parallel_size
    if tp_size <= 1:
        return None
    return [rank_bundle(args.ray_actor_options) for _ in range(tp_size)]


def missing_node_resources(bundles: list[dict[str, float]], nodes: list[Mapping[str, float]]) -> str | None:
    """Why no node of ``nodes`` (each one's total resources) can hold all ``bundles`` (None if one can).

    Pure. STRICT_PACK puts every bundle of a replica on one node, so one node
    must have the sum of the bundles, resource by resource.
    """
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0) + amount
    # A tolerance: Ray keeps resources at 1e-4 granularity, sums of floats are not exact.
    if any(all(node.get(name, 0) + 1e-6 >= amount for name, amount in need.items()) for node in nodes):
        return None
    most = {name: max((node.get(name, 0) for node in nodes), default=0) for name in need}
    tp_size = len(bundles)
    return (
        f"tensor_parallel_size={tp_size} needs {tp_size} bundles {_bundle_text(bundles[0])} on one node "
        f"({TP_PLACEMENT_STRATEGY}), {_amounts(need)} together: no node has them; the most any of the "
        f"{len(nodes)} alive nodes has is {_amounts(most)}. Add such a node, lower tensor_parallel_size or "
        f"ray_actor_options (one rank's resources), or set check_resources: false if the autoscaler adds "
        f"such nodes on demand"
    )


def check_cluster_resources(args: AppArgs) -> None:
    """Refuse (AppArgsError) when no alive node of the connected Ray cluster can hold one replica's bundles.

    Skipped when Ray is not initialized here (building the app offline), with
    ``check_resources: false``, or when TP is 1.
    """
    bundles = engine_bundles(args)
    if bundles is None or not args.check_resources or not ray.is_initialized():
        return
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    message = missing_node_resources(bundles, nodes)
    if message is not None:
        raise AppArgsError(message)


def build_engine(args: AppArgs) -> serve.Application:
    """The engine deployment, bound to its EngineConfig dict.

    With tensor_parallel_size N > 1: N placement-group bundles of the per-rank
    ``ray_actor_options``, STRICT_PACK (see the module docstring).
    """
    options: dict[str, Any] = {
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": dict(args.ray_actor_options),
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
        "request_router_config": args.router.request_router_config(),
        **args.shutdown_options(),
    }
    bundles = engine_bundles(args)
    if bundles is not None:
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = TP_PLACEMENT_STRATEGY
    if args.autoscaling is not None:
        options["autoscaling_config"] = dict(args.autoscaling)
    else:
        options["num_replicas"] = args.num_replicas
    return EngineDeployment.options(**options).bind(dict(args.engine))


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for ``serve run prefixserve.router.app:build_app`` / ``serve deploy``.

    Raises AppArgsError (a ValueError) for bad args, options Serve refuses, and,
    when Ray is initialized, a cluster with no node for one engine replica's bundles.
    """
    try:
        parsed = AppArgs.from_dict(args)
        check_cluster_resources(parsed)
        engine = build_engine(parsed)
        ingress = parsed.ingress
        return OpenAIIngress.options(
            num_replicas=ingress.num_replicas,
            ray_actor_options=dict(ingress.ray_actor_options),
            **parsed.shutdown_options(),
        ).bind(engine, vars(ingress.config))
    except AppArgsError:
        raise
    except ValueError as exc:
        raise AppArgsError(str(exc)) from exc


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 4)


def _bundle_text(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"'{name}': {_number(amount)}" for name, amount in bundle.items()) + "}"


def _amounts(amounts: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {_number(amount)}" for name, amount in amounts.items())
