"""The Ray ingress's endpoints (router/serve/ingress.py) driven in process, without Ray or Serve.

The ingress object is made without its Serve constructor and given a fake engine client and
router: what is tested is the endpoint's own logic (the key check, what it answers, what the
router is asked), which the slow cluster tests (tests/router/serve/test_cluster.py) cannot show
cheaply.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request

from prefixserve.replica.entrypoints.openai import http_frontend
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions
from prefixserve.router.serve.ingress import OpenAIIngress
from prefixserve.router.serve.models import ModelsClient

KEY = "sk-placement"
SNAPSHOT = {"keys": {"0123456789abcdef": ["Engine#rank-0"]}}


class FakeRouter:
    """The router's placement side: a fixed snapshot, and a count of how often it was read."""

    def __init__(self) -> None:
        self.reads = 0

    def placement_snapshot(self) -> dict[str, Any]:
        self.reads += 1
        return SNAPSHOT

    def kv_held(self) -> dict[str, list[str]]:
        return {}


class FakeIngress(SimpleNamespace):
    """The ingress's state as its constructor leaves it, with its endpoint methods: Serve's class
    is not instantiated (its wrapper needs a running Serve replica, even to be collected)."""

    placement = OpenAIIngress.func_or_class.placement
    _named = OpenAIIngress.func_or_class._named


def ingress(router: FakeRouter, api_keys: list[str]) -> Any:
    return FakeIngress(
        options=FrontendOptions.build(api_keys, 1 << 20),
        client=ModelsClient([SimpleNamespace(router=router, cached_model_info=None)]),
        name="ingress-0",
        placement_leader="ingress-0",
    )


def get(path: str, authorization: str | None = None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""})


def test_placement_needs_the_api_key_and_shows_nothing_without_it():
    router = FakeRouter()
    ing = ingress(router, [KEY])
    for auth in (None, "Bearer sk-presented-by-a-stranger", f"Basic {KEY}x"):
        refused = asyncio.run(ing.placement(get("/placement", auth)))
        assert refused.status_code == 401
        body = json.loads(refused.body)
        assert body["error"]["code"] == "invalid_api_key"
        # Neither the table nor the presented key comes back.
        assert "0123456789abcdef" not in refused.body.decode() and "stranger" not in refused.body.decode()
    assert router.reads == 0  # the table was never even read for a refused caller
    ok = asyncio.run(ing.placement(get("/placement", f"Bearer {KEY}")))
    assert ok.status_code == 200 and json.loads(ok.body)["keys"] == SNAPSHOT["keys"]
    assert ok.headers["X-Prefixserve-Placement-Leader"] == "ingress-0"


def test_placement_without_configured_keys_stays_open():
    ok = asyncio.run(ingress(FakeRouter(), []).placement(get("/placement")))
    assert ok.status_code == 200


class NoEngine:
    """An engine client a refused request must never reach."""

    router = None

    async def model_info(self, name: str | None = None) -> Any:
        raise AssertionError("a refused request asked the engine")

    def open_stream(self, request: Any) -> Any:
        raise AssertionError("a refused request was routed")


def post(body: dict[str, Any], authorization: str | None) -> Request:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers, "query_string": b""}
    return Request(scope, receive)


def test_a_request_refused_for_its_key_leaves_no_routing_key_behind():
    """The routing key (what the placement table keeps) is computed only for an authenticated,
    valid request: a refused one is never keyed, so never routed or placed."""
    keyed: list[Any] = []

    def routing_key(body: Any, headers: Any) -> str:
        keyed.append(body)
        return "0123456789abcdef"

    options = FrontendOptions.build([KEY], 1 << 20)
    body = {"model": "m", "messages": [{"role": "system", "content": "secret"}, {"role": "user", "content": "x"}]}
    for auth in (None, "Bearer wrong"):
        response = asyncio.run(
            http_frontend.handle_generate(post(body, auth), api.ChatCompletionRequest, NoEngine(), options, routing_key)
        )
        assert response.status_code == 401
    assert keyed == []


def test_the_ingress_keys_an_adapters_requests_apart() -> None:
    from prefixserve.replica.contract.request import ModelInfo
    from prefixserve.router.routing_key import PrefixKeyConfig, adapter_key, prefix_hash

    info = ModelInfo(model_name="base", model="/models/base", max_model_len=64, adapters=(("ad", "/adapters/ad"),))
    fake = SimpleNamespace(client=ModelsClient([SimpleNamespace(cached_model_info=info)]), key_config=PrefixKeyConfig())
    key_of = OpenAIIngress.func_or_class._routing_key
    body = {"messages": [{"role": "system", "content": "tenant"}, {"role": "user", "content": "hi"}]}
    assert key_of(fake, {**body, "model": "base"}, {}) == prefix_hash("tenant")
    assert key_of(fake, {**body, "model": "ad"}, {}) == adapter_key(prefix_hash("tenant"), "ad")
