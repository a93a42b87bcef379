"""Build and load the C kernels beside this module (``kernels/cpu/*.c``: one shared library, called
through ctypes).

Built at first use with ``$CC`` (default ``cc``) and ``-O3 -march=native -fopenmp``
into ``$PREFIXSERVE_CACHE_DIR`` (default ``~/.cache/prefixserve``), keyed by the
sources, the compiler, the flags and this CPU's feature flags, so a cache shared
between machines never hands one CPU another's instructions. The library links the
OpenMP runtime by soname and so shares the one torch has loaded (one thread pool,
not two competing for the cores).

Without a C compiler :func:`load` raises :class:`CPUKernelUnavailable`; callers
fall back to torch (see :func:`prefixserve.kernels.backends.select_backend`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from prefixserve.common.paths import cache_root

SOURCE_DIR = Path(__file__).parent
SOURCES = tuple(sorted(SOURCE_DIR.glob("*.c")))
HEADERS = tuple(sorted(SOURCE_DIR.glob("*.h")))
# -ffp-contract=fast: fuse a*b+c into FMAs (ISO C modes turn that off by default).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# name -> (restype, argtypes); the C signatures live in kernels/cpu/*.c.
SIGNATURES = {
    "paged_attention_f32": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            _i64,
            _ptr,
            _ptr,
            _i32,
            _i32,
            _i32,
            _i32,
            _i32,
            _f32,
            _i32,
            _ptr,
            _i32,
            _i32,
            _f32,
            _f32,
        ],
    ),
    "write_kv_cache_f32": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32]),
    "write_kv_cache_fp8": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32, _f32, _f32],
    ),
    "add_rms_norm_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i32, _f32, _i32]),
    "rotary_f32": (None, [_ptr, _i64, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i32]),
    "silu_and_mul_f32": (None, [_ptr, _ptr, _i64, _i32, _i32]),
    "apply_token_bitmask_f32": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32]),
    "small_gemm_f32": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i32]),
    "small_gemm_silu_mul_f32": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i32]),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_error: str | None = None


class CPUKernelUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here (no compiler, or it failed)."""


def kernel_cache_dir() -> Path:
    """Where the built C kernels are kept (one library per source, compiler and CPU)."""
    return cache_root() / "kernels"


def _library_path(compiler: str) -> Path:
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    parts = [s.read_text() for s in SOURCES + HEADERS] + [compiler, *CFLAGS, platform.machine(), cpu]
    return kernel_cache_dir() / f"prefixserve_cpu_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name, then rename: concurrent processes (Ray replicas) may race.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CPUKernelUnavailable(f"{compiler} failed to build kernels/cpu:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL:
    """The library, built on first call; raises CPUKernelUnavailable (and remembers why)."""
    global _library, _error
    if _library is not None:  # the hot path: every kernel call of every layer
        return _library
    with _lock:
        if _library is not None:
            return _library
        if _error is not None:
            raise CPUKernelUnavailable(_error)
        try:
            compiler = shutil.which(os.environ.get("CC", "cc"))
            if compiler is None:
                raise CPUKernelUnavailable(f"no C compiler ({os.environ.get('CC', 'cc')!r}) on PATH")
            path = _library_path(compiler)
            if not path.exists():
                _build(compiler, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, CPUKernelUnavailable) as exc:
            _error = str(exc)
            raise CPUKernelUnavailable(_error) from exc
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _library = lib
        return lib


def available() -> tuple[bool, str]:
    """Whether the C kernels run here, and if not, why."""
    try:
        load()
    except CPUKernelUnavailable as exc:
        return False, str(exc)
    return True, ""
