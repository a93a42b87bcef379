"""The input processor: a prompt in, one validated PreparedRequest out.

Job: everything between what a client sent and what the engine core accepts, once per
request: the cheap size bounds (characters, message counts), tokenization and the chat
template, the one ``max_tokens`` rule (``fit_max_tokens``), validation against the model,
the static-prefix token count, ``bad_words`` as token ids and the grammar of a structured
output. The result is a frozen ``PreparedRequest`` (replica/core/request.py) that nothing
after this module checks or copies again.

A request is built in three steps, whoever asks: its encoding (``encode_request`` for an
EngineRequest, ``encode_prompt`` for a prompt its caller rendered, offline), its grammar
(``compile_grammar`` / ``compile_grammar_async``) and ``build``, the one factory from an
EngineRequest to its PreparedRequest. The blocking steps run on the engine's tokenizer thread
and in the grammar cache's workers in a server (replica/engine/async_engine.py), in the
caller's thread offline (replica/engine/core.py ``add_request``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.continuation import Continuation, ContinuationMismatchError
from prefixserve.replica.contract.request import EngineRequest, priority_error
from prefixserve.replica.contract.retention import RETENTION_24H
from prefixserve.replica.contract.routing import canonical_json
from prefixserve.replica.core.request import PreparedRequest, static_prefix_messages
from prefixserve.replica.engine.bounded_memo import BoundedMemo, str_bytes
from prefixserve.replica.errors import BadRequestError, PromptTooLongError, RequestRejected
from prefixserve.replica.lora.request import LoRARequest
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.compile import GrammarCache
from prefixserve.replica.tool_calling.choice import ToolCallMode
from prefixserve.replica.tool_calling.templates import template_for

# Distinct system prompts whose token ids InputProcessor.static_prefix_tokens remembers, and their bytes
# (least recently used out first).
STATIC_PREFIX_MEMO_ENTRIES = 1024
STATIC_PREFIX_MEMO_BYTES = 16 * 1024**2
# Bytes of one memoized token id: its slot in the tuple and the int object.
_TOKEN_ID_BYTES = 36


def fit_max_tokens(request: EngineRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams once its prompt length is known: the one ``max_tokens`` rule.

    A client's own ``max_tokens`` stands (the engine refuses it if prompt plus
    ``max_tokens`` does not fit). Without one, the request gets
    ``min(max_tokens_default, max_model_len - prompt_len)``, at least 1:
    ``max_model_len`` (what fits) for chat, 16 for completions.
    """
    if request.max_tokens_default is None:
        return request.sampling
    fit = min(request.max_tokens_default, max_model_len - prompt_len)
    return dataclasses.replace(request.sampling, max_tokens=max(1, fit))


def retention_owner(request: EngineRequest) -> str | None:
    """Whose pin budget a request asking for retention draws on: its tenant, else its client
    (everyone unnamed shares one); None when it asked for none."""
    if request.cache_retention != RETENTION_24H:
        return None
    return request.tenant or request.client or ""


def rendered_request(
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    cache_salt: str | None,
    trace_headers: Mapping[str, str] | None,
    conversation: bool,
    tool_mode: ToolCallMode | None,
    priority: int = 0,
) -> EngineRequest:
    """The EngineRequest of a prompt its caller rendered (LLMEngine.add_request, AsyncEngine.generate)."""
    return EngineRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=params,
        cache_salt=cache_salt,
        trace_headers=dict(trace_headers) if trace_headers is not None else None,
        conversation=conversation,
        tool_mode=tool_mode,
        priority=priority,
    )


class EncodedPrompt(NamedTuple):
    """A prompt tokenized and validated: what ``build`` turns into a PreparedRequest."""

    token_ids: tuple[int, ...]
    params: SamplingParams
    static_prefix_tokens: int
    bad_words_token_ids: tuple[tuple[int, ...], ...]


