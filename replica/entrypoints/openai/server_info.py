"""What a replica says about itself to routers that probe it: vLLM's ``/version`` and SGLang's info endpoints.

Job: the bodies of ``GET /version`` (vLLM: ``{"version": ...}``) and of SGLang's
``/server_info`` / ``/get_server_info`` and ``/model_info`` / ``/get_model_info``
(sglang/srt/entrypoints/http_server.py), which SGLang's model gateway (smg) and
vllm-router read when they register a worker: ``dp_size`` (this replica is one
data-parallel rank), ``tokenizer_path`` / ``model_path``, ``page_size`` (the KV block
size a cache-aware router must match), ``internal_states`` and ``version``.

Under SGLang's field names, filled from this engine's configuration; no secret (the
API keys) ever appears. Pure data: no HTTP framework, Ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any


def package_version() -> str:
    """prefixserve's installed version (``0.0.0+unknown`` when run from sources without metadata)."""
    try:
        return metadata.version("prefixserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@dataclass(frozen=True)
class ReplicaInfo:
    """What the info endpoints report of one replica's engine."""

    model_name: str
    model_path: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    architectures: tuple[str, ...]
    version: str

    def server_info(self) -> dict[str, Any]:
        """SGLang's ``/get_server_info``: its server arguments' names, the scheduler's state, the version."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_name,
            "context_length": self.max_model_len,
            "page_size": self.block_size,
            "tp_size": self.tensor_parallel_size,
            "dp_size": 1,
            "max_running_requests": self.max_num_seqs,
            "chunked_prefill_size": self.max_num_batched_tokens,
            "disable_radix_cache": not self.enable_prefix_caching,
            "is_embedding": False,
            "internal_states": [
                {"max_total_num_tokens": self.num_kv_blocks * self.block_size, "page_size": self.block_size}
            ],
            "version": self.version,
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info``."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": list(self.architectures) or None,
        }
