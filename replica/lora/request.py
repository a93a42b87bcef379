"""LoRARequest: how a caller names the adapter a request runs with (vLLM's class).

Pure Python (no torch): the offline API, the input processor and the scheduler import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and path, in vLLM's argument order: ``LoRARequest(name, int_id, path)``.

    ``lora_name`` is the adapter's identity: it enters the block hashes (Contract 2's extra
    keys), so two adapters never share KV blocks; the engine holds one adapter per name.
    ``lora_path`` is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (vLLM's rule), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a PEFT adapter directory, got {self.lora_path!r}")

    # vLLM's short names.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
