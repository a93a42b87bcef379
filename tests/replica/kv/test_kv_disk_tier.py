"""The shared disk KV tier: block files (atomic, checksummed, content-addressed), its
faults (full, read-only, vanished, partial and foreign files, two writers), its bound,
and engines sharing one directory: the second serves what the first computed."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from model_helpers import engine_metric, four_block_prompts, output_token_ids, tiny_checkpoint

from prefixserve.replica.kv.disk_tier import FULL_BACKOFF_S, SUFFIX, TMP_SUFFIX, DiskKey, DiskTier

KEY = DiskKey("ab" * 32, "float32", 16, "cpu:2x16x16.2x16x16", 0, 1, 64)


def _payload(i: int) -> bytes:
    return bytes((i + k) % 256 for k in range(KEY.payload_bytes))


def _hash(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _stored(tier: DiskTier, i: int) -> Path:
    assert tier.store(_hash(i), _payload(i))
    assert tier.flush()
    path = Path(tier.path) / KEY.file_name(_hash(i))
    assert path.exists()
    return path


def test_a_stored_block_loads_back_and_names_its_key(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    path = _stored(tier, 1)
    assert tier.load(_hash(1)) == _payload(1)
    assert tier.load(_hash(2)) is None
    assert KEY.model_fingerprint[:16] in path.name and "bs16" in path.name and "tp0of1" in path.name
    assert path.name.endswith(_hash(1).hex() + SUFFIX)
    assert tier.stats.stored_blocks == 1 and tier.stats.loaded_blocks == 1
    tier.close()


def test_reads_reuse_their_buffers_only_once_recycled(tmp_path, monkeypatch):
    """A read's payload is a buffer the tier lends until ``recycle``: never overwritten before, then
    reused for the next read (no fresh memory per read); a read that does not verify gives its
    buffer back at once; a caller that never recycles leaves nothing held."""
    import prefixserve.replica.kv.disk_tier as disk_tier

    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    for i in range(4):
        _stored(tier, i)
    first, second = tier.load(_hash(0)), tier.load(_hash(1))
    assert first == _payload(0) and second == _payload(1) and first is not second
    third = tier.load(_hash(2))
    assert first == _payload(0) and third == _payload(2)  # not recycled: nothing reused
    tier.recycle()
    again = tier.load(_hash(3))
    assert again == _payload(3) and any(again is b for b in (first, second, third))
    bad = _stored(tier, 5)
    bad.write_bytes(bad.read_bytes()[:-1] + bytes([bad.read_bytes()[-1] ^ 1]))
    lent = len(tier._lent_buffers)
    assert tier.load(_hash(5)) is None and len(tier._lent_buffers) == lent
    monkeypatch.setattr(disk_tier, "MAX_LENT_BUFFERS", 2)
    for _ in range(5):
        tier.load(_hash(0))
    assert len(tier._lent_buffers) == 2
    tier.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_bad_file_is_a_miss_and_is_deleted(tmp_path, damage):
    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    path = _stored(tier, 3)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-5])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:  # a file of another model under this name (a fingerprint prefix collision)
        other = DiskTier(str(tmp_path / "other"), 1 << 20, replace(KEY, model_fingerprint="ab" * 16 + "cd" * 16))
        path.write_bytes(_stored(other, 3).read_bytes())
        other.close()
    assert tier.load(_hash(3)) is None
    assert not path.exists() and tier.stats.invalid_files == 1
    tier.close()


def test_a_partial_write_is_never_read(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    # A writer killed mid-write leaves its temporary file only: no reader opens it.
    full = _stored(tier, 4).read_bytes()
    (tmp_path / KEY.file_name(_hash(4))).unlink()
    (tmp_path / (KEY.file_name(_hash(4)) + ".999-1" + TMP_SUFFIX)).write_bytes(full[: len(full) // 2])
    assert tier.load(_hash(4)) is None and tier.stats.invalid_files == 0
    tier.close()


def test_a_writer_killed_mid_write_leaves_no_readable_file(tmp_path):
    # A real process writing through the tier is killed while its writes are under way.
    script = f"""
