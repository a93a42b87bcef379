"""vLLM's tokenizer endpoints on one replica: ``/tokenize``, ``/detokenize`` and the chat render.

Job: answer the requests routers and clients make of a vLLM server to count or see
the tokens of a prompt, with vLLM's request and response shapes
(vllm/entrypoints/serve/tokenize/ and serve/render/):

* ``POST /tokenize``: ``{prompt, add_special_tokens=true}`` or ``{messages, tools?,
  add_generation_prompt=true}`` (plus ``model``, ``return_token_strs``) ->
  ``{count, max_model_len, tokens, token_strs}``.
* ``POST /detokenize``: ``{tokens}`` -> ``{prompt}``.
* ``POST /v1/chat/completions/render``: a chat completion body -> vLLM's
  ``GenerateRequest`` (``request_id``, ``token_ids``, ``sampling_params``, ``model``,
  ``stream``, ``stream_options``, ``cache_salt``, ``priority``, ...): the prompt's
  token ids exactly as the engine would run them (the engine's own prepare path:
  template, tokenizer, max_tokens fitted to the prompt), with nothing generated;
  ``POST /v1/completions/render``: the same of a completion body, a list of one.
  vllm-router's cache_aware policy posts each request to its render endpoint (with the
  SGLang fields it adds) before it forwards the request itself.

Invariants:
* A chat's tokens are the engine's: the same chat template (``--chat-template``
  included), tools and tokenizer as a generation request's, on the engine's tokenizer
  thread, never on the event loop.
* ``/tokenize`` counts a prompt past ``max_model_len`` (vLLM does: clients ask to know
  how much to cut), but one whose size alone shows it cannot fit (the engine's
  character and message-count bounds) is refused before any tokenizing, so the work a
  request can cause stays bounded.
* Errors are the OpenAI error body every endpoint uses (400 bad body or a prompt
  that cannot fit, 401 key, 404 model, 413 body); unknown top-level fields are
  ignored or refused as on the generation endpoints (request_fields.py).

Knows one local engine (the standalone server's): imports FastAPI and the replica's
framework-free modules; never Ray or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from prefixserve.replica.contract.request import EngineClient
from prefixserve.replica.engine.tokenizer_executor import messages_chars
from prefixserve.replica.entrypoints.openai import http_frontend
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions
from prefixserve.replica.entrypoints.openai.protocol import ChatCompletionTool, ChatMessage, RequestModel, TokenId
from prefixserve.replica.errors import BadRequestError

if TYPE_CHECKING:
    from prefixserve.replica.engine.async_engine import AsyncEngine
    from prefixserve.replica.sampling_params import SamplingParams


def _refuse_unless(info: ValidationInfo, value: Any, harmless: bool, allowed: str) -> Any:
    """``value`` when unset or ``harmless``; else field ``info.field_name`` is refused (400 unsupported_parameter)."""
    if value is None or harmless:
        return value
    raise PydanticCustomError(
        "unsupported_parameter",
        "{name} is not supported by this server; send {allowed} or omit it",
        {"name": str(info.field_name), "allowed": allowed},
    )


class TokenizeCompletionRequest(RequestModel):
    """``POST /tokenize`` of a text prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestModel):
    """``POST /tokenize`` of a conversation (vLLM's ``TokenizeChatRequest``), rendered by the server's template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionTool] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    # vLLM's fields this server does not implement: accepted at vLLM's defaults only.
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: Any = None
    chat_template_kwargs: Any = None

    @field_validator("continue_final_message", "add_special_tokens")
    @classmethod
    def _off(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        return _refuse_unless(info, value, value is False, "false")

    @field_validator("chat_template", "chat_template_kwargs")
    @classmethod
    def _server_template(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(info, value, value == {}, "null (the server's --chat-template applies)")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``)."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# The sampling parameters a render answer reports, under vLLM's SamplingParams names.
_RENDERED_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def rendered_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """``params`` as a render answer's ``sampling_params`` (vLLM's names; top_k -1 when off, as vLLM's)."""
    out = {name: getattr(params, name) for name in _RENDERED_SAMPLING_FIELDS}
    if out["top_k"] is None:
        out["top_k"] = -1
    return out


async def _read_json(request: Request, options: FrontendOptions) -> dict[str, Any]:
    """The request's JSON object body, once its key is checked (401) and within the size limit (413)."""
    http_frontend.check_auth(request, options)
    return api.parse_json_object(
        await http_frontend.read_body(request, options.max_body_bytes, options.client_body_timeout_s)
    )


async def _read(
    request: Request, model: type[RequestModel], options: FrontendOptions, *, scheduling_policy: str = "fcfs"
) -> Any:
    """The request's body validated as ``model`` (unknown fields as ``options`` says; ``priority`` as
    the engine's ``scheduling_policy`` takes it)."""
    data = await _read_json(request, options)
    filtered = options.ignored_fields.filter(model, data)
    return model.model_validate(filtered, context={"scheduling_policy": scheduling_policy})


