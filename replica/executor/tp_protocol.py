"""The wire protocol between a tensor-parallel engine's driver and its workers, and the group both join.

Each message to a worker is one flat int64 buffer whose first element is the opcode: a step
(``OP_STEP``, then ``StepInputs.pack``), swap copies (``OP_SWAP``, the counts, then the pairs), a
cache clear, shutdown. The disk tier's messages (replica/executor/tp_disk.py) carry block
hashes (``hashed_message``): a lookup's reads (``OP_DISK_LOAD``), the step's tier copies before
the swap (``OP_TIER_BEFORE``: host slots to store, host slots to fill) and after the forward
(``OP_TIER_AFTER``: device blocks to store). Opening the tier (``OP_DISK_OPEN``) and a drain's
save (``OP_DISK_SAVE``) are followed by one pickled object; the disk messages that want an
answer (``DISK_REPLIES``) get one pickled reply from each worker. A step with LoRA adapters
is preceded by ``OP_LORA`` and one pickled ``(writes, token_slots)``: the adapters to write
into slots (each rank keeps its shard) and each row's slot, for the next ``OP_STEP``. The driver
(replica/executor/tensor_parallel.py) builds them, the worker (replica/executor/tp_worker.py)
parses them; neither imports the other.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# Message opcodes (the first int64 of every message to a worker).
OP_STEP, OP_SWAP, OP_CLEAR, OP_SHUTDOWN = 1, 2, 3, 4
OP_DISK_KEY, OP_DISK_OPEN, OP_DISK_LOAD, OP_TIER_BEFORE, OP_TIER_AFTER, OP_DISK_FLUSH, OP_DISK_SAVE = range(5, 12)
OP_LORA = 12
# The disk messages each worker answers (one pickled reply each).
DISK_REPLIES = frozenset({OP_DISK_KEY, OP_DISK_OPEN, OP_DISK_LOAD, OP_DISK_FLUSH, OP_DISK_SAVE})


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


def hashed_message(op: int, groups: list[list[tuple[int, bytes]]]) -> torch.Tensor:
    """``op`` with lists of (int, block hash) pairs: ``[op, hash length, number of lists, each
    list's length, the ints, the hashes' bytes (zero-padded to whole int64s)]``."""
    pairs = [p for g in groups for p in g]
    length = len(pairs[0][1]) if pairs else 0
    if any(len(h) != length for _, h in pairs):
        raise ValueError("the block hashes of one message must have one length")
    raw = b"".join(h for _, h in pairs)
    raw += bytes(-len(raw) % 8)
    head = [op, length, len(groups), *(len(g) for g in groups), *(i for i, _ in pairs)]
    tail = torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.tensor(head, dtype=torch.int64), tail])


def parse_hashed_message(message: torch.Tensor) -> list[list[tuple[int, bytes]]]:
    """The lists of ``hashed_message``."""
    length, k = int(message[1]), int(message[2])
    sizes = message[3 : 3 + k].tolist()
    n = sum(sizes)
    ints = message[3 + k : 3 + k + n].tolist()
    raw = message[3 + k + n :].numpy().tobytes()
    if len(raw) < n * length:
        raise ValueError(f"a disk message holds {len(raw)} hash bytes, its header says {n} x {length}")
    groups, at = [], 0
    for size in sizes:
        groups.append([(ints[at + j], raw[(at + j) * length : (at + j + 1) * length]) for j in range(size)])
        at += size
    return groups
