"""cluster.yaml is a valid Serve config whose app args build the intended application.

Offline: Ray's own schema (ServeDeploySchema) and the app builder, no cluster.
EngineConfig refuses tensor_parallel_size > 1 until the tensor-parallel issue
lands, so the engine section is checked with that one knob set to 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from prefixserve.replica.config import EngineConfig
from prefixserve.router.app import AppArgs, build_app
from prefixserve.router.serve_router import ROUTER_CLASS_PATH

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def app_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]


def without_tp(args: dict) -> dict:
    args = copy.deepcopy(args)
    args["engine"]["tensor_parallel_size"] = 1
    return args


def test_validates_against_rays_serve_schema(config):
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "prefixserve.router.app:build_app"
    assert app.route_prefix == "/"


def test_engine_section_passes_engine_config_except_tensor_parallelism(app_args):
    assert app_args["engine"]["tensor_parallel_size"] == 4
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_dict(app_args["engine"])
    EngineConfig.from_dict(without_tp(app_args)["engine"])


def test_one_four_gpu_replica_per_node_with_autoscaling_bounds(app_args):
    parsed = AppArgs.from_dict(without_tp(app_args))
    assert parsed.ray_actor_options["num_gpus"] == 4
    assert parsed.num_replicas is None
    autoscaling = AutoscalingConfig(**parsed.autoscaling)
    assert 1 <= autoscaling.min_replicas <= autoscaling.max_replicas
    assert parsed.health_check_period_s > 0 and parsed.health_check_timeout_s > 0


def test_app_builds_with_the_prefix_router_and_bounded_load(app_args):
    application = build_app(without_tp(app_args))
    ingress = application._bound_deployment
    assert ingress.name == "Ingress"
    assert ingress.num_replicas == app_args["ingress"]["num_replicas"]
    (engine_app,) = ingress.init_args[:1]
    engine = engine_app._bound_deployment
    assert engine.name == "Engine"
    assert engine.ray_actor_options["num_gpus"] == 4
    dc = engine._deployment_config
    assert dc.autoscaling_config.max_replicas == app_args["autoscaling"]["max_replicas"]
    assert dc.health_check_timeout_s == app_args["health_check_timeout_s"]
    router = dc.request_router_config
    assert router.request_router_class == ROUTER_CLASS_PATH
    assert router.request_router_kwargs == {"policy": "bounded_load", "epsilon": 0.25}
    assert engine.init_args[0]["tensor_parallel_size"] == 1


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
    ],
)
def test_bad_args_are_refused_with_the_fix(app_args, change, message):
    args = without_tp(app_args)
    for section, value in change.items():
        if isinstance(value, dict) and isinstance(args.get(section), dict):
            args[section] = {**args[section], **value}
        else:
            args[section] = value
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_ray_llm_prefix_router_can_replace_ours(app_args):
    args = without_tp(app_args)
    args["router"] = {"router_class": "ray_llm_prefix_aware", "kwargs": {"imbalanced_threshold": 8}}
    engine = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("prefix_aware_router:PrefixCacheAffinityRouter")
    assert router.request_router_kwargs == {"imbalanced_threshold": 8}


def test_policy_options_pass_through_to_the_router(app_args):
    args = without_tp(app_args)
    args["router"] = {"policy": "consistent_hash", "weights": {"a": 2}, "stats_period_s": 3.0}
    engine = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    router = engine._deployment_config.request_router_config
    assert router.request_router_kwargs == {"policy": "consistent_hash", "weights": {"a": 2}}
    assert router.request_routing_stats_period_s == 3.0
