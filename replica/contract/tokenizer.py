"""A model's tokenizer, for tools outside the engine that count tokens the way it does (the prompt-log audit).

Loads ``transformers`` and the checkpoint's tokenizer files on first use only, so importing the contract
stays cheap.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Any:
    """The tokenizer (only) of ``model``: ``smollm2``, a checkpoint directory or a .gguf file (cached)."""
    from prefixserve.replica.model.loader import load_tokenizer as load
    from prefixserve.replica.model.loader import resolve

    return load(resolve(model))
