"""prefixserve: prefix-aware LLM serving.

The code lives in the top-level folders the design names (``router/``, ``replica/``,
``kernels/``, ``loadtest/``, ``common/``); the build configuration (setup.py's
package-dir mapping) installs each as ``prefixserve.router``, ``prefixserve.replica``,
``prefixserve.kernels``, ``prefixserve.loadtest`` and ``prefixserve.common``. ``kernels/``
has no ``__init__.py``: it is only a portion of ``prefixserve.kernels``, so from the
checkout's root it never stands in for another distribution's top-level ``kernels``
(Hugging Face's, which transformers imports). See docs/design.md.

The offline API is re-exported here, imported on first use so that
``import prefixserve.router.routing_key`` does not pay for torch::

    from prefixserve import LLM, SamplingParams, EngineConfig, LoRARequest
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "prefixserve.replica.entrypoints.llm",
    "SamplingParams": "prefixserve.replica.sampling_params",
    "EngineConfig": "prefixserve.replica.config",
    "RequestOutput": "prefixserve.replica.engine.outputs",
    "CompletionOutput": "prefixserve.replica.engine.outputs",
    "LoRARequest": "prefixserve.replica.lora.request",
}

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LoRARequest", "RequestOutput", "SamplingParams"]


if TYPE_CHECKING:
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.outputs import CompletionOutput, RequestOutput
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.lora.request import LoRARequest
    from prefixserve.replica.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
