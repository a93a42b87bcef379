"""The tensor side of the KV tiers: block bytes in and out of one rank's caches.

The KV manager (pure Python) decides what moves between the device pool, the host
slots and the disk (``replica/kv/tiers.py``); the host <-> device copies travel with
the swap copies (``ModelShard.swap``, every rank). This module does the rest, on each
rank for its own shard: it reads blocks (device or host slots) as payload bytes for the
disk tier, writes payloads read from disk into host slots, and names what makes a
payload valid (``disk_key``: the model's fingerprint, weights and KV config, dtype, block size,
layout, rank).
:class:`TierIO` is rank 0's (the payloads the KV manager read); :class:`ShardTierIO` a
worker rank's under tensor parallelism (its own files, read when rank 0's lookup asks,
held until the step's fills).

A block's payload is its K rows then its V rows over every layer, as raw bytes
(fp8 caches: the fp8 bytes; the per-layer scales are part of the fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field

import torch

from prefixserve.replica.kv.disk_tier import BlockFiles, DiskKey, DiskTier
from prefixserve.replica.kv.tiers import TierOps
from prefixserve.replica.worker.model_shard import ModelShard

# Bytes sampled from each weight tensor for the fingerprint (evenly spaced elements).
FINGERPRINT_SAMPLE_ELEMENTS = 4096


def kv_config(shard: ModelShard) -> str:
    """Everything besides the weights that a block's K and V values depend on, as canonical JSON:
    the model's config (RoPE theta, type and scaling, max positions, norm epsilon, head layout,
    biases, windows), the compute and KV dtypes, the block size, the tensor-parallel rank and
    size with this rank's KV heads, and, for a scaled RoPE, the context length (dynamic NTK
    scales its frequencies by it). Two replicas of one weight file and another config must
    never read each other's blocks."""
    model = dataclasses.asdict(shard.model_cfg)
    model.pop("eos_token_ids", None)  # when generation stops, not what a block holds
    scaled = shard.model_cfg.rope.rope_type != "default"
    return json.dumps(
        {
            "model": model,
            "dtype": str(shard.dtype),
            "kv_dtype": str(shard.kv_cache_dtype),
            "block_size": shard.block_size,
            "tp": [shard.tp.rank, shard.tp.size, shard.num_kv_heads],
            "max_model_len": shard.max_model_len if scaled else None,
        },
        sort_keys=True,
        default=str,
    )


