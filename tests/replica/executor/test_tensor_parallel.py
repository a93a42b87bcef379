"""Tensor-parallel engines on CPU (gloo): same greedy tokens as one process, 1/N of the KV
cache per rank, loud and clean failure (replica/executor/tensor_parallel.py, tp_worker.py).

The random Llama checkpoint has 8 query heads and 2 KV heads, so TP 2 splits KV heads
and TP 4 replicates them (one per rank, each on two ranks); SmolLM2 (9 query heads,
3 KV heads) runs at TP 3.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import ReplicaProcess

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.errors import EngineDeadError
from prefixserve.replica.executor.tensor_parallel import WorkerGroup
from prefixserve.replica.executor.tp_protocol import parse_swap_message, swap_message
from prefixserve.replica.model.layers import TPGroup
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.worker.step_inputs import StepInputs, unpack_step_inputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def shared_prefix_prompts(count: int, prefix_len: int = 24, tail_len: int = 6) -> list[list[int]]:
    """Prompts sharing one prefix (prefix hits) with distinct tails."""
    prefix = [(37 * i + 11) % 4000 + 100 for i in range(prefix_len)]
    return [prefix + [(53 * i + 7 * j) % 4000 + 100 for j in range(tail_len)] for i in range(count)]


def pid_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (an orphan's zombie may wait for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]


# --- pure pieces -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv_heads, size, expected",
    [
        (8, 2, [(4, 0), (4, 4)]),
        (2, 2, [(1, 0), (1, 1)]),
        (2, 4, [(1, 0), (1, 0), (1, 1), (1, 1)]),  # replicated: ranks 0-1 hold head 0, ranks 2-3 head 1
        (3, 3, [(1, 0), (1, 1), (1, 2)]),
        (1, 4, [(1, 0)] * 4),
    ],
)
def test_kv_heads_are_split_or_replicated_so_each_rank_holds_its_query_heads_kv_head(kv_heads, size, expected):
    assert [TPGroup(r, size).kv_heads(kv_heads) for r in range(size)] == expected
    heads = 8 * size  # any query-head count that splits: each rank's query heads use its KV head
    for rank, (count, first) in enumerate(expected):
        group = heads // kv_heads
        q_heads = range(rank * heads // size, (rank + 1) * heads // size)
        assert {q // group for q in q_heads} <= set(range(first, first + count))


@pytest.mark.parametrize("kv_heads, size", [(3, 2), (2, 3), (6, 4)])
def test_kv_heads_that_neither_split_nor_replicate_evenly_are_refused(kv_heads, size):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TPGroup(0, size).kv_heads(kv_heads)


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(gqa_ckpt):
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        LLM(str(gqa_ckpt), num_kv_blocks=16, tensor_parallel_size=3)


def _send_then_wait(conn, sent, release) -> None:
    conn.send((16, 0))
    sent.set()
    release.wait(30)


def _fail_at_start(conn) -> None:
    conn.send(RuntimeError("rank 1 failed to start: no weights"))
    os._exit(1)


def _group_of(target, *args) -> tuple[WorkerGroup, multiprocessing.connection.Connection]:
    """A WorkerGroup over one forked process running ``target(child_end, *args)``."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, *args), daemon=True)
    proc.start()
    group = WorkerGroup.__new__(WorkerGroup)
    group.conns, group.procs, group._dead = [parent_end], [proc], None
    return group, parent_end


def test_a_hand_shake_message_sent_while_the_group_joins_is_left_for_the_next_collect():
    # A worker that finished joining may send its next reply before rank 0's join returns.
    ctx = multiprocessing.get_context("fork")
    sent, release = ctx.Event(), ctx.Event()
    group, conn = _group_of(_send_then_wait, sent, release)
    try:
        assert group.wait_while("joining the group", lambda: sent.wait(30) and time.sleep(0.5)) is None
        assert conn.recv() == (16, 0)
    finally:
        release.set()
        group.procs[0].join(10)


def test_a_worker_that_fails_while_the_group_joins_raises_its_own_error():
    group, _ = _group_of(_fail_at_start)
    with pytest.raises(RuntimeError, match="no weights"):
        group.wait_while("joining the group", lambda: time.sleep(30))
    group.procs[0].join(10)


def test_step_inputs_and_swap_messages_survive_packing():
    inputs = StepInputs(
        input_ids=torch.tensor([5, 6, 7, 8, 9]),
        positions=torch.tensor([0, 1, 2, 7, 8]),
        slot_mapping=torch.tensor([0, 1, 2, 23, 24]),
        block_tables=torch.tensor([[0, -1, 0], [3, 4, 5]], dtype=torch.int32),
        seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        sample_rows=torch.tensor([2, 4, 4]),
        copy_ops=torch.tensor([[1, 2], [3, 6]]),
    )
    back = unpack_step_inputs(inputs.pack())
    for name in inputs.__dataclass_fields__:
        assert torch.equal(getattr(back, name), getattr(inputs, name)), name
        assert getattr(back, name).dtype == getattr(inputs, name).dtype, name
    with pytest.raises(ValueError, match="header"):
        unpack_step_inputs(inputs.pack()[:-1])
    out_ops, in_ops = [(3, 0), (9, 1)], [(2, 5)]
    assert parse_swap_message(swap_message(out_ops, in_ops)) == (out_ops, in_ops)


