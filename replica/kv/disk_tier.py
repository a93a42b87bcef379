"""The shared disk tier: KV blocks as content-addressed files in one directory.

Several replicas (on one machine, or on several sharing a file system) point
``kv_disk_path`` at the same directory; the first one that computes a prefix serves
every other one's lookup of it. A block's file is named by everything that makes its
bytes valid::

    <model fingerprint>-<kv dtype>-bs<block size>-<layout>-tp<rank>of<size>-<block hash>.kv

(``DiskKey.file_name``): the model fingerprint (the weights themselves, sampled, the fp8
scales, and the config the KV depends on: ``replica/worker/tier_io.py`` ``kv_config``),
the cache dtype, the block size, the attention backend's block layout, the
tensor-parallel rank and size, and the chained block hash (Contract 2 of docs/design.md,
which covers the parent chain and ``cache_salt``).

A file is ``MAGIC``, a little-endian u32 header length, a JSON header (the key, the
block hash, the payload length, the payload's xxh3_64) and the payload. A read checks
all of it: a file that is truncated, corrupt, or written for another key is a miss and
is deleted, never wrong tokens. The directory is shared, so whatever sits under a block's
name is opened with ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed before a byte is read:
only a regular file of exactly the block file's size is read; a symlink (to a huge file,
say), a FIFO (which would block a plain open), a directory or a file of another size is
a miss, removed when it can be, and never stops the tier.

Writes are write-behind: ``store`` puts the payload on a bounded queue (dropped and
counted when full) and one writer thread writes a temporary file beside the target,
then renames it (atomic on POSIX), so a writer killed mid-write leaves only a
``.tmp`` file that no reader opens; two writers of one block both rename whole files.
The directory is bounded by ``size_bytes``, as measured from the directory: every
``1 / SCAN_FRACTION`` of the bound this process writes it re-measures the directory's
block files (regular files only, every writer's), and past the bound deletes the least
recently used files (reads refresh a file's mtime), whoever wrote them, down to
``TRIM_TO`` of the bound. With N writers sharing a directory it therefore exceeds the bound
by at most about N / ``SCAN_FRACTION`` of it between two measurements.

``contains`` answers from memory: the tier keeps the set of block hashes it knows to be
in the directory (what it wrote, read or found there), refreshed from a directory
listing (names only, no ``stat``) at most every ``list_every_s`` seconds, since other
replicas write into and trim the same directory. A lookup therefore costs no system
call; its answer may lag another replica's write or trim by that interval. That lag
never serves a wrong token (``load`` reads and verifies the file, and a file found
missing leaves the set) and never writes a block twice (the writer checks the file).

A full disk (ENOSPC, EDQUOT, EFBIG) degrades the tier instead of stopping it: the write is
dropped and counted (``errors["write"]``, ``dropped_writes``), this process trims the
directory to ``TRIM_TO`` of what it measures, and writes pause for ``full_backoff_s``
(dropped and counted meanwhile; reads go on), then resume: one warning per episode. Any
other disk fault (read-only, the directory gone) stops the tier for good with one warning
and one ``errors`` count; serving goes on from the other tiers. A directory that cannot
be used at start raises ``ValueError`` naming it.

Under tensor parallelism each rank holds its shard of every block, so a block is one file
per rank, each rank writing and reading only its own (``BlockFiles``), and rank 0's
``DiskTier`` decides for all of them: the known set (rank 0's names), the size bound (every
rank's files; a block's files are deleted together), ``touch`` and ``discard`` (every rank's
file of a block). replica/executor/tp_disk.py makes a block a hit only when every rank's file
verifies.

Pure Python (no torch): payloads are bytes.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

log = logging.getLogger(__name__)

MAGIC = b"PSKVBLK1"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
# Of the size bound: what a trim leaves, so that a trim is not due again at the next write.
TRIM_TO = 0.9
# A temporary file older than this is a dead writer's leftover (deleted at start).
STALE_TMP_S = 600.0
# Seconds between the directory listings that refresh the set ``contains`` answers from.
LIST_EVERY_S = 2.0
# Each writer re-measures the shared directory every 1/SCAN_FRACTION of the bound it writes.
SCAN_FRACTION = 64
# After a full disk: seconds writes pause (dropped and counted) before they are tried again
# (``BlockFiles.full_backoff_s``; EngineConfig.kv_disk_full_backoff_s on rank 0).
FULL_BACKOFF_S = 30.0
# Bytes of payload buffers a reader keeps for its next reads (BlockFiles.recycle).
READ_POOL_BYTES = 64 * 1024**2
# Buffers lent and not recycled yet that a reader remembers (more are forgotten, never reused).
MAX_LENT_BUFFERS = 4096
# Write errors that mean "no space": the tier degrades and recovers instead of stopping.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Flags a block file is opened with: never through a symlink, never blocking on a FIFO.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_HEADER_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class DiskKey:
    """What makes a block file valid for a reader (the module docstring's name fields)."""

    model_fingerprint: str  # hex digest of the weights (and fp8 scales): ``tier_io.model_fingerprint``
    kv_dtype: str  # the cache's element type, e.g. "float32", "float8_e4m3fn"
    block_size: int
    layout: str  # the backend's per-block K and V shapes, e.g. "cpu:2x16x64.2x16x64"
    tp_rank: int
    tp_size: int
    payload_bytes: int  # one block's K and V over every layer

    @property
    def prefix(self) -> str:
        layout = xxhash.xxh3_64_hexdigest(self.layout.encode())[:8]
        return (
            f"{self.model_fingerprint[:16]}-{self.kv_dtype}-bs{self.block_size}-{layout}"
            f"-tp{self.tp_rank}of{self.tp_size}"
        )

    def file_name(self, block_hash: bytes) -> str:
        return f"{self.prefix}-{block_hash.hex()}{SUFFIX}"

    def header_key(self) -> str:
        """The full key written into each file (the file name holds digests of parts of it)."""
        return json.dumps(
            [
                self.model_fingerprint,
                self.kv_dtype,
                self.block_size,
                self.layout,
                self.tp_rank,
                self.tp_size,
                self.payload_bytes,
            ]
        )


@dataclass
class DiskTierStats:
    """Cumulative counters (blocks unless named)."""

    stored_blocks: int = 0  # files written by this process
    stored_bytes: int = 0
    loaded_blocks: int = 0  # verified reads
    loaded_bytes: int = 0
    invalid_files: int = 0  # truncated, corrupt or foreign files deleted on read
    dropped_writes: int = 0  # stores refused: the write queue was full or the tier stopped
    evicted_files: int = 0  # deleted by the size bound
    errors: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})
    disabled: bool = False


