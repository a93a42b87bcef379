"""Grammar token bitmasks applied to logits in place, on CPUs (the C kernel ``kernels/cpu/token_bitmask.c``).

The bitmask layout is xgrammar's (and vLLM's): int32 words, 32 tokens each, bit ``j`` of
word ``w`` standing for token ``32 * w + j``; a 0 bit sets that token's logit to -inf.
:func:`apply_token_bitmask` equals ``xgrammar.apply_token_bitmask_inplace`` on the same
arguments; it writes only the listed rows, skips words that allow all 32 tokens and
stores whole vectors of -inf for words that allow none (most words, under a grammar).

This module knows nothing of grammars or requests: it is the kernel and its checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixserve.kernels.cpu.library import available, load


def supports(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors (float32 logits and int32 bitmask rows on a CPU,
    each row dense) and the kernels build here."""
    return (
        logits.device.type == "cpu"
        and bitmask.device.type == "cpu"
        and logits.dtype == torch.float32
        and bitmask.dtype == torch.int32
        and logits.dim() == 2
        and bitmask.dim() == 2
        and logits.stride(1) == 1
        and bitmask.stride(1) == 1
        and available()[0]
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: Sequence[int]) -> None:
    """Set ``logits[r, t]`` to -inf for every row ``r`` in ``rows`` and token ``t < vocab_size``
    whose bit in ``bitmask[r]`` is 0, in place.

    ``logits`` [N, >= vocab_size] float32 and ``bitmask`` [M, >= ceil(vocab_size / 32)] int32,
    both on a CPU with dense rows (:func:`supports`); every row index must be below N and M.
    Raises ValueError when they do not fit, CPUKernelUnavailable without a C compiler.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {logits.dim()}-D and {bitmask.dim()}-D")
    if logits.dtype != torch.float32 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"the C bitmask kernel takes float32 logits and an int32 bitmask, got {logits.dtype} and {bitmask.dtype}"
        )
    if logits.device.type != "cpu" or bitmask.device.type != "cpu":
        raise ValueError(f"the C bitmask kernel runs on a CPU, got {logits.device} and {bitmask.device}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be dense")
    words = (vocab_size + 31) // 32
    if not 0 <= vocab_size <= logits.shape[1] or bitmask.shape[1] < words:
        raise ValueError(
            f"vocab_size {vocab_size} does not fit logits of width {logits.shape[1]} "
            f"and a bitmask of {bitmask.shape[1]} words"
        )
    if not rows:
        return
    index = torch.tensor(list(rows), dtype=torch.int64)
    if int(index.min()) < 0 or int(index.max()) >= min(logits.shape[0], bitmask.shape[0]):
        raise ValueError(f"row indices must be in [0, {min(logits.shape[0], bitmask.shape[0])}), got {list(rows)}")
    status = load().apply_token_bitmask_f32(
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.stride(0),
        index.data_ptr(),
        len(index),
        vocab_size,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError("the C bitmask kernel refused its row indices")