# --- engines -------------------------------------------------------------------------------

KNOBS = dict(block_size=4, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=16)


def run_engine(checkpoint: str, prompts: list[list[int]], **knobs) -> tuple[list[list[int]], object, list]:
    with LLM(str(checkpoint), **knobs) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        return outputs, llm.engine.stats(), llm.engine.runner.rank_memory


@pytest.fixture(scope="module")
def tp1_reference(gqa_ckpt):
    return run_engine(gqa_ckpt, shared_prefix_prompts(6), **KNOBS)


@pytest.mark.parametrize("size", [2, 4])
def test_greedy_tokens_equal_one_process_under_prefix_hits_chunked_prefill_and_preemption(
    gqa_ckpt, tp1_reference, size
):
    expected, reference_stats, _ = tp1_reference
    got, stats, _ = run_engine(gqa_ckpt, shared_prefix_prompts(6), tensor_parallel_size=size, **KNOBS)
    assert got == expected
    # The workload did exercise what it claims to: prefix hits and preemption (16 blocks of 4
    # tokens for 6 sequences of ~42 tokens; 16-token steps chunk the 30-token prompts).
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert (stats.prefix_cache_hits, stats.num_preemptions) == (
        reference_stats.prefix_cache_hits,
        reference_stats.num_preemptions,
    )


def test_sampling_parameters_and_prompt_logprobs_at_tp2_equal_one_process(gqa_ckpt):
    # Sampling stays on rank 0; prompt_logprobs read the extra LM-head rows every rank computes.
    prompts = shared_prefix_prompts(4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=3, repetition_penalty=0.5),
        SamplingParams(temperature=1.0, seed=7, max_tokens=8, presence_penalty=-1.5, min_p=0.05, n=2),
        SamplingParams(temperature=0.0, max_tokens=8, bad_words=["a"], allowed_token_ids=list(range(100, 400))),
        SamplingParams(temperature=0.8, seed=9, max_tokens=8, frequency_penalty=-2.0, top_p=1e-300),
    ]

    def run(**knobs):
        with LLM(str(gqa_ckpt), **KNOBS, **knobs) as llm:
            return llm.generate(prompts, params)

    one, two = run(), run(tensor_parallel_size=2)
    assert [[c.token_ids for c in o.outputs] for o in two] == [[c.token_ids for c in o.outputs] for o in one]
    got, want = two[0].prompt_logprobs, one[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(prompts[0]) and got[0] is None
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("size, kv_share", [(2, 2), (4, 2)])  # TP 4 replicates 2 KV heads: half each, not a quarter
def test_each_rank_holds_its_share_of_the_kv_cache_for_the_same_block_count(gqa_ckpt, tp1_reference, size, kv_share):
    _, _, (whole,) = tp1_reference
    _, _, ranks = run_engine(gqa_ckpt, shared_prefix_prompts(1), tensor_parallel_size=size, **KNOBS)
    assert [m.rank for m in ranks] == list(range(size))
    for memory in ranks:
        assert memory.num_blocks == whole.num_blocks
        assert memory.kv_cache * kv_share == whole.kv_cache
        assert memory.weights < whole.weights


def test_block_count_is_the_minimum_any_rank_can_hold_under_a_per_rank_memory_budget(gqa_ckpt):
    budget = 64 * 1024
    with LLM(str(gqa_ckpt), kv_cache_memory_bytes=budget) as one:
        whole = one.engine.runner.num_blocks
    with LLM(str(gqa_ckpt), kv_cache_memory_bytes=budget, tensor_parallel_size=2) as two:
        # The budget is per rank (vLLM's kv_cache_memory_bytes is per GPU) and each rank's
        # blocks are half as large: twice the blocks.
        assert two.engine.runner.num_blocks == 2 * whole
        assert two.engine.stats().num_kv_blocks == 2 * whole


async def test_killing_a_worker_mid_stream_fails_the_request_and_the_engine_for_good(gqa_ckpt):
    engine = AsyncEngine(EngineConfig(model=str(gqa_ckpt), tensor_parallel_size=2, num_kv_blocks=300))
    pids = engine.engine.runner.worker_pids
    assert len(pids) == 1 and pid_alive(pids[0])
    stream = engine.generate([101, 102, 103] * 4, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    await stream.__anext__()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="dead"):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError, match="prefixserve-tp1"):
        engine.check_health()
    assert not engine.is_running
    with pytest.raises(EngineDeadError):  # no restart: new requests are refused (503 over HTTP)
        await engine.generate([101], GREEDY).__anext__()
    await engine.shutdown()
    assert wait_gone(pids) == []