import sys, time
from prefixserve.replica.kv.disk_tier import DiskKey, DiskTier
key = DiskKey("ab" * 32, "float32", 16, "big", 0, 1, 1 << 21)
tier = DiskTier({str(tmp_path)!r}, 1 << 34, key)
for i in range(100):
    tier.store(i.to_bytes(16, "little"), bytes(1 << 21))
print("writing", flush=True)
time.sleep(60)
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    big = DiskKey("ab" * 32, "float32", 16, "big", 0, 1, 1 << 21)
    reader = DiskTier(str(tmp_path), 1 << 34, big)
    for i in range(100):
        payload = reader.load(i.to_bytes(16, "little"))
        assert payload is None or payload == bytes(1 << 21)  # whole files only
    assert reader.stats.invalid_files == 0
    reader.close()


def test_two_writers_of_one_block_leave_one_valid_file(tmp_path):
    tiers = [DiskTier(str(tmp_path), 1 << 20, KEY) for _ in range(2)]
    barrier = threading.Barrier(2)

    def write(t: DiskTier) -> None:
        barrier.wait()
        for i in range(50):
            t.store(_hash(i), _payload(i))
        t.flush()

    threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(tiers[1].load(_hash(i)) == _payload(i) for i in range(50))
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 50 and not list(tmp_path.glob("*" + TMP_SUFFIX))
    for t in tiers:
        t.close()


def test_the_directory_is_bounded_least_recently_used_first(tmp_path):
    size = len(_stored_size_probe(tmp_path / "probe"))
    tier = DiskTier(str(tmp_path / "kv"), size * 10, KEY)
    for i in range(10):
        _stored(tier, i)
        os.utime(Path(tier.path) / KEY.file_name(_hash(i)), ns=(i * 10**9, i * 10**9))
    assert tier.load(_hash(0)) == _payload(0)  # a read makes block 0 the most recent
    _stored(tier, 10)  # past the bound: the oldest go, down to 90%
    assert tier.stats.evicted_files >= 1
    assert tier.load(_hash(0)) == _payload(0) and tier.load(_hash(1)) is None
    assert sum(p.stat().st_size for p in Path(tier.path).glob("*" + SUFFIX)) <= size * 10
    tier.close()


def _stored_size_probe(path: Path) -> bytes:
    t = DiskTier(str(path), 1 << 20, KEY)
    data = _stored(t, 0).read_bytes()
    t.close()
    return data


def test_an_unusable_path_at_start_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"kv_disk_path '{blocker}/kv' cannot be used"):
        DiskTier(str(blocker / "kv"), 1 << 20, KEY)


def _fault_stops_the_tier(tier: DiskTier, caplog, i: int = 7) -> None:
    with caplog.at_level(logging.WARNING, logger="prefixserve.replica.kv.disk_tier"):
        tier.store(_hash(i), _payload(i))
        tier.flush()
        tier.store(_hash(i + 1), _payload(i + 1))  # refused: the tier stopped
        tier.flush()
    assert not tier.enabled and tier.stats.errors["write"] == 1
    assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1
    assert tier.load(_hash(1)) is None and not tier.contains(_hash(1))


def test_a_vanished_directory_stops_the_tier_with_one_warning(tmp_path, caplog):
    tier = DiskTier(str(tmp_path / "kv"), 1 << 20, KEY)
    _stored(tier, 1)
    shutil.rmtree(tmp_path / "kv")
    _fault_stops_the_tier(tier, caplog)
    tier.close()


