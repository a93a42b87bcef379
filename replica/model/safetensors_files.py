"""Reading safetensors shards tensor by tensor with positioned reads.

``safetensors.safe_open`` memory-maps the shard and copies each tensor out of the
mapping. On the VMs this project runs on, faulting a file mapping in costs far more
than reading it: 540 MB of SmolLM2 weights took 2.1-3.3 s through ``safe_open`` and
0.3-0.7 s through ``readinto`` (same file, same page cache, measured back to back).
So each tensor is read straight into its own freshly allocated tensor, in file order,
one at a time (peak memory: one tensor, not one shard).

A tensor-parallel rank needs a slice of most tensors (a range of rows, or of columns,
of 1/N of the bytes). :func:`iter_file_mapped` yields zero-copy views of the mapping
instead: a weight loader that narrows before it copies faults in only the pages of its
slice, so each rank reads about 1/N of the checkpoint rather than all of it.

The format: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
with offsets relative to the end of the header, then the data.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a shard lies."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(f: BinaryIO, path: Path) -> list[TensorEntry]:
    """The shard's tensors, in file order; raises ValueError on a malformed header."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (length,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable safetensors header: {exc}") from exc
    base = 8 + length
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        entries.append(TensorEntry(name, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, base + end))
    return sorted(entries, key=lambda e: e.begin)


def read_tensor(f: BinaryIO, entry: TensorEntry, path: Path) -> torch.Tensor:
    """Read one tensor into new memory."""
    out = torch.empty(entry.shape, dtype=entry.dtype)
    nbytes = entry.end - entry.begin
    if out.numel() * out.element_size() != nbytes:
        raise ValueError(
            f"{path}: tensor {entry.name!r} spans {nbytes} bytes, its shape needs {out.numel() * out.element_size()}"
        )
    f.seek(entry.begin)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
    if nbytes and f.readinto(view) != nbytes:
        raise ValueError(f"{path}: truncated inside tensor {entry.name!r}")
    return out


def iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of one shard, in file order."""
    with open(path, "rb", buffering=0) as f:
        for entry in read_header(f, path):
            yield entry.name, read_tensor(f, entry, path)


def iter_file_mapped(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` views into a read-only mapping of one shard (nothing read yet).

    The views must be copied from, never written to; they keep the mapping alive.
    """
    with open(path, "rb", buffering=0) as f:
        entries = read_header(f, path)
        size = f.seek(0, 2)
        if size == 0:
            return
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for entry in entries:
        count = (entry.end - entry.begin) // torch.empty((), dtype=entry.dtype).element_size()
        if entry.end > size or count != _numel(entry.shape):
            raise ValueError(
                f"{path}: tensor {entry.name!r} spans bytes {entry.begin}-{entry.end} of a "
                f"{size}-byte file, its shape {entry.shape} needs {_numel(entry.shape)} elements"
            )
        with warnings.catch_warnings():  # the mapping is read-only, and so are the views
            warnings.simplefilter("ignore", UserWarning)
            flat = (
                torch.frombuffer(mapping, dtype=entry.dtype, count=count, offset=entry.begin)
                if count
                else torch.empty(0, dtype=entry.dtype)
            )
        yield entry.name, flat.view(entry.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