DRIVER = textwrap.dedent("""
    import os, signal, sys
    # Ctrl-C raises KeyboardInterrupt even when this test runs in the background of a shell
    # without job control, whose children start with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams
    llm = LLM(sys.argv[1], num_kv_blocks=64, tensor_parallel_size=int(sys.argv[2]))
    print(" ".join(map(str, llm.engine.runner.worker_pids)), flush=True)
    if sys.argv[3] == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # serve until interrupted
        llm.generate([[101, 102, 103]], SamplingParams(temperature=0.0, max_tokens=8))
""")


@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_no_worker_outlives_a_driver_that_crashes_or_is_interrupted(gqa_ckpt, how):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(gqa_ckpt), "2", how], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and all(pid_alive(p) for p in pids)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert wait_gone(pids) == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_smollm2_at_tp3_gives_tp1s_greedy_tokens():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM("smollm2", num_kv_blocks=128) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM("smollm2", num_kv_blocks=128, tensor_parallel_size=3) as three:
        assert [m.num_kv_heads for m in three.engine.runner.rank_memory] == [1, 1, 1]
        assert [o.outputs[0].token_ids for o in three.generate(prompts, params)] == expected


# --- the standalone server (real HTTP) -------------------------------------------------------


def worker_children(pid: int) -> list[int]:
    """Live children of ``pid`` named like tensor-parallel workers (tp_worker sets the name)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
            ppid = int(fields[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and name.startswith("prefixserve-tp"):
            found.append(int(stat.parent.name))
    return [p for p in found if pid_alive(p)]


@pytest.mark.slow
def test_a_tp_server_answers_then_a_killed_worker_gets_503_and_a_nonzero_exit(gqa_ckpt, tmp_path):
    with ReplicaProcess(gqa_ckpt, "--tensor-parallel-size", "2", "--num-kv-blocks", "64", log_dir=tmp_path) as replica:
        (worker,) = worker_children(replica.proc.pid)
        ok = httpx.post(f"{replica.base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200, ok.text
        os.kill(worker, signal.SIGKILL)
        health = None
        deadline = time.monotonic() + 60
        while replica.returncode is None and time.monotonic() < deadline:
            try:
                health = httpx.get(f"{replica.base_url}/health", timeout=5).status_code
            except httpx.HTTPError:
                pass  # the server stopped after the dead engine was noticed
            if health == 503:
                break
            time.sleep(0.2)
        assert health == 503 or replica.returncode not in (None, 0), replica.log_tail()
        replica.proc.wait(timeout=60)
        assert replica.returncode != 0
        assert "prefixserve-tp1" in replica.log_tail(20000)


@pytest.mark.slow
def test_stopping_a_tp_server_stops_its_workers(gqa_ckpt, tmp_path):
    with ReplicaProcess(gqa_ckpt, "--tensor-parallel-size", "2", "--num-kv-blocks", "64", log_dir=tmp_path) as replica:
        workers = worker_children(replica.proc.pid)
        assert len(workers) == 1
    # uvicorn shuts down gracefully on SIGTERM (the engine stops its workers), then
    # re-raises the signal so the exit status still says SIGTERM.
    assert replica.returncode in (0, -signal.SIGTERM), replica.log_tail()
    assert wait_gone(workers) == []


def test_swap_preemption_moves_every_ranks_shard_and_keeps_tp1s_tokens(gqa_ckpt):
    knobs = dict(KNOBS, preemption_mode="swap", swap_space_gb=0.001)
    prompts = shared_prefix_prompts(6)
    with LLM(str(gqa_ckpt), **knobs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(str(gqa_ckpt), tensor_parallel_size=2, **knobs) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)]
        swapped = two.engine._swap_totals()
    assert got == expected
    assert swapped.swap_preemptions > 0 and swapped.swapped_in_blocks > 0


def test_calculated_fp8_scales_are_taken_over_every_ranks_heads(gqa_ckpt):
    knobs = dict(num_kv_blocks=32, kv_cache_dtype="fp8", calculate_kv_scales=True)
    prompt = shared_prefix_prompts(1)
    with LLM(str(gqa_ckpt), **knobs) as one:
        one.generate(prompt, GREEDY)
        expected = one.engine.runner.model.kv_scales
    with LLM(str(gqa_ckpt), tensor_parallel_size=2, **knobs) as two:
        two.generate(prompt, GREEDY)
        got = two.engine.runner.model.kv_scales
    # Rank 0 alone holds half the KV heads: without the all-reduce its amax could be lower.
    flat = [s for pair in got for s in pair]
    assert flat == pytest.approx([s for pair in expected for s in pair], rel=1e-5)
