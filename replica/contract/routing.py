"""What Contract 1 (the routing key, router/routing_key.py) reads of a request, and the header naming its replica.

``SESSION_HEADER`` and ``STATIC_ROLES`` say which requests are conversation turns and which chat messages
form the static prefix; ``canonical_json`` is the form tools are hashed in (and the engine's memo key for
them); ``content_text`` the text a message's content contributes (Contract 1's static prefix, and the
history blocks of replica/contract/prompt_blocks.py); ``REPLICA_HEADER`` names the engine replica that
served a request. Constants and three functions: imports nothing of ours, so the engine's request
bookkeeping can read them without the contract's types.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# The session header of multi-turn clients: their requests are conversation turns, and
# router/routing_key.py keys their affinity by it.
SESSION_HEADER = "X-Session-Id"
# Contract 1's static prefix (router/routing_key.py): the leading run of chat messages with these roles.
STATIC_ROLES = frozenset({"system", "developer"})


# Names the engine replica that served a request (the standalone server: itself).
REPLICA_HEADER = "X-Prefixserve-Replica"


def ring_name(app_name: str, deployment: str, rank: int) -> str:
    """The ring name of the Serve replica holding ``rank`` in ``app_name``'s ``deployment``.

    Serve gives a replacement the rank of the replica it replaces (the smallest free one),
    so a replacement, or the same app deployed again, takes its predecessor's ring points.
    The replica reports the rank in its routing stats; the router names it by this.
    """
    return f"{app_name}#{deployment}#rank-{rank}"


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, no spaces, UTF-8 characters as themselves.

    The form Contract 1 hashes tools in (router/routing_key.py), and the engine's memo key for them.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_text(content: Any) -> str:
    """Text of an OpenAI message content: a string or a list of text parts joined by ``"\\n"``.

    Raises ValueError for any other part (the API refuses them too).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            # The same parts replica/entrypoints/openai/protocol.py's ChatMessage accepts: a body it refuses has no key.
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