def model_fingerprint(shard: ModelShard) -> str:
    """A digest of the shard's weights (names, shapes, dtypes, a strided sample of every
    tensor's values), its fp8 KV scales and its KV config (``kv_config``): another checkpoint,
    even under the same path, or the same weights under another config, gets another
    fingerprint."""
    h = hashlib.sha256()
    h.update(kv_config(shard).encode())
    for name, p in shard.model.state_dict().items():
        t = p.detach().reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        if t.numel():
            step = max(1, t.numel() // FINGERPRINT_SAMPLE_ELEMENTS)
            sample = t[::step].to("cpu", torch.float32).contiguous()
            h.update(sample.numpy().tobytes())
    for layer in shard.model.layers:
        attn = layer.self_attn
        h.update(f"{getattr(attn, 'k_scale', 1.0)!r}:{getattr(attn, 'v_scale', 1.0)!r}".encode())
    return h.hexdigest()


def combine_fingerprints(fingerprints: list[str]) -> str:
    """The model fingerprint every rank's ``DiskKey`` carries: one rank's own, or a digest of all
    ranks' shard fingerprints in rank order (the same on every rank, and for every replica of
    the model at that size)."""
    if len(fingerprints) == 1:
        return fingerprints[0]
    return hashlib.sha256("|".join(fingerprints).encode()).hexdigest()


def _block_views(shard: ModelShard, host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (shard.k_host, shard.v_host) if host else (shard.k_cache, shard.v_cache)
    return _bytes_view(k), _bytes_view(v)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def block_nbytes(shard: ModelShard) -> int:
    """Bytes of one block's payload on this rank (``ModelShard.kv_bytes_per_block``)."""
    return shard.kv_bytes_per_block


def disk_key(shard: ModelShard) -> DiskKey:
    """The disk tier's key for this rank's blocks."""
    k, v = shard.k_cache, shard.v_cache
    layout = f"{shard.backend.name}:{'x'.join(map(str, k.shape[2:]))}.{'x'.join(map(str, v.shape[2:]))}"
    return DiskKey(
        model_fingerprint=model_fingerprint(shard),
        kv_dtype=str(shard.kv_cache_dtype).removeprefix("torch."),
        block_size=shard.block_size,
        layout=layout,
        tp_rank=shard.tp.rank,
        tp_size=shard.tp.size,
        payload_bytes=shard.kv_bytes_per_block,
    )


def read_blocks(shard: ModelShard, ids: list[int], host: bool) -> list[bytes | bytearray]:
    """The payloads of device blocks (or host slots, ``host``) ``ids`` (bytes-like: written and hashed as they are)."""
    if not ids:
        return []
    k, v = _block_views(shard, host)
    if k.device.type == "cpu":
        # Each block copied once, straight into its payload: a gathered batch would make three
        # more copies as large, and on a CPU host fresh pages can cost more than the copies.
        per_k, per_v = k[:, 0].numel(), v[:, 0].numel()
        out: list[bytes | bytearray] = []
        for b in ids:
            payload = bytearray(per_k + per_v)
            row = torch.frombuffer(payload, dtype=torch.uint8)
            row[:per_k].view(k.shape[0], *k.shape[2:]).copy_(k[:, b])
            row[per_k:].view(v.shape[0], *v.shape[2:]).copy_(v[:, b])
            out.append(payload)
        return out
    index = torch.tensor(ids, dtype=torch.long, device=k.device)
    # [layers, n, ...] -> [n, layers, ...]: one contiguous payload per block
    ks = k.index_select(1, index).transpose(0, 1).reshape(len(ids), -1).to("cpu")
    vs = v.index_select(1, index).transpose(0, 1).reshape(len(ids), -1).to("cpu")
    both = torch.cat((ks, vs), dim=1).numpy()
    return [row.tobytes() for row in both]


def fill_host_slots(shard: ModelShard, fills: list[tuple[int, bytes | bytearray]]) -> None:
    """Write disk payloads into host slots (before the step's swap-ins read them): each straight from
    its bytes into its slot, with no intermediate copy."""
    if not fills:
        return
    k, v = _block_views(shard, host=True)
    per_k = k[:, 0].numel()
    with warnings.catch_warnings():
        # The payload is read-only bytes and is only read here.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for slot, payload in fills:
            row = torch.frombuffer(payload, dtype=torch.uint8)
            k[:, slot].copy_(row[:per_k].view(k.shape[0], *k.shape[2:]))
            v[:, slot].copy_(row[per_k:].view(v.shape[0], *v.shape[2:]))


def store_blocks(shard: ModelShard, files: BlockFiles, blocks: list[tuple[int, bytes]], host: bool) -> None:
    """Queue (block or host slot, hash) pairs of this rank's shard for the disk (write-behind);
    nothing once the files are stopped."""
    if blocks and files.enabled:
        payloads = read_blocks(shard, [b for b, _ in blocks], host=host)
        for (_, h), payload in zip(blocks, payloads):
            files.store(h, payload)


@dataclass
class TierCopyTimes:
    """Seconds and bytes of the disk copies on the engine loop (cumulative)."""

    store_seconds: float = 0.0  # reading blocks for the writer queue
    fill_seconds: float = 0.0  # disk payloads into host slots
    fill_bytes: int = 0


class TierIO:
    """Applies a step's ``TierOps`` on rank 0's shard, around the swap copies and the forward."""

    def __init__(self, shard: ModelShard, disk: DiskTier) -> None:
        self.shard = shard
        self.disk = disk
        self.times = TierCopyTimes()

    def before_swap(self, ops: TierOps) -> None:
        """Slots leaving the host tier go to the disk queue, then disk reads fill their slots."""
        t0 = time.perf_counter()
        store_blocks(self.shard, self.disk, ops.host_stores, host=True)
        t1 = time.perf_counter()
        fill_host_slots(self.shard, [(s, p) for s, _, p in ops.host_fills])
        self.disk.recycle()  # the payloads are in their slots: their buffers serve the next reads
        t2 = time.perf_counter()
        self.times.store_seconds += t1 - t0
        self.times.fill_seconds += t2 - t1
        self.times.fill_bytes += sum(len(p) for _, _, p in ops.host_fills)

    def after_forward(self, ops: TierOps) -> None:
        """Blocks computed this step go to the disk queue (write-behind)."""
        if not ops.device_stores or not self.disk.enabled:
            return
        t0 = time.perf_counter()
        store_blocks(self.shard, self.disk, ops.device_stores, host=False)
        self.times.store_seconds += time.perf_counter() - t0


# A worker rank's answer for one block rank 0's lookup asked it to read.
LOAD_OK, LOAD_MISSING, LOAD_INVALID = 0, 1, 2


@dataclass
class ShardTierIO:
    """A worker rank's side of the disk tier: its own shard files, no decisions (rank 0's
    ``DiskTier`` makes them, replica/executor/tp_disk.py asks).

    ``load`` reads and verifies this rank's files of the blocks a lookup wants and keeps the
    payloads; the step's ``before_swap`` puts the ones rank 0 kept (all ranks' reads verified)
    into their host slots and drops the rest, so nothing read outlives its step.
    """

    shard: ModelShard
    files: BlockFiles
    pending: dict[bytes, bytes] = field(default_factory=dict)
    _reported: bool = False

    def load(self, hashes: list[bytes]) -> list[int]:
        """Read this rank's files of ``hashes``: one ``LOAD_*`` per block."""
        out = []
        for h in hashes:
            invalid = self.files.stats.invalid_files
            payload = self.files.read(h)
            if payload is not None:
                self.pending[h] = payload
                out.append(LOAD_OK)
            else:
                out.append(LOAD_INVALID if self.files.stats.invalid_files > invalid else LOAD_MISSING)
        return out

    def before_swap(self, host_stores: list[tuple[int, bytes]], fills: list[tuple[int, bytes]]) -> None:
        """Host slots leaving the tier go to this rank's write queue; then the fills rank 0
        decided (host slot, block hash) take this rank's payloads read for them."""
        store_blocks(self.shard, self.files, host_stores, host=True)
        try:
            fill_host_slots(self.shard, [(s, self.pending[h]) for s, h in fills])
        except KeyError as exc:
            raise RuntimeError(f"a disk fill for block {exc.args[0].hex()} that this rank did not read") from None
        finally:
            self.pending.clear()
            self.files.recycle()

    def after_forward(self, device_stores: list[tuple[int, bytes]]) -> None:
        """Blocks computed this step go to this rank's write queue (write-behind)."""
        store_blocks(self.shard, self.files, device_stores, host=False)

    def save(self, entries: list[tuple[bool, int, bytes, int]]) -> list[bool]:
        """A drain's save of (host?, block or slot, hash, mtime_ns): whether each file was written."""
        written = [False] * len(entries)
        for host in (False, True):
            part = [i for i, e in enumerate(entries) if e[0] == host]
            for i, payload in zip(part, read_blocks(self.shard, [entries[i][1] for i in part], host=host)):
                written[i] = self.files.save(entries[i][2], payload, entries[i][3])
        return written

    def take_fault(self) -> tuple[str, str] | None:
        """This rank's disk fault (op, error), once: rank 0 then stops the tier."""
        if self.files.fault is None or self._reported:
            return None
        self._reported = True
        return self.files.fault
