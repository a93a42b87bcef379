"""prefixserve: prefix-aware LLM serving.

The code lives in the four top-level folders the design names (``router/``,
``replica/``, ``kernels/``, ``loadtest/``); this package links each of them, so
they import as ``prefixserve.router``, ``prefixserve.replica``,
``prefixserve.kernels`` and ``prefixserve.loadtest`` and nothing we install
shadows another distribution (Hugging Face's ``kernels`` in particular). See
docs/design.md.

The offline API is re-exported here, imported on first use so that
``import prefixserve.router.contracts.prefix`` does not pay for torch::

    from prefixserve import LLM, SamplingParams, EngineConfig
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "prefixserve.replica.llm",
    "SamplingParams": "prefixserve.replica.sampling",
    "EngineConfig": "prefixserve.replica.config",
    "RequestOutput": "prefixserve.replica.outputs",
    "CompletionOutput": "prefixserve.replica.outputs",
}

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.llm import LLM
    from prefixserve.replica.outputs import CompletionOutput, RequestOutput
    from prefixserve.replica.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
