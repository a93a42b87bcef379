"""prefixserve: prefix-aware LLM serving.

The code lives in the four top-level folders the design names (``router/``,
``replica/``, ``kernels/``, ``loadtest/``); this package links each of them, so
they import as ``prefixserve.router``, ``prefixserve.replica``,
``prefixserve.kernels`` and ``prefixserve.loadtest`` and nothing we install
shadows another distribution (Hugging Face's ``kernels`` in particular). See
docs/design.md.

Run from a checkout, the repository root itself can be on ``sys.path`` (``python -m``
from the root puts it first, and Ray gives every worker its driver's working
directory), and there the top-level ``kernels/`` would stand in for Hugging Face's,
which transformers imports. Importing this package takes the checkout's root off
``sys.path``; everything of ours imports through ``prefixserve.*`` and needs none of it.

The offline API is re-exported here, imported on first use so that
``import prefixserve.router.contracts.prefix`` does not pay for torch::

    from prefixserve import LLM, SamplingParams, EngineConfig
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "prefixserve.replica.entrypoints.llm",
    "SamplingParams": "prefixserve.replica.sampling_params",
    "EngineConfig": "prefixserve.replica.config",
    "RequestOutput": "prefixserve.replica.engine.outputs",
    "CompletionOutput": "prefixserve.replica.engine.outputs",
}

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "RequestOutput", "SamplingParams"]


def _checkout_root() -> str | None:
    """The repository root when this package runs from a checkout (its folders linked here), else None."""
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    ours = os.path.join(package, "kernels")
    # An installed wheel has a real kernels/ inside the package; whatever sits beside it in
    # site-packages (Hugging Face's kernels, say) is another distribution's and stays.
    if os.path.islink(ours) and os.path.realpath(ours) == os.path.realpath(os.path.join(root, "kernels")):
        return os.path.realpath(root)
    return None


def _take_checkout_root_off_sys_path() -> None:
    root = _checkout_root()
    if root is not None:
        cwd = os.getcwd()  # the empty entry
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or cwd) != root]


_take_checkout_root_off_sys_path()

if TYPE_CHECKING:
    from prefixserve.replica.config import EngineConfig
    from prefixserve.replica.engine.outputs import CompletionOutput, RequestOutput
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
