"""A tensor-parallel worker process (ranks 1..N-1 of an engine; see replica/executor/tensor_parallel.py).

Start-up, in lockstep with the driver: join the engine's ``torch.distributed`` group,
build this rank's :class:`ModelShard` (weights read from the prepared checkpoint, only
this rank's rows kept), report the KV blocks this rank could hold, allocate the count
the driver settles on (the minimum over ranks), report this rank's memory. The
hand-shake goes through the pipe, not a collective, so a slow weight load on one rank
does not run into the collective timeout on another.

Then serve messages until told to stop: each is one flat int64 buffer whose first
element is the opcode (a step's inputs, swap copies, a cache clear, the disk tier's reads
and copies of this rank's shard files, a step's LoRA adapters, shutdown). Any
failure ends the process with a non-zero code: its peers' collectives then fail and the
driver declares the engine dead (there is no partial recovery from ranks out of step).
The worker also exits when the driver goes away (pipe EOF, or a new parent pid) and
ignores SIGINT: Ctrl-C reaches the whole process group, and the driver stops its workers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

PARENT_POLL_S = 0.5


def worker_main(spec, rank: int, size: int, conn: Connection, parent_pid: int) -> None:
    """Process entry point (``spec``: tensor_parallel.WorkerSpec)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_process_name(f"prefixserve-tp{rank}")
    _exit_with_parent(parent_pid)
    try:
        shard = _start(spec, rank, size, conn)
    except BaseException as exc:  # reported to the driver, which raises it
        traceback.print_exc()
        try:
            conn.send(RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    try:
        _serve(shard, conn)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _start(spec, rank: int, size: int, conn: Connection):
    import torch.distributed as dist

    from prefixserve.replica.executor.tp_protocol import init_distributed
    from prefixserve.replica.model import loader
    from prefixserve.replica.model.layers import TPGroup
    from prefixserve.replica.worker.model_shard import ModelShard, resolve_device, resolve_dtype

    config = spec.config
    device = resolve_device(config.device, rank)
    store = dist.TCPStore(
        "127.0.0.1", spec.store_port, world_size=size, is_master=False, timeout=_timedelta(config.distributed_timeout_s)
    )
    init_distributed(store, rank, size, device, config.distributed_timeout_s)
    dtype = resolve_dtype(config.dtype, device, spec.checkpoint_dtype)
    shard = ModelShard(
        config,
        spec.model_cfg,
        loader.iter_weights(spec.checkpoint, mapped=True),
        max_model_len=spec.max_model_len,
        tp=TPGroup(rank, size),
        device=device,
        dtype=dtype,
        num_threads=spec.cpu_threads[rank],
    )
    conn.send((shard.kv_block_capacity(), shard.host_block_capacity()))
    num_blocks, num_host_blocks = conn.recv()
    shard.allocate_kv_cache(num_blocks, num_host_blocks)
    conn.send(shard.memory())
    return shard


def _serve(shard, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from prefixserve.kernels.reference_lora import LoRAMapping
    from prefixserve.replica.executor.tp_protocol import (
        DISK_REPLIES,
        OP_CLEAR,
        OP_LORA,
        OP_SHUTDOWN,
        OP_STEP,
        OP_SWAP,
        OP_TIER_AFTER,
        OP_TIER_BEFORE,
        parse_swap_message,
    )
    from prefixserve.replica.lora.manager import LoRAStep
    from prefixserve.replica.worker.step_inputs import unpack_step_inputs

    disk = None  # this rank's side of the disk tier (ShardTierIO), once rank 0 opens it
    lora = None  # the next step's adapters (OP_LORA), when it has any
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the driver is gone
            os._exit(0)
        message = torch.frombuffer(bytearray(data), dtype=torch.int64)
        op = int(message[0])
        if op == OP_STEP:
            shard.run(unpack_step_inputs(message[1:]), lora=lora)
            lora = None
        elif op == OP_LORA:
            writes, token_slots = conn.recv()
            mapping = LoRAMapping.from_token_slots(token_slots) if token_slots is not None else None
            lora = LoRAStep(writes, mapping)
        elif op == OP_SWAP:
            shard.swap(*parse_swap_message(message))
        elif op == OP_CLEAR:
            shard.clear_kv_cache()
        elif op in DISK_REPLIES or op in (OP_TIER_BEFORE, OP_TIER_AFTER):
            disk = _disk_message(shard, conn, op, message, disk)
        elif op == OP_SHUTDOWN:
            if disk is not None:
                disk.files.close()  # the queued writes finish first
            dist.destroy_process_group()
            return
        else:
            raise ValueError(f"unknown message opcode {op}")


def _disk_message(shard, conn: Connection, op: int, message, disk):
    """Apply one disk-tier message (replica/executor/tp_protocol.py) to this rank's shard files;
    the ``ShardTierIO`` afterwards (``OP_DISK_OPEN`` creates it)."""
    from prefixserve.replica.executor import tp_protocol as p
    from prefixserve.replica.kv.disk_tier import BlockFiles
    from prefixserve.replica.worker.tier_io import ShardTierIO, disk_key

    if op == p.OP_DISK_KEY:
        conn.send(disk_key(shard))
        return disk
    if op == p.OP_DISK_OPEN:
        path, key, queue_blocks = conn.recv()
        try:
            disk = ShardTierIO(shard, BlockFiles(path, key, queue_blocks))
        except ValueError as exc:
            conn.send(exc)
            return None
        conn.send(None)
        return disk
    if disk is None:
        raise RuntimeError(f"disk message {op} before the disk tier was opened")
    if op == p.OP_DISK_LOAD:
        (wanted,) = p.parse_hashed_message(message)
        statuses = disk.load([h for _, h in wanted])
        conn.send((statuses, disk.take_fault()))
    elif op == p.OP_TIER_BEFORE:
        stores, fills = p.parse_hashed_message(message)
        disk.before_swap(stores, fills)
    elif op == p.OP_TIER_AFTER:
        (stores,) = p.parse_hashed_message(message)
        disk.after_forward(stores)
    elif op == p.OP_DISK_FLUSH:
        ok = disk.files.flush(int(message[1]) / 1000)
        conn.send((ok, disk.take_fault()))
    elif op == p.OP_DISK_SAVE:
        written = disk.save(conn.recv())
        conn.send((written, disk.take_fault()))
    return disk


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the driver process is gone, even when blocked in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _set_process_name(name: str) -> None:
    """The name ps/top show (Linux prctl PR_SET_NAME; 15 bytes), so workers are findable."""
    try:
        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
