"""Builds the prefixserve Serve application: the OpenAI ingress over the engine deployment.

Job: turn one args dict (``serve run prefixserve.router.app:build_app``, the ``args`` of an
application in a ``serve deploy`` config such as cluster.yaml, or
``prefixserve up``) into a ``serve.Application``: the engine deployment
(replica/deployment.py) with its request router (router/serve_router.py, or
Ray Serve LLM's PrefixCacheAffinityRouter for comparison), and the ingress
(router/ingress.py) bound to its handle.

The args (every key optional except ``engine``)::

    engine: {...}                  # EngineConfig fields (replica/config.py)
    num_replicas: 2                # or autoscaling: {min_replicas, max_replicas, ...}
    autoscaling: null              # Serve's autoscaling_config, passed through
    max_ongoing_requests: 64       # per engine replica; beyond it Serve tries the next ring replica
    ray_actor_options: {num_cpus: 1, num_gpus: 0}
    health_check_period_s: 10
    health_check_timeout_s: 30
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

Invariants: the args are validated here, before anything is deployed, with
messages that say what to change; the engine config is checked with
EngineConfig's own validation.

Imports Ray Serve and the deployments; the model loads only in engine replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.config_util import from_dict
from prefixserve.replica.deployment import EngineDeployment
from prefixserve.replica.tracing import check_endpoint
from prefixserve.router.ingress import IngressConfig, OpenAIIngress
from prefixserve.router.policies import DEFAULT_POLICY, POLICIES, check_options
from prefixserve.router.serve_router import RAY_LLM_PREFIX_ROUTER_PATH, ROUTER_CLASS_PATH

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
    # OpenTelemetry collector for the router's ``route`` spans (replica/tracing.py); None = none.
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

    def validate(self) -> None:
        EngineConfig.from_dict(dict(self.engine))
        if self.autoscaling is not None and self.num_replicas is not None:
            raise ValueError("set either num_replicas or autoscaling, not both (Serve refuses both)")
        if self.autoscaling is None and (not isinstance(self.num_replicas, int) or self.num_replicas < 1):
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_period_s and health_check_timeout_s must be positive")


def build_engine(args: AppArgs) -> serve.Application:
    """The engine deployment, bound to its EngineConfig dict."""
    options: dict[str, Any] = {
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": dict(args.ray_actor_options),
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
        "request_router_config": args.router.request_router_config(),
    }
    if args.autoscaling is not None:
        options["autoscaling_config"] = dict(args.autoscaling)
    else:
        options["num_replicas"] = args.num_replicas
    return EngineDeployment.options(**options).bind(dict(args.engine))


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for ``serve run prefixserve.router.app:build_app`` / ``serve deploy``."""
    parsed = AppArgs.from_dict(args)
    engine = build_engine(parsed)
    ingress = parsed.ingress
    return OpenAIIngress.options(
        num_replicas=ingress.num_replicas, ray_actor_options=dict(ingress.ray_actor_options)
    ).bind(engine, vars(ingress.config))