def test_a_read_only_directory_stops_the_tier_with_one_warning(tmp_path, caplog):
    path = tmp_path / "kv"
    tier = DiskTier(str(path), 1 << 20, KEY)
    _stored(tier, 1)
    if os.geteuid() == 0:  # root writes through mode bits; the immutable attribute stops it
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available to make a directory read-only for root")
    else:
        path.chmod(0o555)
    try:
        _fault_stops_the_tier(tier, caplog)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)
    tier.close()


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_full_disk_degrades_the_tier_and_it_recovers(tmp_path, caplog):
    # The process's file-size limit makes the write fail as a full disk does (EFBIG, the
    # same failed write); SIGXFSZ is ignored so the write returns the error.
    clock = FakeClock()
    tier = DiskTier(str(tmp_path / "kv"), 1 << 20, KEY, clock=clock)
    _stored(tier, 1)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="prefixserve.replica.kv.disk_tier"):
            assert tier.store(_hash(7), _payload(7))
            assert tier.flush()
            assert not tier.store(_hash(8), _payload(8))  # writes pause: dropped and counted
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert tier.enabled and tier.stats.errors["write"] == 1 and tier.stats.dropped_writes == 2
    assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1
    assert not list((tmp_path / "kv").glob("*" + TMP_SUFFIX))  # the partial temporary file is gone
    # Reads go on; after the pause writes do too: the tier recovered.
    assert not (tmp_path / "kv" / KEY.file_name(_hash(7))).exists()
    clock.now += FULL_BACKOFF_S + 1
    _stored(tier, 9)
    assert tier.load(_hash(9)) == _payload(9)
    assert tier.enabled and tier.stats.errors["write"] == 1
    tier.close()


def test_a_full_disk_trims_the_directory_to_make_room(tmp_path):
    size = len(_stored_size_probe(tmp_path / "probe"))
    tier = DiskTier(str(tmp_path / "kv"), size * 100, KEY)
    for i in range(20):
        _stored(tier, i)
    tier._disk_full(OSError(28, "No space left on device"))
    left = len(list((tmp_path / "kv").glob("*" + SUFFIX)))
    assert left == 18 and tier.stats.evicted_files == 2 and tier.enabled  # 90% of what was there
    tier.close()


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink_to_big_file", "dangling_symlink", "wrong_size"])
def test_only_a_regular_file_of_the_block_size_is_read(tmp_path, kind):
    kv = tmp_path / "kv"
    tier = DiskTier(str(kv), 1 << 40, KEY)
    _stored(tier, 1)
    name = kv / KEY.file_name(_hash(2))
    if kind == "fifo":
        os.mkfifo(name)  # a plain open for reading would wait for a writer forever
    elif kind == "directory":
        name.mkdir()
        (name / "x").write_bytes(b"x")
    elif kind == "symlink_to_big_file":
        big = tmp_path / "big"
        with open(big, "wb") as f:
            f.truncate(1536 * 1024**2)  # 1.5 GiB, sparse
        name.symlink_to(big)
    elif kind == "dangling_symlink":
        name.symlink_to(tmp_path / "nothing")
    else:
        name.write_bytes(_stored_size_probe(tmp_path / "probe") + b"x")
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(tier.load(_hash(2))), daemon=True)
    reader.start()
    reader.join(timeout=60)  # a hang guard: the read must not block
    assert not reader.is_alive() and result == [None]
    assert tier.enabled and tier.stats.errors == {"read": 0, "write": 0}
    assert tier.load(_hash(1)) == _payload(1)  # the tier goes on
    # Counted as the directory's block bytes: only regular files (the 1.5 GiB target is not).
    assert tier._scan_size() < 1 << 20
    if kind != "directory":
        assert not name.is_symlink() and not name.exists()  # removed: the block can be written again
        _stored(tier, 2)
        assert tier.load(_hash(2)) == _payload(2)
    tier.close()


def test_four_writers_keep_the_directory_within_its_bound(tmp_path):
    size = len(_stored_size_probe(tmp_path / "probe"))
    bound = size * 256
    kv = tmp_path / "kv"
    tiers = [DiskTier(str(kv), bound, KEY) for _ in range(4)]
    largest = 0
    for i in range(1000):
        for w, tier in enumerate(tiers):
            tier.store(_hash(4 * i + w), _payload(i))
        for tier in tiers:
            assert tier.flush()
        largest = max(largest, sum(p.stat().st_size for p in kv.glob("*" + SUFFIX)))
    assert largest <= 1.1 * bound, largest / bound
    # Every file written is either still there or counted once by the writer that deleted it.
    left = len(list(kv.glob("*" + SUFFIX)))
    assert left * size <= 1.1 * bound
    assert sum(t.stats.evicted_files for t in tiers) + left == 4000
    for tier in tiers:
        tier.close()


# --- engines sharing a directory ------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    return four_block_prompts(21)


