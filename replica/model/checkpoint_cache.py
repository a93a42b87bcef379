"""A directory cache of converted checkpoints, keyed by the source file.

An entry is a folder under ``$PREFIXSERVE_CACHE_DIR/checkpoints`` (the root the C
kernels are cached under) named after the source's stem and a key over its size,
mtime, content hash and the versions of the converting libraries. It is built in a
temporary folder beside it, a ``manifest.json`` listing every file's size and CRC-32
is written last, and the folder is renamed into place, so a reader never sees half an
entry. An entry is used only after its manifest checks out (every file present with
its size and checksum); otherwise it is deleted and rebuilt. Builds take a file lock, so
replicas starting together convert once and the others wait and read.

Checksumming the weights (~0.4 s for 540 MB here) need not delay a start: with
``defer_large=True`` the small files are checked at once and the large ones in a
background thread, whose verdict :meth:`Entry.large_files_ok` gives when the weights
are about to be read (the config, tokenizer and model construction run meanwhile).

The source's content hash is remembered in a small index by (path, size, mtime), so a
later start does not read a multi-GB file just to find its entry.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefixserve.common.paths import cache_root

FORMAT = 2
MANIFEST = "manifest.json"
LARGE_FILE = 64 << 20  # files at least this big are checked in the background with defer_large
log = logging.getLogger(__name__)


def checkpoints_dir() -> Path:
    """``$PREFIXSERVE_CACHE_DIR/checkpoints`` (default ``~/.cache/prefixserve/checkpoints``)."""
    # The project's cache root is the kernels' cache folder's parent; one rule for both.
    return cache_root() / "checkpoints"


@dataclass(frozen=True)
class SourceStamp:
    """What identifies a source file's content."""

    path: Path
    size: int
    mtime_ns: int
    sha256: str

    @classmethod
    def of(cls, path: Path, index_dir: Path | None = None) -> SourceStamp:
        """Stat ``path`` and hash it, reusing a hash remembered for the same path, size and mtime."""
        path = path.resolve()
        st = path.stat()
        memo = index_dir / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json" if index_dir else None
        if memo is not None:
            try:
                known = json.loads(memo.read_text())
                if (known["size"], known["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
                    return cls(path, st.st_size, st.st_mtime_ns, known["sha256"])
            except (OSError, ValueError, KeyError):
                pass
        stamp = cls(path, st.st_size, st.st_mtime_ns, file_sha256(path))
        if memo is not None:
            try:
                memo.parent.mkdir(parents=True, exist_ok=True)
                _write_atomic(
                    memo, json.dumps({"size": stamp.size, "mtime_ns": stamp.mtime_ns, "sha256": stamp.sha256})
                )
            except OSError:
                pass  # only a speed-up
        return stamp

    def key(self, salt: str) -> str:
        """The entry key: this stamp plus ``salt`` (the converter's versions)."""
        text = f"{FORMAT}:{self.size}:{self.mtime_ns}:{self.sha256}:{salt}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_crc32(path: Path) -> str:
    """The file's CRC-32 (hex): catches corruption at a third of SHA-256's cost; the
    manifest guards against damage, not tampering."""
    buf = bytearray(1 << 20)
    view, crc = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


@dataclass(frozen=True)
class Entry:
    """A cache entry whose manifest and small files checked out."""

    folder: Path
    _large_files: Future

    def large_files_ok(self) -> bool:
        """Whether the large files match the manifest (waits for a deferred check)."""
        return self._large_files.result()


def cached_build(
    source: Path, salt: str, build: Callable[[Path], None], root: Path | None = None, *, defer_large: bool = False
) -> Entry:
    """The entry for ``source``, calling ``build(folder)`` to fill a new one when there is
    none or the one there is incomplete or corrupt. ``salt`` names the converter's version."""
    root = root or checkpoints_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        stamp = SourceStamp.of(source, root / ".sources")
    except OSError as exc:  # read-only home: convert into a private folder, every time
        log.warning("checkpoint cache %s unusable (%s): converting %s without caching", root, exc, source)
        folder = Path(tempfile.mkdtemp(prefix="prefixserve-ckpt-"))
        atexit.register(shutil.rmtree, folder, True)
        build(folder)
        return Entry(folder, _done(True))
    entry = root / f"{source.stem}-{stamp.key(salt)}"
    if (large := check(entry, defer_large)) is not None:
        return Entry(entry, large)
    with _file_lock(entry):
        if (large := check(entry, defer_large)) is not None:  # another process built it meanwhile
            return Entry(entry, large)
        if entry.exists():
            log.warning("checkpoint cache entry %s is incomplete or corrupt: rebuilding it", entry)
            shutil.rmtree(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
        try:
            build(tmp)
            write_manifest(
                tmp,
                {
                    "path": str(stamp.path),
                    "size": stamp.size,
                    "mtime_ns": stamp.mtime_ns,
                    "sha256": stamp.sha256,
                    "salt": salt,
                },
            )
            os.rename(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return Entry(entry, _done(True))


def write_manifest(folder: Path, source: dict) -> None:
    """List every file of ``folder`` with its size and checksum; written last, so its
    presence means the files before it were complete."""
    files = {
        p.name: {"size": p.stat().st_size, "crc32": file_crc32(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    _write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, "source": source, "files": files}, indent=1))


def check(folder: Path, defer_large: bool = False) -> Future | None:
    """None unless ``folder`` has a manifest and every file it lists with its size, and the
    small files' checksums match; then the verdict on the large files' checksums
    (already settled unless ``defer_large``)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or not manifest["files"]:
            return None
        large = []
        for name, want in manifest["files"].items():
            path = folder / name
            if path.stat().st_size != want["size"]:
                return None
            if want["size"] >= LARGE_FILE:
                large.append((path, want["crc32"]))
            elif file_crc32(path) != want["crc32"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    verdict: Future = Future()
    if not defer_large:
        return verdict if _checksums_match(large, verdict) else None
    threading.Thread(target=_checksums_match, args=(large, verdict), name="checkpoint-verify", daemon=True).start()
    return verdict


def verify(folder: Path) -> bool:
    """Whether ``folder`` is a complete, uncorrupted entry (every checksum checked now)."""
    return check(folder) is not None


def discard(folder: Path) -> None:
    """Delete a corrupt entry so that the next :func:`cached_build` rebuilds it."""
    with _file_lock(folder):
        if not verify(folder):
            shutil.rmtree(folder, ignore_errors=True)


def _checksums_match(files: list[tuple[Path, str]], verdict: Future) -> bool:
    try:
        ok = all(file_crc32(path) == want for path, want in files)
    except OSError:
        ok = False
    verdict.set_result(ok)
    return ok


def _done(value: bool) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def _file_lock(entry: Path) -> Iterator[None]:
    """Hold the build lock of ``entry`` (a file beside the entries, in ``.locks``)."""
    path = entry.parent / ".locks" / f"{entry.name}.lock"
    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
