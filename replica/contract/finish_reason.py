"""Why a sequence stopped: the finish reason every stream delta and finished output carries.

Below the engine and the front ends alike (as vLLM keeps its FinishReason beside the engine
core's request and output types), so the contract's stream items and the engine's request
state name it without importing the engine.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence stopped (OpenAI's values; a StrEnum compares and serializes as the string).

    A request that fails is not "finished": its stream raises an exception instead
    (front ends map it to an HTTP error), so there is no "error" reason here.
    """

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client left or aborted