class Tokenization:
    """The tokenizer endpoints over one local engine (``client`` answers the model checks)."""

    def __init__(self, engine: AsyncEngine, client: EngineClient, options: FrontendOptions) -> None:
        self.engine = engine
        self.client = client
        self.options = options

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: a text prompt's or a conversation's token ids."""
        try:
            body = await self._read_tokenize(request)
            info = await self.client.model_info()
            http_frontend.check_model(info, body.model)
            ids = await self._encode(body)
            strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            response = TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)
        except Exception as exc:
            return http_frontend.error_response(exc)
        return JSONResponse(response.model_dump())

    async def _read_tokenize(self, request: Request) -> TokenizeCompletionRequest | TokenizeChatRequest:
        data = await _read_json(request, self.options)
        # vLLM's union: a body with messages is a chat, any other a text prompt.
        model: type[TokenizeChatRequest] | type[TokenizeCompletionRequest] = (
            TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        )
        return model.model_validate(self.options.ignored_fields.filter(model, data))

    async def _encode(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The body's token ids on the engine's tokenizer thread (the engine's size bounds first)."""
        processor = self.engine.engine.input_processor
        if isinstance(body, TokenizeCompletionRequest):
            prompt, special = body.prompt, body.add_special_tokens
            processor.check_prompt_text(prompt)

            def encode_text() -> list[int]:
                return list(processor.tokenizer(prompt, add_special_tokens=special).input_ids)

            return await self.engine.tokenizer_executor.run(encode_text, chars=len(prompt))
        messages = [m.template_message() for m in body.messages]
        kwargs: dict[str, Any] = {"add_generation_prompt": body.add_generation_prompt}
        if body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        processor.check_messages_size(messages, kwargs.get("tools"))

        def encode_chat() -> list[int]:
            try:
                return processor.encode_chat(messages, **kwargs)
            except Exception as exc:  # a chat template refusing the conversation (jinja error)
                raise BadRequestError(
                    f"the chat template rejected the messages: {exc}", param="messages", code="invalid_value"
                ) from exc

        return await self.engine.tokenizer_executor.run(encode_chat, chars=messages_chars(messages))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: the text of token ids."""
        try:
            body = await _read(request, DetokenizeRequest, self.options)
            info = await self.client.model_info()
            http_frontend.check_model(info, body.model)
            vocab = len(self.engine.tokenizer)
            for i, token in enumerate(body.tokens):
                if token >= vocab:
                    raise BadRequestError(
                        f"token id {token} is not in the vocabulary (size {vocab})", param=f"tokens.{i}"
                    )
            prompt = await self.engine.tokenizer_executor.run(
                lambda: self.engine.tokenizer.decode(body.tokens), chars=len(body.tokens)
            )
        except Exception as exc:
            return http_frontend.error_response(exc)
        return JSONResponse(DetokenizeResponse(prompt=prompt).model_dump())

    async def render_chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions/render``: the engine's token ids and sampling parameters of a
        chat completion request, with nothing generated (vLLM's ``GenerateRequest``)."""
        try:
            return JSONResponse(await self._render(request, api.ChatCompletionRequest))
        except Exception as exc:
            return http_frontend.error_response(exc)

    async def render_completion(self, request: Request) -> Response:
        """``POST /v1/completions/render``: the same of a completion request, as vLLM's list of one
        ``GenerateRequest`` per prompt (one prompt per request here)."""
        try:
            return JSONResponse([await self._render(request, api.CompletionRequest)])
        except Exception as exc:
            return http_frontend.error_response(exc)

    async def _render(self, request: Request, model: type[api.OpenAIRequest]) -> dict[str, Any]:
        """The body of ``request`` as the engine would run it, as vLLM's ``GenerateRequest``."""
        client_id = http_frontend.client_request_id(request.headers)
        body = await _read(request, model, self.options, scheduling_policy=self.engine.config.scheduling_policy)
        if isinstance(body, api.ChatCompletionRequest):
            body.check(tool_schemas=False)
        info = await self.client.model_info()
        http_frontend.check_model(info, body.model)
        # The generation endpoints' tool bounds, the schema checks off the event loop.
        http_frontend.check_tool_count(model, {"tools": getattr(body, "tools", None)}, info)
        await http_frontend.check_tool_schemas(body, info)
        engine_request = http_frontend.engine_request(body, info, None, client_id, request.headers)
        prepared = await self.engine.prepare(engine_request)
        stream_options = body.stream_options.model_dump() if body.stream and body.stream_options else None
        return {
            "request_id": http_frontend.answer_id(body, client_id, engine_request),
            "token_ids": list(prepared.prompt_token_ids),
            "features": None,
            "sampling_params": rendered_sampling_params(prepared.params),
            "model": body.model,
            "stream": body.stream,
            "stream_options": stream_options,
            "cache_salt": body.cache_salt,
            "priority": prepared.priority,
            "kv_transfer_params": None,
        }
