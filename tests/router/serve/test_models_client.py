"""Several base models behind one ingress (router/serve/models.py): each request to its model's engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from prefixserve.replica.contract.request import EngineRequest, ModelInfo
from prefixserve.replica.errors import ModelNotFoundError, ServiceUnavailableError
from prefixserve.router.serve.models import ModelsClient


@dataclass
class FakeModel:
    """One engine deployment's client: its info, health, and the requests it was sent."""

    info: ModelInfo
    healthy: bool = True
    down: bool = False
    asked: bool = False
    sent: list[EngineRequest] = field(default_factory=list)

    async def model_info(self, name: str | None = None) -> ModelInfo:
        if self.down:
            raise ServiceUnavailableError("no engine replica answered", code="no_replica")
        self.asked = True
        return self.info

    @property
    def cached_model_info(self) -> ModelInfo | None:
        return self.info if self.asked else None

    async def is_healthy(self) -> bool:
        return self.healthy

    def open_stream(self, request: EngineRequest):  # noqa: ANN201
        self.sent.append(request)
        return request.request_id


def info(name: str, adapters: tuple[tuple[str, str], ...] = ()) -> ModelInfo:
    return ModelInfo(model_name=name, model=f"/models/{name}", max_model_len=1024, adapters=adapters)


def models() -> tuple[ModelsClient, FakeModel, FakeModel]:
    a = FakeModel(info("alpha", (("alpha-lora", "/loras/a"),)))
    b = FakeModel(info("beta"))
    return ModelsClient([a, b]), a, b


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_each_name_finds_its_model_base_path_or_adapter() -> None:
    client, a, b = models()
    assert run(client.model_info("beta")) is b.info
    assert run(client.model_info("/models/beta")) is b.info
    assert run(client.model_info("alpha-lora")) is a.info
    assert run(client.model_info(None)) is a.info  # the default model
    assert [i.model_name for i in run(client.models())] == ["alpha", "beta"]


def test_an_unknown_model_is_a_404_naming_every_served_model() -> None:
    client, _, _ = models()
    with pytest.raises(ModelNotFoundError, match="'alpha', 'alpha-lora', 'beta'") as err:
        run(client.model_info("gamma"))
    assert err.value.status_code == 404


def test_a_model_whose_engines_do_not_answer_is_a_503_not_a_404() -> None:
    client, _, b = models()
    b.down = True
    assert run(client.model_info("alpha")).model_name == "alpha"
    with pytest.raises(ServiceUnavailableError):
        run(client.model_info("beta"))
    assert [i.model_name for i in run(client.models())] == ["alpha"]


def test_streams_go_to_the_engines_of_the_model_the_request_names() -> None:
    client, a, b = models()
    run(client.model_info("beta"))
    run(client.model_info("alpha"))
    client.open_stream(EngineRequest(prompt="x", model="beta", request_id="1"))
    client.open_stream(EngineRequest(prompt="x", model="alpha", lora_name="alpha-lora", request_id="2"))
    client.open_stream(EngineRequest(prompt="x", request_id="3"))  # no model: the default's
    assert [r.request_id for r in a.sent] == ["2", "3"] and [r.request_id for r in b.sent] == ["1"]
    assert client.cached_model_info("alpha-lora") is a.info and client.cached_model_info("nope") is None


def test_healthy_only_while_every_model_is() -> None:
    client, a, b = models()
    assert run(client.is_healthy())
    b.healthy = False
    assert not run(client.is_healthy())


def test_one_model_is_passed_through() -> None:
    a = FakeModel(info("alpha"))
    client = ModelsClient([a])
    # A name it does not serve is its own check's to refuse (the front end's check_model).
    assert run(client.model_info("other")) is a.info
    with pytest.raises(ValueError):
        ModelsClient([])
