"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Registered only behind the same opt-in as vLLM's (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
in the environment, or ``--allow-runtime-lora-updating``), and behind the API key like
``/v1/*``. Bodies and answers are vLLM's: ``{"lora_name", "lora_path"}`` to load,
``{"lora_name"}`` to unload; a plain-text ``Success: ...`` line with 200; an OpenAI error
body otherwise: 400 when LoRA is off, the name is served already, or the adapter does not fit
the model (rank, target modules, base model, missing or corrupt files), with nothing changed;
404 when unloading a name that is not served. The adapter is read on the engine thread
between two steps (``AsyncEngine.load_lora_adapter``). Unloading lets the requests in flight
finish with the adapter; new requests naming it are 404s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from prefixserve.replica.entrypoints.openai import http_frontend
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions
from prefixserve.replica.errors import APIError, BadRequestError, ModelNotFoundError

if TYPE_CHECKING:
    from prefixserve.replica.engine.async_engine import AsyncEngine

# vLLM's opt-in for the runtime endpoints.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    """Whether the endpoints are served: the server's flag, or vLLM's environment variable set true."""
    return flag or os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional field; the name decides


async def _read(request: Request, model: type[BaseModel], options: FrontendOptions) -> BaseModel:
    http_frontend.check_auth(request, options)
    data = api.parse_json_object(
        await http_frontend.read_body(request, options.max_body_bytes, options.client_body_timeout_s)
    )
    return api.validate_request(model, data)  # type: ignore[arg-type]


async def load_lora_adapter(request: Request, engine: AsyncEngine, options: FrontendOptions) -> Response:
    try:
        body = await _read(request, LoadLoRAAdapterRequest, options)
        assert isinstance(body, LoadLoRAAdapterRequest)
        if not body.lora_name or not body.lora_path:
            raise BadRequestError("lora_name and lora_path must both be non-empty", param="lora_name")
        try:
            await engine.load_lora_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    except APIError as exc:
        return http_frontend.error_response(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request, engine: AsyncEngine, options: FrontendOptions) -> Response:
    try:
        body = await _read(request, UnloadLoRAAdapterRequest, options)
        assert isinstance(body, UnloadLoRAAdapterRequest)
        try:
            await engine.unload_lora_adapter(body.lora_name)
        except KeyError:
            raise ModelNotFoundError(f"the LoRA adapter {body.lora_name!r} is not served", param="lora_name") from None
    except APIError as exc:
        return http_frontend.error_response(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