PARAMS_KW = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
HOST_GB = 2**22 / 2**30


def _engine(ckpt: str, disk: Path, **knobs):
    from prefixserve.replica.entrypoints.llm import LLM

    return LLM(
        ckpt, num_kv_blocks=16, kv_offloading_size=HOST_GB, kv_disk_path=str(disk), kv_disk_size_gb=0.05, **knobs
    )


def test_a_second_engine_serves_what_the_first_computed(tmp_path, prompts):
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(**PARAMS_KW)
    ckpt = str(tiny_checkpoint(tmp_path / "m", hidden=64, heads=4, kv_heads=2, seed=5))
    expected = output_token_ids(LLM(ckpt, num_kv_blocks=64).generate(prompts, params))
    first = _engine(ckpt, tmp_path / "kv")
    assert output_token_ids(first.generate(prompts, params)) == expected
    assert first.engine.tiers.disk.flush()
    second = _engine(ckpt, tmp_path / "kv")
    outs = second.generate(prompts, params)
    assert output_token_ids(outs) == expected
    # Every full block of each prompt came from the disk: only the last 6 tokens were computed.
    assert [o.num_cached_tokens for o in outs] == [64, 64, 64]
    assert engine_metric(second, "vllm:prompt_tokens_total") == 3 * 6
    assert engine_metric(second, "prefixserve:kv_tier_hit_tokens_total", tier="disk") == 3 * 64
    assert engine_metric(second, "prefixserve:kv_tier_loaded_blocks_total", tier="disk") == 12
    assert engine_metric(first, "prefixserve:kv_tier_stored_blocks_total", tier="disk") >= 12


def test_a_model_changed_under_the_same_directory_gets_no_hits(tmp_path, prompts):
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(**PARAMS_KW)
    path = tmp_path / "m"
    tiny_checkpoint(path, hidden=64, heads=4, kv_heads=2, seed=5)
    first = _engine(str(path), tmp_path / "kv")
    first.generate(prompts, params)
    assert first.engine.tiers.disk.flush()
    shutil.rmtree(path)
    tiny_checkpoint(path, hidden=64, heads=4, kv_heads=2, seed=6)  # new weights, same path
    expected = output_token_ids(LLM(str(path), num_kv_blocks=64).generate(prompts, params))
    second = _engine(str(path), tmp_path / "kv")
    outs = second.generate(prompts, params)
    assert output_token_ids(outs) == expected
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert second.engine.kv_manager.stats.tiers.disk_read_blocks == 0


def test_serving_goes_on_when_the_disk_vanishes_mid_run(tmp_path, prompts, caplog):
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(**PARAMS_KW)
    ckpt = str(tiny_checkpoint(tmp_path / "m", hidden=64, heads=4, kv_heads=2, seed=5))
    expected = output_token_ids(LLM(ckpt, num_kv_blocks=64).generate(prompts, params))
    llm = _engine(ckpt, tmp_path / "kv")
    assert output_token_ids(llm.generate(prompts[:1], params)) == expected[:1]
    assert llm.engine.tiers.disk.flush()
    shutil.rmtree(tmp_path / "kv")
    with caplog.at_level(logging.WARNING):
        assert output_token_ids(llm.generate(prompts, params)) == expected
        assert llm.engine.tiers.disk.flush()
        assert output_token_ids(llm.generate(prompts, params)) == expected
    # The first fault (the next lookup's read, or a write) stops the tier: one error in all.
    errors = [engine_metric(llm, "prefixserve:kv_disk_errors_total", op=op) for op in ("read", "write")]
    assert sum(errors) == 1
    assert engine_metric(llm, "prefixserve:kv_disk_enabled") == 0
    assert len([r for r in caplog.records if "disk tier" in r.getMessage()]) == 1


