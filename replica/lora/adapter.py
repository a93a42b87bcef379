"""A PEFT LoRA adapter read from its directory and checked against the base model.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``base_model_name_or_path``...) and ``adapter_model.safetensors`` with, per adapted
projection, ``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``). The adapted projection computes
``x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``); the scaling is folded into B once here.

Everything that could make the adapter wrong on this model is refused with a ValueError
naming it, before anything is kept: a rank above ``max_lora_rank``, a module the model
lacks or the engine does not adapt, a layer past the model's, a tensor whose shape is not
the projection's, missing or unreadable files, PEFT features the engine does not apply
(DoRA, trained biases, modules_to_save, per-module rank or alpha patterns). The base
model's name is compared loosely (the last path component): a mismatch is only logged,
since a local copy of a model rarely carries the hub's name; the shapes are the real check.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixserve.replica.lora.request import LoRARequest

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: PEFT's module names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(frozen=True)
class ModuleShapes:
    """``(in_features, out_features)`` of each adaptable projection of the base model, and its depth."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, cfg: Any) -> ModuleShapes:
        """From a ``ModelConfig`` (replica/model/llama.py)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, m = cfg.hidden_size, cfg.intermediate_size
        return cls(
            cfg.num_layers,
            {
                "q_proj": (h, q),
                "k_proj": (h, kv),
                "v_proj": (h, kv),
                "o_proj": (q, h),
                "gate_proj": (h, m),
                "up_proj": (h, m),
                "down_proj": (m, h),
            },
        )


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the host: ``weights[(layer, module)] = (A [r, in], B [out, r])``,
    B already multiplied by the scaling; float32."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def _bad(request: LoRARequest, problem: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {problem}")


def _read_config(request: LoRARequest) -> dict[str, Any]:
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise _bad(request, "no such directory")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _bad(request, f"missing {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(request, f"unreadable {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise _bad(request, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(request: LoRARequest, config: dict[str, Any], max_rank: int, model_name: str) -> tuple[int, float]:
    """``(rank, scaling)`` after refusing what the engine cannot apply as the adapter means it."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _bad(request, f"peft_type {peft_type!r} is not LORA")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _bad(request, f"adapter_config r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise _bad(request, f"rank {rank} exceeds max_lora_rank={max_rank}: raise max_lora_rank")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _bad(request, f"lora_alpha must be a number, got {alpha!r}")
    for key, what in (
        ("use_dora", "DoRA"),
        ("fan_in_fan_out", "fan_in_fan_out weights"),
        ("modules_to_save", "modules_to_save (fully trained modules)"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
    ):
        if config.get(key):
            raise _bad(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _bad(request, f"trained biases (bias={config.get('bias')!r}) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise _bad(request, f"target modules {unknown} are not projections of this model {list(TARGET_MODULES)}")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and _short(base) != _short(model_name):
        log.warning(
            "LoRA adapter %r was trained on %r, the engine serves %r: its tensor shapes are checked",
            request.lora_name,
            base,
            model_name,
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _short(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise _bad(request, f"missing {WEIGHTS_FILE} (pickled adapter_model.bin is not read)")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _bad(request, f"unreadable {WEIGHTS_FILE}: {exc}") from None


def load_adapter(request: LoRARequest, shapes: ModuleShapes, *, max_rank: int, model_name: str) -> LoRAAdapter:
    """Read and check ``request``'s directory against the base model; ValueError on any fault."""
    rank, scaling = _check_config(request, _read_config(request), max_rank, model_name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(request).items():
        match = _NAME.match(name)
        if match is None:
            raise _bad(request, f"tensor {name!r} is not a LoRA A/B weight of {list(TARGET_MODULES)}")
        layer, module, which = int(match[1]), match[3], match[4]
        if layer >= shapes.num_layers:
            raise _bad(request, f"tensor {name!r} adapts layer {layer}; the model has {shapes.num_layers}")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise _bad(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise _bad(request, f"{where} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes.shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise _bad(
                request,
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model's projection "
                f"(expected {(rank, in_features)} / {(out_features, rank)}): a different base model?",
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _bad(request, f"{where}: LoRA weights must be floating point")
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(request.lora_name, rank, weights)
