"""The routing key of a request (design Contract 1).

Job: turn an OpenAI request body (and its headers) into the short string that
the ring hashes, so that requests sharing a static prefix land on the replica
that already caches it.

The rule, which any client in any language can reproduce:

* A request carrying an ``X-Prefix-Hash`` header uses the header's value.
* Otherwise a request with a non-empty ``prompt_cache_key`` (OpenAI's field: requests
  sharing it share a cache) uses the key of ``0x00 || "prompt_cache_key:" || its UTF-8
  bytes`` (the same SHA-256/16 hex digits, salt first, as below): the client's grouping
  beats the static prefix, and the leading 0x00 keeps it apart from every system prompt.
* Otherwise the static prefix of a chat request is the text of its leading run
  of ``system`` / ``developer`` messages joined by ``"\\n"`` (a message whose
  content is a list of OpenAI content parts contributes its parts' texts joined
  by ``"\\n"``). Only text parts (``{"type": "text", "text": ...}``) are
  accepted, as the OpenAI front end accepts only them: a static message with
  any other part (image, audio, file, a bare string) is a ValueError, never
  a key computed from part of its content. A completions request (``prompt``)
  uses the first ``completion_prefix_chars`` characters of its prompt (a
  token-id prompt: its first ``completion_prefix_chars`` ids as little-endian
  uint32).
* A chat request with a non-empty ``tools`` list: its tool definitions render
  before the conversation (the chat template puts them in the system turn), so
  they are part of the static prefix: the prefix bytes are the system text's
  UTF-8 bytes, one 0x00 byte, then the tools as canonical JSON (the ``tools``
  array as sent, object keys sorted, no whitespace, non-ASCII characters as
  themselves, UTF-8). Same system prompt and same tools: one key; another tool
  list: another key. Without tools the bytes are the system text's alone.
* A Responses request (``/v1/responses``: ``input``, no ``messages``) is keyed as the chat
  request it runs as: its ``instructions`` are the system text, and its function tools
  (``{"type": "function", "name", ...}``) are the chat's (``{"type": "function", "function":
  {"name", ...}}``, the fields that are not null). A continuation's stored history follows
  the static prefix, so it changes nothing here.
* The key is the first 16 hex digits of SHA-256 over the prefix's bytes,
  with ``cache_salt`` UTF-8 bytes and one 0x00 byte in front when the request
  has a salt. For one system message, no tools and no salt this is exactly
  ``sha256(system_msg.encode()).hexdigest()[:16]``.
* No static prefix (no leading system/developer message or empty text, and no
  tools; an empty prompt) means no affinity: the key is ``None`` and the policy
  routes by load.
* A request for a LoRA adapter (its ``model`` names an adapter the replicas serve: only the
  front end knows which names are adapters, so it passes ``adapter``) has another KV than the
  base's and every other adapter's for the same prefix, so it gets another key: the first 16
  hex digits of SHA-256 over ``0x00 || "lora:" || adapter name || 0x00 || the key above`` (the
  key's ASCII; empty when the request has no static prefix, so an adapter's requests without
  one still share its replicas). The header, when sent, is used as it is.

Multi-turn affinity (opt-in, off by default; the rule above is unchanged
without it): a conversation's later turns share more than the system prompt,
so the key may name the conversation instead of the tenant.

* ``session_header``: a chat request carrying ``X-Session-Id`` gets the key of
  ``static prefix || 0x00 || "session:" || session id`` (the same SHA-256/16
  hex digits, salt first as above); without a static prefix, of
  ``0x00 || "session:" || session id``.
* ``key_turns = N``: a chat request with at least N messages after its
  static prefix hashes ``static prefix || 0x00 || turn_1 || 0x00 || ... turn_N``
  (the texts of the first N messages after it; their roles do not count), so
  a conversation keeps one key from its opening (N = 1: the first user
  message) on. A request with fewer keeps the plain key. The header wins
  over ``key_turns``.

Either puts each conversation's history on one replica; the system prompt
then lives on several (as with any split of a hot key).

Invariants: the key depends only on the request, never on time or process;
a returned key is printable ASCII, so nginx's crc32 of the header equals the
router's crc32 of the key.

Pure Python (hashlib, json): must not import Ray, HTTP frameworks or torch.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prefixserve.replica.contract.routing import SESSION_HEADER, STATIC_ROLES, canonical_json, content_text

PREFIX_HASH_HEADER = "X-Prefix-Hash"
KEY_HEX_DIGITS = 16


class InvalidPrefixHash(ValueError):
    """The ``X-Prefix-Hash`` header value is not usable as a routing key (HTTP 400)."""


@dataclass(frozen=True)
class PrefixKeyConfig:
    """How the routing key is derived.

    completion_prefix_chars: characters (or token ids) of a completions prompt
        that form its static prefix.
    max_header_len: longest accepted ``X-Prefix-Hash`` value.
    honor_header: use a client's ``X-Prefix-Hash`` header when present.
    session_header: key a chat request by its ``X-Session-Id`` too (multi-turn affinity).
    key_turns: key a chat request by its first ``key_turns`` messages after the
        static prefix too, once it has that many (multi-turn affinity; 0: off).
    """

    completion_prefix_chars: int = 256
    max_header_len: int = 128
    honor_header: bool = True
    session_header: bool = False
    key_turns: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.key_turns, bool) or not isinstance(self.key_turns, int) or self.key_turns < 0:
            raise ValueError(f"key_turns must be an integer >= 0, got {self.key_turns!r}")
        if self.completion_prefix_chars < 1:
            raise ValueError(f"completion_prefix_chars must be >= 1, got {self.completion_prefix_chars}")
        if self.max_header_len < 1:
            raise ValueError(f"max_header_len must be >= 1, got {self.max_header_len}")


DEFAULT_CONFIG = PrefixKeyConfig()


# Keys of payloads up to this size are memoized (at most _DIGEST_MEMO_ENTRIES of them): a tenant's
# system prompt comes back with every request, and SHA-256 through OpenSSL costs tens of
# microseconds on a router whose caches the other processes of its machine keep evicting (ten
# times its cost in a loop), where a dict lookup costs a few.
_DIGEST_MEMO_MAX_BYTES = 32 * 1024
_DIGEST_MEMO_ENTRIES = 256


def _digest(payload: bytes, cache_salt: str | None) -> str:
    if len(payload) <= _DIGEST_MEMO_MAX_BYTES:
        return _memo_digest(payload, cache_salt)
    return _sha256_key(payload, cache_salt)


def _sha256_key(payload: bytes, cache_salt: str | None) -> str:
    h = hashlib.sha256()
    if cache_salt is not None:
        h.update(cache_salt.encode("utf-8"))
        h.update(b"\x00")
    h.update(payload)
    return h.hexdigest()[:KEY_HEX_DIGITS]


_memo_digest = functools.lru_cache(maxsize=_DIGEST_MEMO_ENTRIES)(_sha256_key)


def static_payload(system_text: str, tools: list[Any] | None = None) -> bytes:
    """The static prefix's bytes: the system text, then 0x00 and the canonical JSON of ``tools`` if any."""
    payload = system_text.encode("utf-8")
    if tools:
        payload += b"\x00" + canonical_json(tools).encode("utf-8")
    return payload


