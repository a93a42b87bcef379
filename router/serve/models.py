"""Several base models behind one endpoint: one engine deployment (and request router) per model.

Job: :class:`ModelsClient` is the EngineClient the ingress serves with. It holds one client
per engine deployment (router/serve/ingress.py ``ServeEngineClient``, each over its own
deployment handle, hence its own request router and ring) and sends each request to the
deployment whose model it names: the base model's served name or path, or one of its LoRA
adapters. ``/v1/models`` lists every model (each followed by its adapters); a name no model
serves is a 404 naming them all; ``/health`` is 200 while every model has an engine replica
that passes its health check.

With one model it adds nothing: every call goes to that model's client as it would alone.

Pure Python: no Ray (the clients bring it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from prefixserve.replica.contract.request import EngineRequest, EngineStream, ModelInfo
from prefixserve.replica.errors import ModelNotFoundError


class ModelClient(Protocol):
    """What the ingress keeps per engine deployment (ServeEngineClient satisfies it)."""

    async def model_info(self) -> ModelInfo: ...

    @property
    def cached_model_info(self) -> ModelInfo | None: ...

    async def is_healthy(self) -> bool: ...

    def open_stream(self, request: EngineRequest) -> EngineStream: ...


C = TypeVar("C", bound=ModelClient)


class ModelsClient(Generic[C]):
    """An EngineClient over one client per base model (the module docstring), the default model first."""

    def __init__(self, clients: Sequence[C]) -> None:
        if not clients:
            raise ValueError("ModelsClient needs at least one model's client")
        self.clients = list(clients)

    @property
    def default(self) -> C:
        return self.clients[0]

    async def _infos(self) -> list[ModelInfo | BaseException]:
        return list(await asyncio.gather(*(c.model_info() for c in self.clients), return_exceptions=True))

    async def model_info(self, name: str | None = None) -> ModelInfo:
        """The info of the model serving ``name`` (None: the default model).

        A name no model serves is ModelNotFoundError (404) naming every served model, unless a
        model's engines did not answer: then that failure (503), since the name may be theirs.
        """
        if len(self.clients) == 1 or name is None:
            return await self.default.model_info()
        infos = await self._infos()
        for info in infos:
            if isinstance(info, ModelInfo) and info.serves(name):
                return info
        failed = next((i for i in infos if isinstance(i, BaseException)), None)
        if failed is not None:
            raise failed
        served = ", ".join(
            repr(n) for info in infos if isinstance(info, ModelInfo) for n in (info.model_name, *dict(info.adapters))
        )
        raise ModelNotFoundError(f"the model {name!r} does not exist on this server; it serves {served}", param="model")

    async def models(self) -> list[ModelInfo]:
        """Every model that answered, the default first (none answering: the default's failure)."""
        infos = await self._infos()
        answered = [i for i in infos if isinstance(i, ModelInfo)]
        if not answered:
            first = infos[0]
            assert isinstance(first, BaseException)
            raise first
        return answered

    def cached_model_info(self, name: str | None) -> ModelInfo | None:
        """The info, as last asked, of the model serving ``name`` (None: not asked yet, or no model serves it)."""
        for client in self.clients:
            info = client.cached_model_info
            if info is not None and (name is None or info.serves(name)):
                return info
        return None

    def serving(self, name: str) -> C | None:
        """The client of the model that serves ``name``, as last asked (None: no model does, or not asked yet)."""
        for client in self.clients:
            info = client.cached_model_info
            if info is not None and info.serves(name):
                return client
        return None

    def client_for(self, model: str | None) -> C:
        """The client of the model named ``model`` (its served name, as ``EngineRequest.model`` carries it);
        the default model's for None or a name none serves (its engines then refuse it)."""
        if model is None or len(self.clients) == 1:
            return self.default
        return self.serving(model) or self.default

    async def is_healthy(self) -> bool:
        """Whether every model has an engine replica passing its health check."""
        return all(await asyncio.gather(*(c.is_healthy() for c in self.clients)))

    def open_stream(self, request: EngineRequest) -> EngineStream:
        return self.client_for(request.model).open_stream(request)
