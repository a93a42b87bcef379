"""Builds the prefixserve Serve application: the OpenAI ingress over the engine deployment.

Job: turn one args dict (``serve run prefixserve.router.serve.app:build_app``, the ``args`` of an
application in a ``serve deploy`` config such as cluster.yaml, or
``prefixserve up``) into a ``serve.Application``: the engine deployment
(replica/entrypoints/serve/deployment.py) with its request router (router/serve/request_router.py, or
Ray Serve LLM's PrefixCacheAffinityRouter for comparison), and the ingress
(router/serve/ingress.py) bound to its handle. With ``models`` (several base models behind one
endpoint) one engine deployment per model, ``Engine``, ``Engine-2``, ..., each with its own request
router and ring; the ingress sends each request to the deployment of the model it names.

The args are router/cluster_config.py's ``AppArgs`` (its docstring lists every key).

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
actor's own.

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
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException

from prefixserve.replica.entrypoints.serve.deployment import EngineDeployment
from prefixserve.router.cluster_config import (
    ROUTER_CLASSES,
    TP_PLACEMENT_STRATEGY,
    AppArgs,
    ModelDeployment,
    RouterArgs,
    number_text,
    rank_bundle,
)
from prefixserve.router.serve.ingress import OpenAIIngress


class AppArgsError(RayServeException, ValueError):
    """Bad app args or a cluster that cannot hold the app: the message says what to change.

    A RayServeException, so Serve's build task reports the message alone as the
    app's status (ray/serve/_private/application_state.py build_serve_application)
    rather than a traceback after three retries; a ValueError for every other caller.
    """


def has_kv_tier(engine: Mapping[str, Any]) -> bool:
    """Whether the engine config (EngineConfig fields) turns on a KV tier behind the device pool:
    the host tier (``kv_offloading_size``) or the shared disk tier (``kv_disk_path``)."""
    return bool(engine.get("kv_offloading_size")) or bool(engine.get("kv_disk_path"))


def request_router_config(router: RouterArgs, engine: Mapping[str, Any] | None = None) -> RequestRouterConfig:
    """Serve's RequestRouterConfig of the engine deployment for the ``router`` section.

    With a KV tier on in ``engine``, ``placed`` runs precise unless ``precise`` is given: only
    precise mode reads the KV events' tiers (a prefix in a replica's host tier or shared disk
    directory is a cheap load there, ``kv_host_weight`` / ``kv_disk_weight``), and without
    them a tier's blocks would be invisible to routing.
    """
    if router.router_class == "prefixserve":
        kwargs: dict[str, Any] = {"policy": router.policy, **router.policy_options}
        if router.policy == "placed" and "precise" not in kwargs and engine is not None and has_kv_tier(engine):
            kwargs["precise"] = True
        if router.stats_max_age_s is not None:
            kwargs["stats_max_age_s"] = router.stats_max_age_s
        if router.otlp_traces_endpoint is not None:
            kwargs["otlp_traces_endpoint"] = router.otlp_traces_endpoint
    else:
        kwargs = dict(router.kwargs)
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASSES.get(router.router_class, router.router_class),
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=router.stats_period_s,
    )


def engine_bundles(args: AppArgs, deployment: ModelDeployment | None = None) -> list[dict[str, float]] | None:
    """An engine replica's placement-group bundles (one per rank), or None when TP is 1 (``deployment``:
    that model's engine; None: the default model's)."""
    tp_size = (deployment or args.deployments()[0]).tensor_parallel_size
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
    if not args.check_resources or not ray.is_initialized():
        return
    for deployment in args.deployments():
        bundles = engine_bundles(args, deployment)
        if bundles is None:
            continue
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        message = missing_node_resources(bundles, nodes)
        if message is not None:
            raise AppArgsError(message)


def build_engine(args: AppArgs, deployment: ModelDeployment | None = None) -> serve.Application:
    """An engine deployment, bound to its EngineConfig dict (``deployment``: that model's; None: the
    default model's).

    With tensor_parallel_size N > 1: N placement-group bundles of the per-rank
    ``ray_actor_options``, STRICT_PACK (see the module docstring).
    """
    deployment = deployment or args.deployments()[0]
    options: dict[str, Any] = {
        "name": deployment.name,
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": dict(args.ray_actor_options),
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
        "request_router_config": request_router_config(args.router, deployment.engine),
        **args.shutdown_options(),
    }
    bundles = engine_bundles(args, deployment)
    if bundles is not None:
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = TP_PLACEMENT_STRATEGY
    if args.autoscaling is not None:
        options["autoscaling_config"] = dict(args.autoscaling)
    else:
        options["num_replicas"] = deployment.num_replicas
    return EngineDeployment.options(**options).bind(dict(deployment.engine))


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for ``serve run prefixserve.router.serve.app:build_app`` / ``serve deploy``.

    Raises AppArgsError (a ValueError) for bad args, options Serve refuses, and,
    when Ray is initialized, a cluster with no node for one engine replica's bundles.
    """
    try:
        parsed = AppArgs.from_dict(args)
        check_cluster_resources(parsed)
        engine, *more = [build_engine(parsed, d) for d in parsed.deployments()]
        ingress = parsed.ingress
        return OpenAIIngress.options(
            num_replicas=ingress.num_replicas,
            max_ongoing_requests=ingress.max_ongoing_requests,
            ray_actor_options=dict(ingress.ray_actor_options),
            **parsed.shutdown_options(),
        ).bind(engine, parsed.ingress_config(), more)
    except AppArgsError:
        raise
    except ValueError as exc:
        raise AppArgsError(str(exc)) from exc


def _bundle_text(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"'{name}': {number_text(amount)}" for name, amount in bundle.items()) + "}"


def _amounts(amounts: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {number_text(amount)}" for name, amount in amounts.items())
