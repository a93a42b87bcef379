"""What a request may use before it ran: the tokens flow control reserves against a quota and costs
it at in the fair queue, settled to the usage once the request ends.

A prompt's characters over CHARS_PER_TOKEN (token ids counted as they are), plus the completion
tokens it may generate for all its ``n`` choices. :func:`estimated_tokens` reads the engine
request the Ray ingress builds; :func:`estimated_body_tokens` the OpenAI body the standalone
router forwards unparsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixserve.replica.contract.request import EngineRequest

# Characters per token when a prompt has not been tokenized yet.
CHARS_PER_TOKEN = 4
# max_tokens of a body that asks none: a guess for the reserve (the settle corrects it).
DEFAULT_BODY_MAX_TOKENS = 256


def estimated_tokens(request: EngineRequest) -> int:
    """An engine request's estimate (see the module docstring)."""
    if isinstance(request.prompt, list):
        prompt = len(request.prompt)
    elif request.prompt is not None:
        prompt = len(request.prompt) // CHARS_PER_TOKEN
    else:
        prompt = sum(_text_chars(m.get("content")) for m in request.messages or []) // CHARS_PER_TOKEN
    completion = request.max_tokens_default or request.sampling.max_tokens
    return prompt + completion * request.sampling.n


def estimated_body_tokens(body: Any) -> int:
    """An OpenAI chat or completions body's estimate; whatever it lacks or gets wrong counts as nothing
    (the replica refuses such a body, and its usage settles the reserve)."""
    if not isinstance(body, Mapping):
        return 1
    prompt_field = body.get("prompt")
    if isinstance(prompt_field, list) and all(isinstance(t, int) for t in prompt_field):
        prompt = len(prompt_field)
    elif prompt_field is not None:
        prompt = _text_chars(prompt_field) // CHARS_PER_TOKEN
    else:
        messages = body.get("messages")
        items = messages if isinstance(messages, list) else []
        prompt = sum(_text_chars(m.get("content")) for m in items if isinstance(m, Mapping)) // CHARS_PER_TOKEN
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    completion = asked if _count(asked) else DEFAULT_BODY_MAX_TOKENS
    n = body.get("n", 1)
    return prompt + completion * (n if _count(n) else 1)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _text_chars(content: Any) -> int:
    """Characters of a message content or prompt: a string, or a list of strings or text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(part.get("text") if isinstance(part, Mapping) else part) for part in content)
    return 0