def prefix_hash(system_text: str, cache_salt: str | None = None, tools: list[Any] | None = None) -> str:
    """The ``X-Prefix-Hash`` value for a static prefix: what a client sends.

    ``system_text`` is the static prefix (the system prompt; several leading
    system/developer messages joined by ``"\\n"``); ``tools`` the request's tool
    definitions (the ``tools`` array as sent), part of the static prefix when non-empty.
    """
    return _digest(static_payload(system_text, tools), cache_salt)


def request_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """A chat body's ``tools`` when it has some (a non-empty list); ValueError when it is not a list."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    return tools or None


def responses_chat_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """A Responses body's ``tools`` as its chat request carries them (function tools nested under
    ``function``, null fields dropped; other tools as sent); None when it has none."""
    tools = request_tools(body)
    if tools is None:
        return None
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
        if isinstance(t, Mapping) and t.get("type") == "function"
        else t
        for t in tools
    ]


def static_prefix(messages: Iterable[Mapping[str, Any]]) -> str | None:
    """The text of the leading run of system/developer messages, or None if there is none."""
    texts = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"each message must be an object, got {type(message).__name__}")
        if message.get("role") not in STATIC_ROLES:
            break
        texts.append(content_text(message.get("content")))
    text = "\n".join(texts)
    return text or None


def _prompt_payload(prompt: Any, n: int) -> bytes | None:
    """The static-prefix bytes of a completions prompt (its first prompt if batched)."""
    if isinstance(prompt, str):
        return prompt[:n].encode("utf-8") or None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, (str, list)):
            return _prompt_payload(first, n)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt[:n]):
            ids = prompt[:n]
            if any(t < 0 or t > 0xFFFFFFFF for t in ids):
                raise ValueError("token ids in prompt must be in [0, 2**32)")
            return struct.pack(f"<{len(ids)}I", *ids)
    if prompt is None or prompt == []:
        return None
    raise ValueError(
        "prompt must be a string, a list of strings, or a list of token ids "
        f"(or a list of such lists), got {type(prompt).__name__}"
    )


class LowerCaseHeaders(dict[str, str]):
    """A request's headers by lower-case name, the first of a repeated one (as an HTTP server gives
    them): looked up by the lower-case name alone, where any other Mapping is searched
    case-insensitively."""

    @classmethod
    def from_raw(cls, raw: Iterable[tuple[bytes, bytes]]) -> LowerCaseHeaders:
        """From an ASGI scope's ``headers`` (name and value bytes, latin-1)."""
        headers = cls()
        for name, value in raw:
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        return headers


