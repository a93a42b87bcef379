"""The wire protocol between a tensor-parallel engine's driver and its workers, and the group both join.

Each message to a worker is one flat int64 buffer whose first element is the opcode: a step
(``OP_STEP``, then ``StepInputs.pack``), swap copies (``OP_SWAP``, the counts, then the pairs), a
cache clear, shutdown. The driver (replica/executor/tensor_parallel.py) builds them, the worker
(replica/executor/tp_worker.py) parses them; neither imports the other.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# Message opcodes (the first int64 of every message to a worker).
OP_STEP, OP_SWAP, OP_CLEAR, OP_SHUTDOWN = 1, 2, 3, 4


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
    """Join this process to the engine's group (the process's default group)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: run one "
            "tensor-parallel engine per process (shut the other down first)"
        )
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def step_message(packed_inputs: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([OP_STEP], dtype=torch.int64), packed_inputs])


def swap_message(out_ops: list[tuple[int, int]], in_ops: list[tuple[int, int]]) -> torch.Tensor:
    flat = [OP_SWAP, len(out_ops), len(in_ops)] + [x for pair in out_ops + in_ops for x in pair]
    return torch.tensor(flat, dtype=torch.int64)


def parse_swap_message(message: torch.Tensor) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    n_out, n_in = int(message[1]), int(message[2])
    pairs = message[3:].view(-1, 2).tolist()
    if len(pairs) != n_out + n_in:
        raise ValueError(f"swap message holds {len(pairs)} pairs, its header says {n_out} + {n_in}")
    return [tuple(p) for p in pairs[:n_out]], [tuple(p) for p in pairs[n_out:]]  # type: ignore[misc]
