"""Reading a GGUF file once: its metadata, its tensor table, and its tensors, memory-mapped.

``gguf.GGUFReader`` builds a numpy view for every field of every metadata value,
which for a 49k-token vocabulary and its 49k merges takes seconds on a small CPU;
transformers then runs it again for the config, the tokenizer and the weights. This
reader walks the file once with ``struct`` over an ``mmap`` (strings are decoded
straight from the mapping) and hands tensor bytes out as zero-copy numpy views,
in the same dtypes and shapes ``GGUFReader`` gives them, so
``gguf.quants.dequantize`` (what transformers uses) applies unchanged.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count;
the metadata key/values; the tensor table (name, dims fastest-first, ggml type,
offset into the data section); padding to ``general.alignment``; the data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_VERSIONS = (2, 3)
# Scalar metadata value types (GGUFValueType) -> struct format.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain values; everything else is ggml blocks, handed out as bytes.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  # numpy/torch order (slowest-moving first)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file; ``tensor_data`` reads from the mapping, nothing is copied up front."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    _map: mmap.mmap

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored tensor as a read-only view: values for plain types, ``uint8`` blocks of
        shape ``(*shape[:-1], bytes_per_row)`` for quantized ones (what ``dequantize`` takes)."""
        if info.ggml_type in _PLAIN:
            dtype = np.dtype(_PLAIN[info.ggml_type])
            return np.frombuffer(self._map, dtype, info.nbytes // dtype.itemsize, info.offset).reshape(info.shape)
        block, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block * block_bytes
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset).reshape(*info.shape[:-1], row_bytes)


class _Cursor:
    """A read position over the mapping."""

    def __init__(self, buf: mmap.mmap, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR:
            return self.unpack(_SCALAR[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALAR:  # token types, scores: one unpack for the lot
                return list(self.unpack(f"{count}{_SCALAR[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata value type {value_type}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor table (the tensor data stays on disk)."""
    path = Path(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur = _Cursor(buf, 4)
    version, tensor_count, kv_count = cur.unpack("IQQ")
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF v{version}; supported: {_VERSIONS}")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        (value_type,) = cur.unpack("I")
        metadata[key] = cur.value(value_type)
    table = []
    for _ in range(tensor_count):
        name = cur.string()
        (ndim,) = cur.unpack("I")
        dims = cur.unpack(f"{ndim}Q")
        ggml_type, offset = cur.unpack("IQ")
        table.append((name, tuple(reversed(dims)), GGMLQuantizationType(ggml_type), offset))
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = tuple(
        GGUFTensorInfo(name, shape, qtype, data_start + offset, _nbytes(shape, qtype))
        for name, shape, qtype, offset in table
    )
    for t in tensors:
        if t.offset + t.nbytes > len(buf):
            raise ValueError(f"{path} is truncated: tensor {t.name!r} ends past the end of the file")
    return GGUFFile(path, metadata, tensors, buf)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * block_bytes