class InputProcessor:
    """Turns prompts into PreparedRequests for one engine (its tokenizer, model and KV cache size).

    ``grammars`` is the engine's grammar cache; ``num_kv_blocks`` the KV cache's block count
    (a request needing more can never run).
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        num_kv_blocks: int,
        grammars: GrammarCache,
        chat_template: str | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # The logits' width, which may exceed the tokenizer's vocabulary.
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.grammars = grammars
        # --chat-template: renders every chat request (replica/tool_calling/templates.py).
        self.chat_template = chat_template
        self.max_prompt_chars = _max_prompt_chars(tokenizer, max_model_len)
        self.min_message_tokens = min_message_tokens(tokenizer)
        # Static prefix (system messages, template kwargs) -> its token ids through the chat
        # template (static_prefix_tokens). Read and written from worker threads.
        self._static_prefix_ids: BoundedMemo[tuple[int, ...]] = BoundedMemo(
            STATIC_PREFIX_MEMO_BYTES, STATIC_PREFIX_MEMO_ENTRIES
        )

    @property
    def static_prefix_memo_bytes(self) -> int:
        """Bytes the static-prefix memo holds (``prefixserve:request_cache_bytes{cache="static_prefix"}``)."""
        return self._static_prefix_ids.nbytes

    # --- size bounds, before any tokenizing ------------------------------------------

    def check_prompt_text(self, prompt: str) -> None:
        """Refuse (PromptTooLongError) a text prompt too long to fit, without tokenizing it."""
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} characters, more than any prompt that fits this model's "
                f"maximum context length of {self.max_model_len} tokens can have: shorten it",
                param="prompt",
            )

    @property
    def max_messages(self) -> int | None:
        """Messages above which a chat cannot fit ``max_model_len`` (see min_message_tokens); None if unknown."""
        return self.max_model_len // self.min_message_tokens if self.min_message_tokens else None

    def check_messages_size(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> None:
        """Refuse (PromptTooLongError) a chat too long to fit, without rendering it.

        Sound bounds only: every message renders at least ``min_message_tokens``
        template tokens (empty ones too), and the contents alone, with the strings of
        ``tools`` (which every tool template renders as JSON), are under the character
        bound of ``max_prompt_chars``.
        """
        limit = self.max_messages
        if limit is not None and len(messages) > limit:
            raise PromptTooLongError(
                f"the chat has {len(messages)} messages; each renders at least {self.min_message_tokens} "
                f"tokens, so at most {limit} fit this model's maximum context length of "
                f"{self.max_model_len} tokens: send fewer"
            )
        if self.max_prompt_chars is not None:
            chars = sum(len(m.get("content") or "") for m in messages) + json_string_chars(tools)
            if chars > self.max_prompt_chars:
                raise PromptTooLongError(
                    f"the messages have {chars} characters, more than any prompt that fits this model's "
                    f"maximum context length of {self.max_model_len} tokens can have: shorten them"
                )

    def check_prompt_size(self, request: EngineRequest) -> None:
        """Refuse (400 context_length_exceeded) a request's prompt that cannot fit, without tokenizing it.

        Text uses the character bound (``max_prompt_chars``: more characters than
        ``max_model_len`` of the longest token can cover). A chat is bounded by its
        message count (every message renders some template tokens, ``max_messages``)
        and its contents' characters.
        """
        if isinstance(request.prompt, str):
            self.check_prompt_text(request.prompt)
        elif request.prompt is not None:
            if len(request.prompt) > self.max_model_len:
                raise PromptTooLongError(
                    f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                    f"{len(request.prompt)} tokens",
                    param="prompt",
                )
        else:
            self.check_messages_size(request.messages or [], request.tools)

    # --- tokens ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a text prompt (the tokenizer's own list), or a token-id prompt's as ints."""
        if isinstance(prompt, str):
            self.check_prompt_text(prompt)
            ids = self.tokenizer(prompt).input_ids
            return ids if type(ids) is list else list(ids)
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the chat template (generation prompt added).

        The template is ``--chat-template``'s, else the checkpoint's; a conversation with
        ``tools=`` on a model whose template renders none gets the shipped tool template.
        """
        template_kwargs.setdefault("add_generation_prompt", True)
        template = template_for(
            getattr(self.tokenizer, "chat_template", None), self.chat_template, bool(template_kwargs.get("tools"))
        )
        if template is not None:
            template_kwargs.setdefault("chat_template", template)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs)
        return ids if type(ids) is list else list(ids)

    def static_prefix_tokens(
        self, messages: list[dict[str, Any]], prompt_ids: Sequence[int], **template_kwargs: Any
    ) -> int:
        """How many leading tokens of ``prompt_ids`` (``messages`` through the chat template) are the
        conversation's static prefix: its leading system/developer messages (and ``tools=``, which
        the template renders before the conversation), rendered alone.

        The common run of the two renderings, so a template that renders the system part
        differently on its own costs only the tokens that differ. 0 without a static prefix,
        or when the template refuses the system messages alone. Memoized per system prompt
        (bounded in bytes): call it only for a prompt the engine admits (``validate``), so
        that refused requests leave nothing behind.
        """
        static = static_prefix_messages(messages)
        tools = template_kwargs.get("tools")
        if not static and not tools:
            return 0
        if not static:
            # Templates refuse an empty conversation; an empty system turn renders as none in the
            # shipped tool template, and any other difference only shortens the common run below.
            static = [{"role": "system", "content": ""}]
        try:
            # Tools are lists of dicts: their canonical JSON stands for them in the memo key.
            key: Any = (
                tuple((m.get("role"), m.get("content")) for m in static),
                tuple(sorted((k, canonical_json(v) if k == "tools" else v) for k, v in template_kwargs.items())),
            )
            hash(key)
        except TypeError:  # unhashable contents or kwargs: render without the memo
            key = None
        ids = self._static_prefix_ids.get(key) if key is not None else None
        if ids is None:
            try:
                ids = tuple(self.encode_chat(static, **{**template_kwargs, "add_generation_prompt": False}))
            except Exception:  # noqa: BLE001 - a template that needs a user turn: no static prefix
                ids = ()
            if key is not None:
                size = str_bytes(v for pair in key[0] for v in pair) + _TOKEN_ID_BYTES * len(ids)
                self._static_prefix_ids.put(key, ids, size + 64 * len(static))
        n = len(ids)
        if tuple(prompt_ids[:n]) == ids:
            return n
        return next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(n, len(prompt_ids)))

    def bad_words_token_ids(self, bad_words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of ``bad_words``: each word alone and after a space (so that it is
        banned at the start and in the middle of a text), the second only when it is a
        different word token of the same length."""
        out: list[list[int]] = []
        for word in bad_words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if not ids:
                    continue
                if not prefix or (out and ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                    out.append(ids)
        return tuple(tuple(ids) for ids in out)

    # --- validation --------------------------------------------------------------------

    def validate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt_field: str = "messages",
        client_token_ids: bool = False,
    ) -> None:
        """Raise RequestRejected / PromptTooLongError for a request that can never be served.

        ``prompt_field``: the request field a PromptTooLongError names (``prompt`` for completions).
        ``client_token_ids``: the ids are a client's token-id prompt, which must also be in the
        tokenizer's vocabulary (BadRequestError on ``prompt``).

        Everything that reaches the engine loop is checked here, once, before it is queued:
        what SamplingParams cannot check alone (the vocabulary, max_num_seqs, the
        context length and the KV cache size).
        """
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        lowest, highest = min(prompt_ids), max(prompt_ids)
        if client_token_ids and highest >= len(self.tokenizer):
            raise BadRequestError(
                f"prompt token ids must be below the vocabulary size {len(self.tokenizer)}",
                param="prompt",
                code="invalid_value",
            )
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: shorten the prompt or "
                f"lower max_tokens",
                param=prompt_field,
            )
        vocab = self.vocab_size
        if lowest < 0 or highest >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise RequestRejected(f"stop_token_ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise RequestRejected(f"allowed_token_ids must be token ids in [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(
                f"n is {params.n} but this engine runs at most max_num_seqs="
                f"{self.config.max_num_seqs} sequences at once: lower n"
            )
        blocks = -(-total // self.config.block_size)
        if blocks > self.num_kv_blocks:
            raise PromptTooLongError(
                f"the request needs {blocks} KV blocks but the cache has {self.num_kv_blocks}: "
                f"shorten it or give the engine more KV memory",
                param=prompt_field,
            )

    # --- whole requests ------------------------------------------------------------------

    def encode_prompt(
        self, prompt: str | Sequence[int], params: SamplingParams, *, static_prefix_tokens: int = 0
    ) -> EncodedPrompt:
        """A text or token-id prompt tokenized and validated (blocking: the tokenizer runs here)."""
        if isinstance(prompt, str):
            ids = tuple(self.tokenize(prompt))
        else:
            ids = tuple(map(int, prompt))
        self.validate(ids, params)
        return EncodedPrompt(ids, params, max(0, int(static_prefix_tokens)), self.bad_words_token_ids(params.bad_words))

    def encode_request(self, request: EngineRequest) -> EncodedPrompt:
        """An EngineRequest's prompt through the template and tokenizer, ``fit_max_tokens`` applied,
        validated, its static prefix counted (blocking).

        The request is validated before its static prefix is rendered and memoized: a refused
        request leaves nothing behind. Raises BadRequestError (400) when the chat template
        rejects the messages or a token id is not in the tokenizer's vocabulary.
        """
        field = "prompt" if request.prompt is not None else "messages"
        messages = request.messages
        if messages is not None:
            try:
                chat = self.encode_chat(messages, tools=request.tools) if request.tools else self.encode_chat(messages)
            except Exception as exc:  # a chat template refusing the conversation (jinja error)
                raise BadRequestError(
                    f"the chat template rejected the messages: {exc}", param="messages", code="invalid_value"
                ) from exc
            ids = tuple(chat)
        elif isinstance(request.prompt, str):
            ids = tuple(self.tokenize(request.prompt))
        elif request.prompt is not None:
            ids = tuple(map(int, request.prompt))
        else:
            raise ValueError("encode_request needs a prompt or messages")
        params = fit_max_tokens(request, len(ids), self.max_model_len)
        self.validate(ids, params, prompt_field=field, client_token_ids=isinstance(request.prompt, list))
        static = 0
        if messages:
            kwargs = {"tools": request.tools} if request.tools else {}
            static = self.static_prefix_tokens(messages, ids, **kwargs)
        return EncodedPrompt(ids, params, static, self.bad_words_token_ids(params.bad_words))

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` in the caller's thread (offline); None if free."""
        constraint = params.structured_outputs
        return None if constraint is None else self.grammars.get(constraint)

    async def compile_grammar_async(self, params: SamplingParams, client: str | None = None) -> Any:
        """The compiled grammar of ``params.structured_outputs``, compiled in a grammar worker and bounded
        in time (``grammar_compile_timeout_s``): the engine loop only ever sees compiled grammars.
        ``client`` (EngineRequest.client): whose share of the compile pool it takes."""
        constraint = params.structured_outputs
        return None if constraint is None else await self.grammars.get_async(constraint, client)

    def build(
        self,
        request: EngineRequest,
        encoded: EncodedPrompt,
        grammar: Any,
        *,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """The one factory of a PreparedRequest: ``request`` (its id, text prompt, cache salt, trace
        context, conversation flag and tool mode) with its encoding (``encode_request``; offline,
        ``encode_prompt`` of a prompt its caller rendered) and ``grammar``, the compiled grammar of a
        constrained request (``compile_grammar``; dropped for a free one).

        ``arrival_time``: when the engine host received it (time.monotonic()), where its queue time starts.
        ``lora_request``: its LoRA adapter, already loaded and checked (``LLMEngine.add_lora``).
        A priority this engine's scheduling policy refuses is a RequestRejected (400, vLLM's message).
        """
        constrained = encoded.params.structured_outputs is not None
        if constrained and grammar is None:
            raise ValueError("a constrained request needs its compiled grammar")
        problem = priority_error(request.priority, self.config.scheduling_policy)
        if problem is not None:
            raise RequestRejected(problem)
        if request.continuation is not None:
            self.check_continuation(request.continuation, encoded)
        return PreparedRequest(
            request_id=request.request_id,
            prompt_token_ids=encoded.token_ids,
            params=encoded.params,
            cache_salt=request.cache_salt,
            arrival_time=arrival_time,
            prompt=request.prompt if isinstance(request.prompt, str) else None,
            trace_headers=request.trace_headers,
            conversation=request.conversation,
            static_prefix_tokens=encoded.static_prefix_tokens,
            bad_words_token_ids=encoded.bad_words_token_ids,
            tool_mode=request.tool_mode,
            grammar=grammar if constrained else None,
            lora_request=lora_request,
            priority=request.priority,
            retention_owner=retention_owner(request),
            continuation=request.continuation,
        )

    def check_continuation(self, continuation: Continuation, encoded: EncodedPrompt) -> None:
        """Refuse (ContinuationMismatchError) a continuation this engine cannot take exactly: one of
        several sequences, a prompt that tokenizes to another length here, tokens outside the
        vocabulary, or as many tokens as ``max_tokens`` allows (the output was over). What the
        tokens' replay finds (an output they already end, text other than the client's) is the
        engine core's check (LLMEngine.add_prepared)."""
        params, sent = encoded.params, continuation.output_token_ids
        if params.n != 1:
            raise ContinuationMismatchError(f"only a single sequence continues on another replica; n is {params.n}")
        if continuation.num_prompt_tokens != len(encoded.token_ids):
            raise ContinuationMismatchError(
                f"the prompt is {len(encoded.token_ids)} tokens here and was {continuation.num_prompt_tokens} "
                "on the replica that started the stream: they do not serve the same model and template"
            )
        if sent and (min(sent) < 0 or max(sent) >= self.vocab_size):
            raise ContinuationMismatchError(f"the continued token ids must be in [0, {self.vocab_size})")
        if len(sent) >= params.max_tokens:
            raise ContinuationMismatchError(
                f"the stream already has {len(sent)} tokens, its max_tokens ({params.max_tokens}): nothing to continue"
            )


def json_string_chars(value: Any) -> int:
    """The characters of the strings (keys included) in a JSON value: a lower bound of its JSON text's."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters above which a text prompt cannot fit in ``max_model_len`` tokens; None if unknown.

    Without a normalizer, a tokenizer's tokens spell out the text they cover: one vocab
    string per token (byte-level BPE writes one character per byte, SentencePiece one
    per character, and a special token in the text is its own vocab string), and a
    character is at least one byte. So a text of C characters has at least
    C / (longest vocab string) tokens, and a prompt longer than
    ``max_model_len * longest`` characters can never fit. A normalizer may shrink the
    text (Unicode composition, whitespace folding), which breaks the bound: then
    there is none and such prompts are only refused once tokenized.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    return max_model_len * longest if longest else None


# Roles whose empty messages min_message_tokens renders.
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def min_message_tokens(tokenizer: Any) -> int:
    """The fewest tokens the chat template renders for one message, however empty; 0 if unknown.

    Measured on the template itself: for every pair of roles, the tokens of one
    empty message, and what a second and a third empty message add to it (a
    template that renders a message as delimiters and a role name adds the same
    each time). The minimum over all of them bounds every message, so a chat of
    ``n`` messages has at least ``n * min_message_tokens`` tokens. A template that
    renders some message as nothing (skips empty ones) gives 0: no bound.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return 0

    def count(roles: tuple[str, ...]) -> int:
        messages = [{"role": r, "content": ""} for r in roles]
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
        )

    costs: list[int] = []
    for first in _CHAT_ROLES:
        for then in _CHAT_ROLES:
            try:
                one, two, three = count((first,)), count((first, then)), count((first, then, then))
            except Exception:  # noqa: BLE001 - a template refusing this role or order: not a bound
                continue
            costs += [one, two - one, three - two]
    return max(0, min(costs)) if costs else 0
