"""The cluster's config (router/cluster_config.py): `prefixserve up`'s flags come from its fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixserve.common.config_util import add_cli_arguments, from_cli_args
from prefixserve.common.endpoint_config import CLUSTER_PORT, REPLICA_PORT, EndpointConfig
from prefixserve.replica.config import EngineConfig
from prefixserve.replica.entrypoints.openai import server
from prefixserve.router.cli import up
from prefixserve.router.cluster_config import AppArgs, IngressArgs, IngressConfig, RouterArgs


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixserve up")
    up.add_arguments(parser)
    return parser


def parsed_up(*argv: str) -> AppArgs:
    return AppArgs.from_dict(up.app_args(up_parser().parse_args(list(argv))))


def field_default(cls: type, name: str) -> object:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def test_up_without_flags_deploys_the_app_args_defaults() -> None:
    app = parsed_up()
    assert app.num_replicas == field_default(AppArgs, "num_replicas")
    assert app.max_ongoing_requests == field_default(AppArgs, "max_ongoing_requests")
    assert app.drain_timeout_s == field_default(AppArgs, "drain_timeout_s")
    assert app.ray_actor_options == field_default(AppArgs, "ray_actor_options")
    assert app.router.policy == field_default(RouterArgs, "policy") and app.router.policy_options == {}
    assert app.ingress.num_replicas == field_default(IngressArgs, "num_replicas")
    assert app.ingress.config == IngressConfig()


def test_up_flags_land_in_their_sections() -> None:
    app = parsed_up(
        "--replicas=3",
        "--max-ongoing-requests=8",
        "--drain-timeout-s=5",
        "--replica-cpus=0.5",
        "--policy=bounded_load",
        "--epsilon=0.5",
        "--ingress-replicas=2",
        "--session-header",
        "--key-turns=2",
        "--api-key=a",
        "--api-key=b",
    )
    assert (app.num_replicas, app.max_ongoing_requests, app.drain_timeout_s) == (3, 8, 5.0)
    assert app.ray_actor_options == {"num_cpus": 0.5}
    assert (app.router.policy, app.router.policy_options) == ("bounded_load", {"epsilon": 0.5})
    assert app.ingress.num_replicas == 2
    assert (app.ingress.config.session_header, app.ingress.config.key_turns) == (True, 2)
    assert app.ingress.config.api_keys == ["a", "b"]


def test_a_policy_option_the_policy_lacks_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="precise"):
        parsed_up("--policy=round_robin", "--precise")


def test_up_and_replica_share_the_endpoint_flags() -> None:
    replica = argparse.ArgumentParser()
    server.add_arguments(replica)

    def options(parser: argparse.ArgumentParser) -> dict[str, tuple[str | None, str]]:
        names = {f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in dataclasses.fields(EndpointConfig)}
        return {a.option_strings[0]: (a.help, a.dest) for a in parser._actions if a.option_strings[0] in names}

    shared = options(up_parser())
    assert set(shared) == {"--host", "--port", "--api-key", "--log-format"}
    assert {k: v for k, v in options(replica).items() if k != "--port"} == {
        k: v for k, v in shared.items() if k != "--port"
    }
    assert up_parser().parse_args([]).port == CLUSTER_PORT
    assert replica.parse_args([]).port == REPLICA_PORT != CLUSTER_PORT


def test_repeated_options_collect_and_default_to_the_field_factory() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, EndpointConfig, "http")
    assert from_cli_args(EndpointConfig, parser.parse_args([])).api_keys == []
    got = from_cli_args(EndpointConfig, parser.parse_args(["--api-key", "k1", "--api-key", "k2"]))
    assert got.api_keys == ["k1", "k2"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
    # vLLM's --lora-modules: several after one flag, or the flag repeated.
    engine = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(engine)
    flags = ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"]
    assert EngineConfig.from_cli_args(engine.parse_args(flags)).lora_modules == ["a=/x", "b=/y", "c=/z"]


def test_dest_prefix_keeps_same_named_fields_apart() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, AppArgs, "cluster", only=("num_replicas",))
    add_cli_arguments(parser, IngressArgs, "ingress", only=("num_replicas",), dest_prefix="ingress_")
    args = parser.parse_args(["--replicas", "4", "--ingress-replicas", "3"])
    assert (args.num_replicas, args.ingress_num_replicas) == (4, 3)


@pytest.mark.parametrize(
    ("section", "args", "named"),
    [
        ("app args", {"engine": {}, "num_replica": 2}, "num_replica"),
        ("ingress", {"engine": {}, "ingress": {"num_replica": 2}}, "num_replica"),
        ("router", {"engine": {}, "router": {"polcy": "placed"}}, "polcy"),
    ],
)
def test_unknown_keys_are_named(section: str, args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as exc:
        AppArgs.from_dict(args)
    assert "keys" in str(exc.value), section


def test_endpoint_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="port"):
        EndpointConfig(port=70000)
    with pytest.raises(ValueError, match="api_keys"):
        EndpointConfig(api_keys=[""])
    with pytest.raises(ValueError, match="log_format"):
        EndpointConfig(log_format="xml")


def test_up_builds_the_serve_app_its_flags_describe() -> None:
    from prefixserve.router.serve.app import build_app

    args = up.app_args(
        up_parser().parse_args(
            ["--replicas=3", "--max-ongoing-requests=8", "--policy=bounded_load", "--epsilon=0.5", "--api-key=k"]
        )
    )
    ingress = build_app(args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    config = engine._deployment_config
    assert (config.num_replicas, config.max_ongoing_requests) == (3, 8)
    assert config.request_router_config.request_router_kwargs == {"policy": "bounded_load", "epsilon": 0.5}
    assert ingress.num_replicas == field_default(IngressArgs, "num_replicas")
    assert ingress.init_args[1]["api_keys"] == ["k"]


def _router_kwargs(*flags: str) -> dict:
    from prefixserve.router.serve.app import build_app

    ingress = build_app(up.app_args(up_parser().parse_args(list(flags))))._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    return engine._deployment_config.request_router_config.request_router_kwargs


def test_placed_is_tier_aware_by_default_when_a_kv_tier_is_on(tmp_path) -> None:
    """Only precise mode reads the KV events' tiers: a tier turns it on unless precise is given."""
    assert "precise" not in _router_kwargs()
    assert _router_kwargs("--kv-offloading-size=2")["precise"] is True
    assert _router_kwargs("--kv-offloading-size=2", f"--kv-disk-path={tmp_path}")["precise"] is True
    assert _router_kwargs("--kv-offloading-size=2", "--no-precise")["precise"] is False
    assert _router_kwargs("--precise")["precise"] is True
    # Other policies take no precise option, tier or not.
    assert "precise" not in _router_kwargs("--policy=bounded_load", "--kv-offloading-size=2")
    from prefixserve.router.serve.app import request_router_config

    router = RouterArgs.from_dict({"policy": "placed"})
    assert request_router_config(router, {"model": "m", "kv_disk_path": "/x"}).request_router_kwargs["precise"]
    assert "precise" not in request_router_config(router, {"model": "m"}).request_router_kwargs
    explicit = RouterArgs.from_dict({"policy": "placed", "precise": False})
    assert request_router_config(explicit, {"model": "m", "kv_offloading_size": 4}).request_router_kwargs == {
        "policy": "placed",
        "precise": False,
    }


