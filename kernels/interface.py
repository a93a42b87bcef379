"""The interface every implementation of a decoder layer's fused element-wise operations fills.

The operations' semantics are kernels/layer_ops.py's docstring; the implementations (torch and C in
kernels/layer_ops.py, Triton in kernels/triton_layer_ops.py) import this module, the dispatcher
(``layer_ops.select_layer_ops``) imports them: no implementation imports the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LayerOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    prepare_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    rotary: Callable[[torch.Tensor, Any], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # Rotary + KV-cache write in one kernel; only for the standard cache layout
    # [num_blocks, block_size, num_kv_heads, head_dim] (torch and Triton backends).
    rotary_and_write_kv: Callable[..., torch.Tensor] | None = None
