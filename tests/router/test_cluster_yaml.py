"""cluster.yaml is a valid Serve config whose app args build the intended application.

Mostly offline: Ray's own schema (ServeDeploySchema) and the app builder, no
cluster; the engine section (tensor_parallel_size 4) passes EngineConfig as
shipped, and the engine deployment asks for 4 per-rank bundles, STRICT_PACK.
One test starts a local Ray without GPUs to see the build refused with the
missing resources named (what ``serve deploy cluster.yaml`` reports on such a
cluster; tests/router/serve/test_cluster_tp.py checks it through Serve itself).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from prefixserve.replica.config import EngineConfig
from prefixserve.router.cluster_config import ROUTER_CLASS_PATH, AppArgs
from prefixserve.router.serve.app import AppArgsError, build_app, missing_node_resources

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def app_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]


SHIPPED_BUNDLE = {"CPU": 2, "GPU": 1}


def engine_of(application):
    """The engine Deployment bound into the ingress's Application (as build_app composes them)."""
    return application._bound_deployment.init_args[0]._bound_deployment


def test_validates_against_rays_serve_schema(config):
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "prefixserve.router.serve.app:build_app"
    assert app.route_prefix == "/"


def test_engine_section_passes_engine_config_with_tensor_parallelism(app_args):
    config = EngineConfig.from_dict(app_args["engine"])
    assert config.tensor_parallel_size == 4 and config.device == "cuda"


def test_one_four_gpu_replica_per_node_with_autoscaling_bounds(app_args):
    parsed = AppArgs.from_dict(app_args)
    # Per rank: one GPU; four ranks per replica.
    assert parsed.ray_actor_options == {"num_cpus": 2, "num_gpus": 1}
    assert parsed.tensor_parallel_size == 4 and parsed.check_resources is True
    assert parsed.num_replicas is None
    autoscaling = AutoscalingConfig(**parsed.autoscaling)
    assert 1 <= autoscaling.min_replicas <= autoscaling.max_replicas
    assert parsed.health_check_period_s > 0 and parsed.health_check_timeout_s > 0


def test_app_builds_with_the_prefix_router_and_bounded_load(app_args):
    application = build_app(app_args)
    ingress = application._bound_deployment
    assert ingress.name == "Ingress"
    assert ingress.num_replicas == app_args["ingress"]["num_replicas"]
    (engine_app,) = ingress.init_args[:1]
    engine = engine_app._bound_deployment
    assert engine.name == "Engine"
    dc = engine._deployment_config
    assert dc.autoscaling_config.max_replicas == app_args["autoscaling"]["max_replicas"]
    assert dc.health_check_timeout_s == app_args["health_check_timeout_s"]
    router = dc.request_router_config
    assert router.request_router_class == ROUTER_CLASS_PATH
    assert router.request_router_kwargs == {"policy": "bounded_load", "epsilon": 0.25}
    assert engine.init_args[0]["tensor_parallel_size"] == 4


def test_engine_replica_reserves_one_gpu_bundle_per_rank_on_one_node(app_args):
    engine = engine_of(build_app(app_args))
    replica = engine._replica_config
    assert replica.placement_group_bundles == [SHIPPED_BUNDLE] * 4
    assert replica.placement_group_strategy == "STRICT_PACK"
    # The replica actor is rank 0 and sits in bundle 0, with exactly that bundle's resources.
    assert engine.ray_actor_options["num_cpus"] == 2 and engine.ray_actor_options["num_gpus"] == 1


def test_tensor_parallel_size_one_has_no_placement_group(app_args):
    args = copy.deepcopy(app_args)
    args["engine"]["tensor_parallel_size"] = 1
    replica = engine_of(build_app(args))._replica_config
    assert replica.placement_group_bundles is None and replica.placement_group_strategy is None


def test_per_replica_gpu_total_is_refused_with_the_per_rank_options(app_args):
    args = copy.deepcopy(app_args)
    args["ray_actor_options"] = {"num_cpus": 8, "num_gpus": 4}
    with pytest.raises(
        AppArgsError,
        match=r"ray_actor_options describe ONE tensor-parallel rank .* "
        r"Write ray_actor_options: \{num_cpus: 2, num_gpus: 1\}",
    ):
        build_app(args)


def test_cuda_ranks_without_gpus_are_refused(app_args):
    args = copy.deepcopy(app_args)
    args["ray_actor_options"] = {"num_cpus": 2}
    with pytest.raises(AppArgsError, match=r"needs ray_actor_options.num_gpus \(per rank"):
        build_app(args)


def test_bundles_carry_every_resource_ray_asks_of_the_rank(app_args):
    args = copy.deepcopy(app_args)
    args["ray_actor_options"] = {
        "num_cpus": 2,
        "num_gpus": 1,
        "memory": 2**30,
        "resources": {"nvlink": 1},
        "accelerator_type": "H100",
    }
    replica = engine_of(build_app(args))._replica_config
    assert (
        replica.placement_group_bundles
        == [{"CPU": 2, "GPU": 1, "nvlink": 1, "memory": 2**30, "accelerator_type:H100": 0.001}] * 4
    )