def test_the_ingress_strict_request_fields_knob_is_a_bool():
    assert IngressConfig.from_dict({"strict_request_fields": True}).strict_request_fields is True
    with pytest.raises(ValueError, match="strict_request_fields"):
        IngressConfig.from_dict({"strict_request_fields": "yes"})


def test_up_tenants_file_reaches_each_ingress_replica_with_its_shares(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - {name: a, api_key: k, requests_per_minute: 60}\n")
    app = parsed_up(
        f"--tenants={tenants}", "--queue-budget-s=5", "--replicas=3", "--max-ongoing-requests=8", "--ingress-replicas=2"
    )
    built = IngressConfig.from_dict(app.ingress_config())
    table = built.tenant_table()
    assert table is not None and [t.name for t in table.tenants] == ["a"]
    flow = built.flow_config(1)
    # 3 engine replicas x 8 slots over 2 ingress replicas; each enforces half of every quota.
    assert (flow.max_in_flight, flow.queue_budget_s, flow.quota_share) == (12, 5.0, 0.5)
    assert parsed_up().ingress_config()["tenants"] is None


def test_a_malformed_tenants_file_stops_up_with_its_line(tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: a\n    apikey: k\n")
    with pytest.raises(ValueError, match="line 3: unknown tenant keys"):
        parsed_up(f"--tenants={tenants}")
    with pytest.raises(ValueError, match="ingress.tenants: 'tenants' must be a non-empty list"):
        AppArgs.from_dict({"engine": {"model": "m"}, "ingress": {"tenants": {"tenants": []}}})


def test_reserved_slots_must_leave_a_slot_to_the_other_bands() -> None:
    engine = {"model": "m", "max_num_seqs": 2}
    ok = AppArgs.from_dict({"engine": engine, "num_replicas": 2, "ingress": {"flow_reserved_slots": 3}})
    assert ok.ingress.config.flow_config(ok.flow_max_in_flight()).reserved_slots == 3
    with pytest.raises(ValueError, match="reserved_slots must be in"):
        AppArgs.from_dict({"engine": engine, "num_replicas": 2, "ingress": {"flow_reserved_slots": 4}})


def test_the_ingress_response_store_bounds_are_up_flags_with_the_servers_defaults() -> None:
    from prefixserve.replica.entrypoints.openai import response_store
    from prefixserve.router.serve.app import build_app

    defaults = IngressConfig()
    assert defaults.responses_max_entries == response_store.DEFAULT_MAX_ENTRIES
    assert defaults.responses_max_bytes == response_store.DEFAULT_MAX_BYTES
    flags = ["--responses-max-entries=5", "--responses-max-bytes=4096"]
    ingress = build_app(up.app_args(up_parser().parse_args(flags)))._bound_deployment
    assert (ingress.init_args[1]["responses_max_entries"], ingress.init_args[1]["responses_max_bytes"]) == (5, 4096)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="responses_max_entries"):
            IngressConfig(responses_max_entries=bad)


def test_up_serves_every_model_given_each_its_own_engine_deployment(tmp_path) -> None:
    from prefixserve.router.serve.app import build_app

    flags = ["--model=smollm2", f"--model={tmp_path}/other", "--num-kv-blocks=64", "--served-model-name=first"]
    flags += ["--replicas=2", "--lora-modules", f"a={tmp_path}/a", "--enable-lora"]
    args = up.app_args(up_parser().parse_args(flags))
    app = AppArgs.from_dict(args)
    first, second = app.deployments()
    assert (first.name, first.engine["model"], first.engine["served_model_name"]) == ("Engine", "smollm2", "first")
    assert first.engine["lora_modules"] == [f"a={tmp_path}/a"]
    # The engine options carry over; the first model's name and adapters do not.
    assert (second.name, second.engine["model"], second.engine["num_kv_blocks"]) == (
        "Engine-2",
        f"{tmp_path}/other",
        64,
    )
    assert second.engine["served_model_name"] is None and second.engine["lora_modules"] == []
    assert second.num_replicas == 2
    # Slots per ingress replica: both models' engines.
    assert app.flow_max_in_flight() == 2 * AppArgs.from_dict({"engine": args["engine"]}).flow_max_in_flight()
    ingress = build_app(args)._bound_deployment
    engine, config, more = ingress.init_args
    assert engine._bound_deployment.name == "Engine" and [m._bound_deployment.name for m in more] == ["Engine-2"]
    assert more[0]._bound_deployment.init_args[0]["model"] == f"{tmp_path}/other"


def test_models_are_refused_when_a_name_is_served_twice_or_an_entry_lacks_a_model() -> None:
    base = {"engine": {"model": "/m/one"}}
    assert [d.name for d in AppArgs.from_dict({**base, "models": [{"model": "/m/two"}]}).deployments()] == [
        "Engine",
        "Engine-2",
    ]
    with pytest.raises(ValueError, match="served by two engine deployments"):
        AppArgs.from_dict({**base, "models": [{"model": "/other/one"}]})  # both named "one"
    with pytest.raises(ValueError, match="served by two engine deployments"):
        AppArgs.from_dict(
            {
                "engine": {"model": "/m/one", "enable_lora": True, "lora_modules": ["two=/a"]},
                "models": [{"model": "/m/two"}],
            }
        )
    with pytest.raises(ValueError, match="needs a 'model'"):
        AppArgs.from_dict({**base, "models": [{"num_kv_blocks": 8}]})
    with pytest.raises(ValueError, match="num_replicas"):
        AppArgs.from_dict({**base, "models": [{"model": "/m/two", "num_replicas": 0}]})
    with pytest.raises(ValueError, match="list of engine sections"):
        AppArgs.from_dict({**base, "models": {"model": "/m/two"}})
    with pytest.raises(ValueError, match="EngineConfig|unknown"):
        AppArgs.from_dict({**base, "models": [{"model": "/m/two", "no_such_knob": 1}]})