def _header(key: DiskKey, block_hash: bytes, length: int, digest: str) -> bytes:
    return json.dumps({"key": key.header_key(), "hash": block_hash.hex(), "length": length, "xxh3_64": digest}).encode()


def encode_block_file(key: DiskKey, block_hash: bytes, payload: bytes) -> bytes:
    """A block file's bytes (MAGIC, header length, JSON header, payload)."""
    header = _header(key, block_hash, len(payload), xxhash.xxh3_64_hexdigest(payload))
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def block_file_size(key: DiskKey, block_hash: bytes) -> int:
    """The exact size of ``block_hash``'s file of ``key``: every header field has a fixed width
    for them (the digest is always 16 hex digits)."""
    header = _header(key, block_hash, key.payload_bytes, "0" * 16)
    return len(MAGIC) + _HEADER_LEN.size + len(header) + key.payload_bytes


def decode_block_file(
    key: DiskKey, block_hash: bytes, data: bytes, payload: bytes | bytearray | None = None
) -> bytes | bytearray | None:
    """The payload of a block file when every check passes, else None. ``data`` is the whole file,
    or, with ``payload`` given, the part before the payload (as :meth:`BlockFiles.read` reads a
    file: in two reads, so the payload is never copied out of the whole)."""
    head = len(MAGIC) + _HEADER_LEN.size
    if len(data) < head or not data.startswith(MAGIC):
        return None
    (n,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    if len(data) < head + n:
        return None
    try:
        header = json.loads(data[head : head + n])
    except ValueError:
        return None
    if payload is None:
        payload = data[head + n :]
    elif len(data) != head + n:
        return None
    if (
        not isinstance(header, dict)
        or header.get("key") != key.header_key()
        or header.get("hash") != block_hash.hex()
        or header.get("length") != len(payload)
        or len(payload) != key.payload_bytes
        or header.get("xxh3_64") != xxhash.xxh3_64_hexdigest(payload)
    ):
        return None
    return payload


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``'s position, or None when the file ends first."""
    data = os.read(fd, size)
    while len(data) < size:  # a short read: rare, joined
        more = os.read(fd, size - len(data))
        if not more:
            return None
        data += more
    return data


class BlockFiles:
    """One rank's block files under ``path`` for its ``key``: verified reads, write-behind writes,
    deletes, and no decisions (no size bound, no known set).

    Every rank of a tensor-parallel replica holds one for its own shard files (``tp<r>of<n>``);
    rank 0's :class:`DiskTier` is one too and adds the decisions. A fault stops the object and
    records ``fault`` (the op and the error): a worker rank reports it to rank 0, which stops the
    whole tier (``DiskTier.fail``).
    """

    def __init__(
        self, path: str, key: DiskKey, queue_blocks: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = os.path.abspath(path)
        self.key = key
        self.stats = DiskTierStats()
        self.fault: tuple[str, str] | None = None
        self._enabled = True
        self._clock = clock
        self.full_backoff_s = FULL_BACKOFF_S
        # While the disk is full: when writes are tried again (None: they are not paused).
        self._paused_until: float | None = None
        self._lock = threading.Lock()
        self._check_usable()
        # Payload buffers reads fill (a fresh one per read costs more than the read on a VM): those
        # free, and those lent to this step's reads (``recycle`` frees them once their fills are done).
        self._free_buffers: list[bytearray] = []
        self._lent_buffers: list[bytearray] = []
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def _check_usable(self) -> None:
        """Create the directory and write a probe file; a clear error naming the path otherwise."""
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, f".probe-{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")
            with open(probe, "wb") as f:
                f.write(MAGIC)
            os.remove(probe)
        except OSError as exc:
            raise ValueError(
                f"kv_disk_path {self.path!r} cannot be used: {exc.strerror or exc} "
                "(it must be a writable directory, or creatable)"
            ) from exc

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _file(self, block_hash: bytes) -> str:
        return os.path.join(self.path, self.key.file_name(block_hash))

    def _note(self, block_hash: bytes, present: bool) -> None:
        """What this process saw of ``block_hash``'s file (``DiskTier`` keeps it; a worker rank does not)."""

    def read(self, block_hash: bytes) -> bytes | bytearray | None:
        """The verified payload of this rank's file, or None (a miss; an invalid file is deleted and
        counted in ``stats.invalid_files``; a fault stops the object). Counts no load."""
        if not self._enabled:
            return None
        name = self._file(block_hash)
        try:
            parts = self._read_file(name, block_file_size(self.key, block_hash))
        except FileNotFoundError:
            self._note(block_hash, False)
            if not os.path.isdir(self.path):
                self._fail("read", FileNotFoundError(errno.ENOENT, "the directory vanished", self.path))
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                self._fail("read", exc)
                return None
            parts = None  # a symlink (O_NOFOLLOW), a socket or a directory under the block's name
        payload = None if parts is None else decode_block_file(self.key, block_hash, *parts)
        if payload is None and parts is not None:
            self._give_back(parts[1])
        if payload is None:
            self.stats.invalid_files += 1
            _remove(name)
            self._note(block_hash, False)
            return None
        try:
            os.utime(name, follow_symlinks=False)  # the size bound evicts the least recently used files first
        except OSError:
            pass  # evicted by another replica meanwhile: the payload read is whole and verified
        self._note(block_hash, True)
        return payload

    def _read_file(self, name: str, size: int) -> tuple[bytes, bytearray] | None:
        """The bytes of ``name`` when it is a regular file of exactly ``size`` bytes, else None; never
        follows a symlink nor blocks on a FIFO, and reads nothing of a file of another size. In two
        parts: what comes before the payload, and the payload, read into a buffer of this object's
        (``recycle`` takes it back)."""
        fd = os.open(name, _OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return None
            head = _read_exactly(fd, size - self.key.payload_bytes)
            if head is None:
                return None
            payload = self._free_buffers.pop() if self._free_buffers else bytearray(self.key.payload_bytes)
            self._lent_buffers.append(payload)
            if len(self._lent_buffers) > MAX_LENT_BUFFERS:
                del self._lent_buffers[0]  # a caller that never recycles: forgotten (never reused), not kept
            view, done = memoryview(payload), 0
            while done < len(payload):
                got = os.readv(fd, [view[done:]])
                if not got:
                    return None  # shrank under us: another process truncated it
                done += got
            return head, payload
        finally:
            os.close(fd)

    def _give_back(self, payload: bytearray) -> None:
        """A lent buffer whose read did not verify: free again at once."""
        for i, lent in enumerate(self._lent_buffers):
            if lent is payload:
                del self._lent_buffers[i]
                self._free_buffers.append(payload)
                return

    def recycle(self) -> None:
        """The payloads read so far are used (their fills are done): their buffers serve the next
        reads, up to READ_POOL_BYTES of them kept."""
        keep = max(0, READ_POOL_BYTES // max(1, self.key.payload_bytes) - len(self._free_buffers))
        self._free_buffers.extend(self._lent_buffers[:keep])
        self._lent_buffers.clear()

    def count_loaded(self, payload: bytes | bytearray) -> None:
        """Count one block served from the disk."""
        self.stats.loaded_blocks += 1
        self.stats.loaded_bytes += len(payload)

    def load(self, block_hash: bytes) -> bytes | bytearray | None:
        """``read``, counted as a load when it verifies."""
        payload = self.read(block_hash)
        if payload is not None:
            self.count_loaded(payload)
        return payload

    def store(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue a block for the writer; False (counted) when the queue is full or the tier stopped."""
        if not self._enabled or self._write_paused():
            self.stats.dropped_writes += 1
            return False
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            self.stats.dropped_writes += 1
            return False
        return True

    def save(self, block_hash: bytes, payload: bytes, mtime_ns: int) -> bool:
        """Write a block on the calling thread, now, and give its file ``mtime_ns`` (a drain's save:
        the size bound deletes older files first); True when this call wrote the file.

        For when nothing else writes: the caller flushes the writer queue first.
        """
        if not self._enabled:
            return False
        before = self.stats.stored_blocks
        try:
            self._write(block_hash, payload)
        except Exception as exc:  # noqa: BLE001 - a disk fault stops the tier, never the caller
            self._fail("write", exc)
            return False
        self._touch_file(self._file(block_hash), block_hash, mtime_ns)
        return self.stats.stored_blocks > before

    def touch(self, block_hash: bytes, mtime_ns: int) -> bool:
        """Set the block file's mtime (its place in the size bound's order); False when there is none."""
        return self._touch_file(self._file(block_hash), block_hash, mtime_ns)

    def _touch_file(self, name: str, block_hash: bytes, mtime_ns: int) -> bool:
        try:
            os.utime(name, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        except OSError:
            self._note(block_hash, False)
            return False
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # --- the writer thread ----------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._enabled and not self._write_paused():
                    self._write(*item)
                elif self._enabled:
                    self.stats.dropped_writes += 1
            except Exception as exc:  # noqa: BLE001 - a writer fault stops the tier, never the engine
                self._fail("write", exc)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        target = self._file(block_hash)
        if os.path.exists(target):
            self._note(block_hash, True)
            return  # another replica (or an earlier store) wrote it: content-addressed
        data = encode_block_file(self.key, block_hash, payload)
        tmp = f"{target}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except OSError as exc:
            _remove(tmp)
            if exc.errno in NO_SPACE_ERRNOS:
                self._disk_full(exc)
            else:
                self._fail("write", exc)
            return
        if self._paused_until is not None:
            self._paused_until = None
            log.info("KV disk tier at %s writes again after a full disk", self.path)
        self._note(block_hash, True)
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += len(payload)
        self._wrote(len(data))

    def _wrote(self, nbytes: int) -> None:
        """A file of ``nbytes`` was written (``DiskTier`` bounds the directory's size)."""

    def _write_paused(self) -> bool:
        """Whether writes wait out a full disk (``full_backoff_s`` after it)."""
        until = self._paused_until
        return until is not None and self._clock() < until

    def _disk_full(self, exc: OSError) -> None:
        """A write found no space: drop it, pause writes for ``full_backoff_s``, make room; the tier
        stays up (reads go on) and writes resume after the pause."""
        with self._lock:
            self.stats.errors["write"] = self.stats.errors.get("write", 0) + 1
            self.stats.dropped_writes += 1
            first = self._paused_until is None
            self._paused_until = self._clock() + self.full_backoff_s
        if first:
            log.warning(
                "KV disk tier at %s: the disk is full (%s); writes pause for %g s and old block files are "
                "trimmed, reads go on",
                self.path,
                exc,
                self.full_backoff_s,
            )
        self._make_room()

    def _make_room(self) -> None:
        """Free space after a full disk (``DiskTier`` trims the directory; a worker rank leaves that to rank 0)."""

    def _fail(self, op: str, exc: BaseException) -> bool:
        """Stop after a disk fault, counted per op; True for the fault that stopped it."""
        with self._lock:
            self.stats.errors[op] = self.stats.errors.get(op, 0) + 1
            if not self._enabled:
                return False
            self._enabled = False
            self.stats.disabled = True
            self.fault = (op, f"{type(exc).__name__}: {exc}")
        return True


class DiskTier(BlockFiles):
    """The shared disk tier's decisions, on rank 0 (module docstring); a ``BlockStore``.

    Its ``key`` is rank 0's. Under tensor parallelism (``key.tp_size`` > 1) the other ranks write
    and read their own files of each block (``BlockFiles``), and this object decides for all of
    them: the known set (from rank 0's file names), the size bound over every rank's files (a
    block's files are deleted together), ``touch`` and ``discard`` on every rank's file.
    """

    def __init__(
        self,
        path: str,
        size_bytes: int,
        key: DiskKey,
        queue_blocks: int = 256,
        on_error: Callable[[str], None] | None = None,
        list_every_s: float = LIST_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        block_bytes = key.payload_bytes * key.tp_size
        if size_bytes < block_bytes:
            raise ValueError(
                f"kv_disk_size_gb={size_bytes / 1024**3:g} holds no KV block of {block_bytes} bytes: raise it"
            )
        self.size_bytes = size_bytes
        self._on_error = on_error
        self._list_lock = threading.Lock()  # one listing at a time; lookups meanwhile use the set
        self.list_every_s = list_every_s
        self._clock = clock
        # The hashes known to have a file; ``_added`` and ``_gone`` collect the changes this
        # process makes while a listing runs, applied over the listing's result.
        self._known: set[bytes] = set()
        self._added: set[bytes] = set()
        self._gone: set[bytes] = set()
        self._bytes = 0
        self._rank_keys = [dataclasses.replace(key, tp_rank=r) for r in range(key.tp_size)]
        # Bytes this process wrote since it last measured the directory.
        self._since_measure = 0
        super().__init__(path, key, queue_blocks, clock)
        self._bytes = self._scan_size()
        self._listed_at = self._clock()

    # --- start ---------------------------------------------------------------------

    def _scan_size(self) -> int:
        """Bytes of block files in the directory (and the known set of this key's); deletes dead
        writers' temporary files."""
        total = 0
        now = time.time()
        known = set()
        for entry in self._entries():
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # a symlink, FIFO or directory holds no block and no space of ours
            if entry.name.endswith(TMP_SUFFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    _remove(entry.path)
            elif entry.name.endswith(SUFFIX):
                total += st.st_size
                h = self._hash_of_name(entry.name)
                if h is not None:
                    known.add(h)
        self._known = known
        return total

    def _hash_of_name(self, name: str, key: DiskKey | None = None) -> bytes | None:
        """The block hash a file name of ``key`` (this tier's) carries, or None (another key's file,
        or no block)."""
        head = (key or self.key).prefix + "-"
        if not (name.startswith(head) and name.endswith(SUFFIX)):
            return None
        try:
            return bytes.fromhex(name[len(head) : -len(SUFFIX)])
        except ValueError:
            return None

    def _entries(self) -> list[os.DirEntry[str]]:
        with os.scandir(self.path) as it:
            return list(it)

    def rank_files(self, block_hash: bytes) -> list[str]:
        """The paths of every rank's file of ``block_hash``, rank 0's first."""
        return [os.path.join(self.path, k.file_name(block_hash)) for k in self._rank_keys]

    @property
    def group(self) -> str:
        """Names this directory and key: replicas reporting the same group read each other's blocks."""
        return xxhash.xxh3_64_hexdigest(f"{os.path.realpath(self.path)}|{self.key.prefix}".encode())

    # --- the BlockStore interface ----------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """This process's estimate of the directory's block-file bytes (rescanned at each trim)."""
        return self._bytes

    def contains(self, block_hash: bytes) -> bool:
        """Whether the directory holds ``block_hash``'s file, from the known set (module docstring)."""
        if not self._enabled:
            return False
        if self._clock() - self._listed_at >= self.list_every_s:
            self._relist()
        return block_hash in self._known

    def known_hashes(self) -> set[bytes]:
        """A copy of the known set (``contains``'s answers; empty once the tier stopped): what the
        KV events report as the disk medium."""
        if not self._enabled:
            return set()
        if self._clock() - self._listed_at >= self.list_every_s:
            self._relist()
        with self._lock:
            return set(self._known)

    def _relist(self) -> None:
        """Rebuild the known set from a listing of the directory's names (skipped while another
        thread lists: that thread's result serves)."""
        if not self._list_lock.acquire(blocking=False):
            return
        try:
            self._listed_at = self._clock()  # a failed listing waits its turn too
            with self._lock:
                self._added.clear()
                self._gone.clear()
            try:
                with os.scandir(self.path) as it:
                    listed = {h for e in it if (h := self._hash_of_name(e.name)) is not None}
            except OSError as exc:
                if not os.path.isdir(self.path):
                    self._fail("read", exc)
                return
            with self._lock:
                self._known = (listed | self._added) - self._gone
        finally:
            self._list_lock.release()

    def _note(self, block_hash: bytes, present: bool) -> None:
        """Record what this process saw of ``block_hash``'s file in the known set (and, while a
        listing runs, in the changes applied over its result: kept only then, so that misses
        between listings leave nothing behind)."""
        with self._lock:
            listing = self._list_lock.locked()
            if present:
                self._known.add(block_hash)
                if listing:
                    self._added.add(block_hash)
                    self._gone.discard(block_hash)
            else:
                self._known.discard(block_hash)
                if listing:
                    self._gone.add(block_hash)
                    self._added.discard(block_hash)

    def touch(self, block_hash: bytes, mtime_ns: int) -> bool:
        """Set the mtime of every rank's file of the block (its place in the size bound's order);
        False when one of them is missing."""
        found = [self._touch_file(name, block_hash, mtime_ns) for name in self.rank_files(block_hash)]
        return all(found)

    def discard(self, block_hash: bytes) -> None:
        """Delete every rank's file of a block that is not whole (a rank's file missing or invalid)."""
        for name in self.rank_files(block_hash):
            _remove(name)
        self._note(block_hash, False)

    def fail(self, op: str, reason: str) -> None:
        """Stop the tier for a fault another rank reported (counted only when it stops the tier)."""
        if self._enabled:
            self._fail(op, RuntimeError(reason))

    # --- the size bound ------------------------------------------------------------

    def _wrote(self, nbytes: int) -> None:
        # Every rank writes a file of this size for the block (each holds its shard of it).
        self._bytes += nbytes * self.key.tp_size
        self._since_measure += nbytes * self.key.tp_size
        if self._since_measure >= self.size_bytes / SCAN_FRACTION:
            # Other replicas write into the directory too: measure it, not this process's writes.
            self._bytes = sum(size for _, size, _ in self._block_files())
            self._since_measure = 0
        if self._bytes > self.size_bytes:
            self._trim()

    def _make_room(self) -> None:
        try:
            self._trim(min(self.size_bytes, sum(size for _, size, _ in self._block_files())) * TRIM_TO)
        except OSError:
            pass  # the directory is gone: the next read or write reports it

    def _block_files(self) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of the directory's block files: regular files only, every writer's."""
        files = []
        for entry in self._entries():
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted by another replica meanwhile
                if stat.S_ISREG(st.st_mode):
                    files.append((st.st_mtime_ns, st.st_size, entry.path))
        return files

    def _trim(self, goal: float | None = None) -> None:
        """Delete the least recently used block files, whoever wrote them, down to ``goal`` bytes
        (``TRIM_TO`` of the bound); a block of this key goes with every rank's file of it."""
        files = self._block_files()
        files.sort()
        sizes = {name: size for _, size, name in files}
        total = sum(sizes.values())
        goal = self.size_bytes * TRIM_TO if goal is None else goal
        self._since_measure = 0
        for _, _, name in files:
            if total <= goal:
                break
            if name not in sizes:
                continue  # a sibling of a block deleted earlier in this trim
            h = self._rank_hash(os.path.basename(name))
            group = self.rank_files(h) if h is not None else [name]
            for member in group:
                size = sizes.pop(member, None)
                if size is None:
                    continue
                if _remove(member):
                    self.stats.evicted_files += 1
                total -= size
            if h is not None:
                self._note(h, False)
        self._bytes = total

    def _rank_hash(self, name: str) -> bytes | None:
        """The block hash of a file of any rank of this tier's key, or None."""
        for k in self._rank_keys:
            h = self._hash_of_name(name, k)
            if h is not None:
                return h
        return None

    def _fail(self, op: str, exc: BaseException) -> bool:
        """Stop the tier after a disk fault: one warning, one count (per op), serving goes on."""
        if not super()._fail(op, exc):
            return False
        log.warning(
            "KV disk tier at %s stopped after a %s error (%s); serving goes on from the device and host tiers",
            self.path,
            op,
            exc,
        )
        if self._on_error is not None:
            self._on_error(op)
        return True


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False