def test_node_fit_needs_all_bundles_on_one_node():
    bundles = [SHIPPED_BUNDLE] * 4
    assert missing_node_resources(bundles, [{"CPU": 8, "GPU": 4}]) is None
    # Eight GPUs in the cluster, but STRICT_PACK needs four on one node.
    message = missing_node_resources(bundles, [{"CPU": 16, "GPU": 2}, {"CPU": 4, "GPU": 2}, {"CPU": 64}])
    assert message == (
        "tensor_parallel_size=4 needs 4 bundles {'CPU': 2, 'GPU': 1} on one node (STRICT_PACK), CPU 8, GPU 4 "
        "together: no node has them; the most any of the 3 alive nodes has is CPU 64, GPU 2. Add such a node, "
        "lower tensor_parallel_size or ray_actor_options (one rank's resources), or set check_resources: false "
        "if the autoscaler adds such nodes on demand"
    )


@pytest.fixture()
def ray_without_gpus():
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_shipped_file_is_refused_on_a_cluster_without_gpus_naming_them(app_args, ray_without_gpus):
    with pytest.raises(AppArgsError) as info:
        build_app(app_args)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "tensor_parallel_size=4 needs 4 bundles {'CPU': 2, 'GPU': 1} on one node (STRICT_PACK), "
        "CPU 8, GPU 4 together: no node has them; the most any of the 1 alive nodes has is "
        "CPU 2, GPU 0."
    )
    # The autoscaling opt-out builds the same app without looking at the nodes.
    args = copy.deepcopy(app_args)
    args["check_resources"] = False
    assert engine_of(build_app(args))._replica_config.placement_group_bundles == [SHIPPED_BUNDLE] * 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router": {"policy": "nearest"}}, "router.policy must be one of"),
        ({"num_replicas": 3}, "either num_replicas or autoscaling"),
        ({"ingress": {"num_replicas": 0}}, "ingress.num_replicas"),
        ({"ingress": {"api_key": ["k"]}}, "unknown ingress config keys"),
        ({"router": {"router_class": "ray_llm_prefix_aware", "epsilon": 0.5}}, "put its options in router.kwargs"),
        ({"router": {"epsilonn": 0.5}}, r"\['epsilonn'\]; known keys: \['epsilon', 'weights'\]"),
        ({"router": {"policy": "round_robin"}}, r"unknown round_robin policy option keys \['epsilon'\]"),
        ({"router": {"policy": "consistent_hash", "epsilon": None}}, "consistent_hash policy option"),
        ({"router": {"weights": {"a": 1000}}}, "from 1 to 100"),
        ({"router": ["bounded_load"]}, "router must be a mapping"),
        ({"engine": {"block_size": 12}}, "block_size must be a power of two"),
        ({"check_resources": "no"}, "check_resources must be true or false"),
        (
            {"ray_actor_options": {"num_cpus": 0, "num_gpus": 0}, "engine": {"device": "cpu"}},
            "must ask for some CPU or GPU",
        ),
        ({"ray_actor_options": {"num_gpus": "1"}}, r"ray_actor_options.num_gpus must be a number"),
    ],
)
def test_bad_args_are_refused_with_the_fix(app_args, change, message):
    args = copy.deepcopy(app_args)
    for section, value in change.items():
        if isinstance(value, dict) and isinstance(args.get(section), dict):
            args[section] = {**args[section], **value}
        else:
            args[section] = value
    # AppArgsError: a ValueError that Serve reports as its message alone.
    with pytest.raises(AppArgsError, match=message):
        build_app(args)


def test_ray_llm_prefix_router_can_replace_ours(app_args):
    args = copy.deepcopy(app_args)
    args["router"] = {"router_class": "ray_llm_prefix_aware", "kwargs": {"imbalanced_threshold": 8}}
    engine = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("prefix_aware_router:PrefixCacheAffinityRouter")
    assert router.request_router_kwargs == {"imbalanced_threshold": 8}


def test_policy_options_pass_through_to_the_router(app_args):
    args = copy.deepcopy(app_args)
    args["router"] = {"policy": "consistent_hash", "weights": {"a": 2}, "stats_period_s": 3.0}
    engine = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    router = engine._deployment_config.request_router_config
    assert router.request_router_kwargs == {"policy": "consistent_hash", "weights": {"a": 2}}
    assert router.request_routing_stats_period_s == 3.0


def test_both_deployments_wait_the_drain_timeout_before_serve_kills_them(app_args):
    from prefixserve.router.cluster_config import GRACEFUL_SHUTDOWN_WAIT_LOOP_S, SHUTDOWN_MARGIN_S

    application = build_app({**app_args, "drain_timeout_s": 12})
    for deployment in (application._bound_deployment, engine_of(application)):
        dc = deployment._deployment_config
        assert dc.graceful_shutdown_timeout_s == 12 + SHUTDOWN_MARGIN_S
        assert dc.graceful_shutdown_wait_loop_s == GRACEFUL_SHUTDOWN_WAIT_LOOP_S
    for bad in (-1, "soon", True):
        with pytest.raises(AppArgsError, match="drain_timeout_s"):
            build_app({**app_args, "drain_timeout_s": bad})