def test_a_disk_read_never_evicts_a_host_hit_of_the_same_lookup(tmp_path):
    from prefixserve.replica.kv.manager import KVCacheManager
    from prefixserve.replica.kv.tiers import TIER_BLOCK

    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    kv = KVCacheManager(4, block_size=4, num_host_blocks=2, host_tier=True, disk=tier)
    prompt = list(range(100, 113))
    hashes = kv.hasher.hash_blocks(prompt, 4, None)
    for h in hashes[1:]:  # the prompt's second and third blocks are on disk only
        tier.store(h, _payload(0))
    tier.flush()

    def admit(rid: str, tokens: list[int]) -> None:
        blocks, hit = kv.get_computed_blocks(tokens)
        assert kv.allocate_slots(rid, tokens, len(tokens) - hit, blocks) is not None
        kv.take_swap_ops()
        kv.take_tier_ops()
        kv.free(rid)

    admit("a", prompt[:5])  # the first block, computed
    admit("q", list(range(300, 313)))  # evicts it into the host tier
    admit("r", list(range(400, 405)))  # fills the other host slot with one of q's blocks
    assert kv.stats.tiers.num_host_cached_blocks == 2
    blocks, hit = kv.get_computed_blocks(prompt)
    # The first block is a host hit; reading the second from disk takes the other slot, not its.
    assert blocks == [TIER_BLOCK, TIER_BLOCK] and hit == 8
    assert kv.allocate_slots("p", prompt, len(prompt) - hit, blocks) is not None
    assert len(kv.take_tier_ops().host_fills) == 1
    kv.take_swap_ops()
    kv.check_invariants()
    tier.close()


def test_a_save_writes_now_with_its_mtime_and_a_touch_reorders_the_size_bound(tmp_path):
    tier = DiskTier(str(tmp_path / "kv"), 10 * KEY.payload_bytes, KEY)
    try:
        assert tier.save(_hash(1), _payload(1), 1_000_000_000) is True
        path = Path(tier.path) / KEY.file_name(_hash(1))
        assert path.stat().st_mtime_ns == 1_000_000_000 and tier.load(_hash(1)) == _payload(1)
        assert tier.save(_hash(1), _payload(1), 2_000_000_000) is False  # there already: kept, not rewritten
        assert tier.touch(_hash(1), 3_000_000_000) and path.stat().st_mtime_ns == 3_000_000_000
        assert not tier.touch(_hash(2), 3_000_000_000)  # no file
    finally:
        tier.close()


def test_misses_between_listings_leave_nothing_behind(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, KEY)
    for i in range(100):
        assert tier.load(_hash(i)) is None  # the lookups of a replica that never publishes
    assert not tier._added and not tier._gone
    tier.close()


def _with_rope_theta(src: Path, dst: Path, theta: float) -> Path:
    """A checkpoint directory of ``src``'s weight file (linked, the same bytes) and another RoPE theta."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "config.json":
            (dst / item.name).symlink_to(item)
    config = json.loads((src / "config.json").read_text())
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = theta
    config["rope_theta"] = theta
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_one_weight_file_under_another_config_never_reads_the_others_blocks(tmp_path, prompts):
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    params = SamplingParams(**PARAMS_KW)
    first_ckpt = tiny_checkpoint(tmp_path / "m", hidden=64, heads=4, kv_heads=2, seed=5)
    second_ckpt = _with_rope_theta(first_ckpt, tmp_path / "m-theta", 500000.0)
    expected = [
        output_token_ids(LLM(str(c), num_kv_blocks=64).generate(prompts, params)) for c in (first_ckpt, second_ckpt)
    ]
    assert expected[0] != expected[1]  # the theta matters: each other's KV would give wrong tokens
    first = _engine(str(first_ckpt), tmp_path / "kv")
    assert output_token_ids(first.generate(prompts, params)) == expected[0]
    assert first.engine.tiers.disk.flush()
    second = _engine(str(second_ckpt), tmp_path / "kv")
    outs = second.generate(prompts, params)
    assert output_token_ids(outs) == expected[1]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert second.engine.kv_manager.stats.tiers.disk_read_blocks == 0
    assert second.engine.tiers.disk.flush()
    # Each reads its own: a third engine of the first config hits every full block.
    third = _engine(str(first_ckpt), tmp_path / "kv", kv_disk_full_backoff_s=5.0)
    assert third.engine.tiers.disk.full_backoff_s == 5.0
    again = third.generate(prompts, params)
    assert output_token_ids(again) == expected[0] and [o.num_cached_tokens for o in again] == [64, 64, 64]