def _header_value(headers: Mapping[str, str], header: str = PREFIX_HASH_HEADER) -> str | None:
    if isinstance(headers, LowerCaseHeaders):
        return headers.get(header.lower())
    value = headers.get(header)
    if value is None:
        value = headers.get(header.lower())
    if value is None:
        wanted = header.lower()
        for name, v in headers.items():
            if name.lower() == wanted:
                return v
    return value


def _static_count(messages: list[Any]) -> int:
    n = 0
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in STATIC_ROLES:
            break
        n += 1
    return n


def conversation_key(
    messages: list[Any],
    headers: Mapping[str, str] | None,
    config: PrefixKeyConfig,
    cache_salt: str | None,
    tools: list[Any] | None = None,
) -> str | None:
    """The multi-turn key of a chat request (module docstring), or None when the plain key applies.

    The static prefix's bytes (with ``tools``, see ``static_payload``) stand where the system text does.
    """
    static = static_payload(static_prefix(messages) or "", tools)
    if config.session_header and headers is not None:
        session = _header_value(headers, SESSION_HEADER)
        if session:
            return _digest(static + b"\x00session:" + session.encode("utf-8"), cache_salt)
    if config.key_turns > 0:
        turns = messages[_static_count(messages) :]
        if len(turns) >= config.key_turns:
            parts = [static] + [
                content_text(m.get("content")).encode("utf-8") if isinstance(m, Mapping) else b""
                for m in turns[: config.key_turns]
            ]
            return _digest(b"\x00".join(parts), cache_salt)
    return None


PROMPT_CACHE_KEY_TAG = b"\x00prompt_cache_key:"


def prompt_cache_key_hash(prompt_cache_key: str, cache_salt: str | None = None) -> str:
    """The routing key (and ``X-Prefix-Hash`` value) of a request carrying ``prompt_cache_key``."""
    return _digest(PROMPT_CACHE_KEY_TAG + prompt_cache_key.encode("utf-8"), cache_salt)


def validate_prefix_hash(value: str, config: PrefixKeyConfig = DEFAULT_CONFIG) -> str:
    """Return ``value`` if it is a usable ``X-Prefix-Hash``, else raise InvalidPrefixHash.

    Usable: 1..max_header_len characters, each visible ASCII (0x21-0x7e), so that
    nginx hashes the very bytes the router hashes.
    """
    if not isinstance(value, str) or not value:
        raise InvalidPrefixHash(f"{PREFIX_HASH_HEADER} must be a non-empty string")
    if len(value) > config.max_header_len:
        raise InvalidPrefixHash(
            f"{PREFIX_HASH_HEADER} is {len(value)} characters long; send at most "
            f"{config.max_header_len} (the key is normally 16 hex digits)"
        )
    if not all("\x21" <= c <= "\x7e" for c in value):
        raise InvalidPrefixHash(
            f"{PREFIX_HASH_HEADER} must contain only visible ASCII characters (no spaces or controls)"
        )
    return value


LORA_TAG = b"\x00lora:"


def adapter_key(key: str | None, adapter: str) -> str:
    """The routing key of a request for LoRA adapter ``adapter`` whose key without it is ``key``
    (None: no static prefix)."""
    return _digest(LORA_TAG + adapter.encode("utf-8") + b"\x00" + (key or "").encode("ascii"), None)


def routing_key(
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    config: PrefixKeyConfig = DEFAULT_CONFIG,
    adapter: str | None = None,
) -> str | None:
    """The routing key of one OpenAI request, or None when it has no static prefix.

    ``body`` is the parsed JSON of a chat-completions (``messages``) or
    completions (``prompt``) request; ``headers`` are the HTTP headers (any
    Mapping; the header name is matched case-insensitively); ``adapter``: the
    LoRA adapter its ``model`` names, when it names one. Raises
    InvalidPrefixHash for a malformed header and ValueError for a malformed body.
    """
    if headers is not None and config.honor_header:
        value = _header_value(headers)
        if value is not None:
            return validate_prefix_hash(value, config)
    key = _body_key(body, headers, config)
    return adapter_key(key, adapter) if adapter else key


def _body_key(body: Mapping[str, Any], headers: Mapping[str, str] | None, config: PrefixKeyConfig) -> str | None:
    """The key of the body alone (the module docstring's rule, before the header and the adapter)."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")

    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise ValueError(f"prompt_cache_key must be a string, got {type(cache_key).__name__}")
    if cache_key:
        return prompt_cache_key_hash(cache_key, salt)

    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list, got {type(messages).__name__}")
        tools = request_tools(body)
        if config.session_header or config.key_turns:
            key = conversation_key(messages, headers, config, salt, tools)
            if key is not None:
                return key
        text = static_prefix(messages)
        if text is None and tools is None:
            return None
        return prefix_hash(text or "", salt, tools)

    if "input" in body:
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError(f"instructions must be a string, got {type(instructions).__name__}")
        tools = responses_chat_tools(body)
        if not instructions and tools is None:
            return None
        return prefix_hash(instructions or "", salt, tools)

    if "prompt" in body:
        payload = _prompt_payload(body["prompt"], config.completion_prefix_chars)
        return None if payload is None else _digest(payload, salt)

    return None
