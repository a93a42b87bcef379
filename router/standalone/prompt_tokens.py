"""A request's prompt as token ids, the way a replica tokenizes it, without transformers or torch.

Job: the KV-event index (router/kv_index/) is keyed by token-block hashes, so the
router must see the token ids the replica will prefill: a chat request's messages
rendered by the model's chat template (generation prompt added) and tokenized
without special tokens (the template writes them), a completions text prompt
tokenized with them, a token-id prompt as it is. Also how many leading tokens are
the static prefix (the leading system/developer messages rendered alone, their
common run with the whole rendering: replica/engine/input_processor.py's rule),
so the router knows which blocks a whole key shares.

Loads a Hugging Face tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``
and the template in it or in ``chat_template.jinja``) with the ``tokenizers`` library
and renders the template with jinja2 in the sandboxed environment transformers uses:
the router must not import transformers, which loads torch.

A request the router cannot tokenize (an unknown template feature, tool calls,
images) gives None: the router then routes it on its own record alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prefixserve.replica.contract.routing import STATIC_ROLES

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's token ids and how many leading ones are its static prefix."""

    ids: list[int]
    static_tokens: int = 0


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])  # an AddedToken written out as a dict
    return None


def _raise(message: str) -> None:
    raise ValueError(message)


class PromptTokenizer:
    """A tokenizer folder's ``encode`` and chat template (the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root} has no tokenizer.json (a Hugging Face tokenizer folder is needed)")
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        jinja_path = root / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self.special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template) if isinstance(template, str) else None

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        if self.template is None:
            raise ValueError("the tokenizer has no chat template")
        return str(
            self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special)
        )

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> PromptTokens:
        """A conversation's token ids (generation prompt added) and its static prefix's length."""
        ids = self.encode(self.render(messages, True), special=False)
        n = 0
        while n < len(messages) and messages[n].get("role") in STATIC_ROLES:
            n += 1
        if n == 0:
            return PromptTokens(ids, 0)
        try:
            static = self.encode(self.render(messages[:n], False), special=False)
        except Exception:  # noqa: BLE001 - a template that refuses the system part alone: no static prefix
            return PromptTokens(ids, 0)
        common = 0
        for a, b in zip(static, ids, strict=False):
            if a != b:
                break
            common += 1
        return PromptTokens(ids, common)

    def of_body(self, body: Any) -> PromptTokens | None:
        """The prompt tokens of an OpenAI request body; None when the router cannot tell them."""
        if not isinstance(body, Mapping):
            return None
        try:
            messages = body.get("messages")
            if messages is not None:
                if body.get("tools") or not isinstance(messages, list) or not messages:
                    return None  # a tool template the replica may substitute: not guessed here
                if not all(isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in messages):
                    return None
                return self.chat(messages)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return PromptTokens(self.encode(prompt, special=True))
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return PromptTokens([int(t) for t in prompt])
        except Exception:  # noqa: BLE001 - a template error is the request's, not the router's
            return None
        return None
