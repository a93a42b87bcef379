"""What a long prompt that is tokenized, then refused, leaves behind: nothing.

Two things kept such memory: the tokenizer's native memory in the malloc arena
of whichever worker thread ran it (replica/engine/tokenizer_executor.py: one thread,
freed pages handed back after large prompts), and the refusal's error, held in
a reference cycle with the frames below it (the prompt's token ids among them)
until the cyclic garbage collector ran. The fast tests cover the executor,
glibc's release of freed arena pages (in a child process, so that this one's
malloc settings stay as they are), the engine's use of the executor and the
cycle; the slow one measures a real ``prefixserve replica`` under concurrent
long text prompts.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading
import types

import httpx
import psutil
import pytest
from server_helpers import InProcessReplica, ReplicaProcess, assert_openai_error

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.request_runner import RequestRunner
from prefixserve.replica.engine.tokenizer_executor import TokenizerExecutor, messages_chars
from prefixserve.replica.errors import EngineDeadError, PromptTooLongError

MAX_MODEL_LEN = 4096
# 80,002 tokens in 240,000 characters: under the character bound (MAX_MODEL_LEN x the longest
# vocab string, 81 characters), so it is tokenized before it is refused; the tokenizer needs
# about 40 MB for it.
LONG_TEXT = "lorem " * 40_000


def test_every_call_runs_on_one_thread_and_large_prompts_are_followed_by_a_trim():
    executor = TokenizerExecutor(trim_after_chars=100)

    def where() -> int:
        return threading.get_ident()

    async def main() -> list[int]:
        return list(await asyncio.gather(*(executor.run(where, chars=10) for _ in range(16))))

    try:
        idents = asyncio.run(main())
        assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
        assert executor.num_trims == 0  # small prompts reuse what the arena keeps
        assert asyncio.run(executor.run(where, chars=100)) == idents[0]
        assert executor.num_trims == 1

        def refuse() -> None:
            raise PromptTooLongError("too long")

        with pytest.raises(PromptTooLongError):  # a refusal is trimmed after too, and its error passes through
            asyncio.run(executor.run(refuse, chars=5_000))
        assert executor.num_trims == 2
    finally:
        executor.shutdown()


def test_a_call_after_shutdown_is_an_engine_dead_error_not_a_runtime_error():
    # Front ends answer EngineDeadError 503; the pool's own RuntimeError would be a 500.
    executor = TokenizerExecutor()
    executor.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(executor.run(lambda: None, chars=10))

    def fails() -> None:
        raise RuntimeError("the tokenizer's own error")

    running = TokenizerExecutor()
    try:
        with pytest.raises(RuntimeError, match="the tokenizer's own error"):  # passes through while running
            asyncio.run(running.run(fails, chars=10))
    finally:
        running.shutdown()


def test_trimming_can_be_disabled_and_a_negative_threshold_is_refused():
    executor = TokenizerExecutor(trim_after_chars=0)
    try:
        asyncio.run(executor.run(lambda: None, chars=10**6))
        assert executor.num_trims == 0
    finally:
        executor.shutdown()
    with pytest.raises(ValueError, match="trim_after_chars"):
        TokenizerExecutor(trim_after_chars=-1)


def test_messages_chars_counts_string_contents():
    chat = [{"role": "system", "content": "abc"}, {"role": "user", "content": None}, {"role": "user", "content": "de"}]
    assert messages_chars(chat) == 5
    assert messages_chars([{"role": "user", "content": [{"type": "text", "text": "xyz"}]}]) == 0
    assert messages_chars(None) == 0


RELEASE_CHILD = textwrap.dedent(
    """
    import ctypes, os, threading
    from prefixserve.replica.worker.model_shard import keep_freed_memory_mapped
    from prefixserve.replica.engine.tokenizer_executor import release_freed_memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    assert keep_freed_memory_mapped()  # the replica's setting: freed memory stays mapped
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    fence = []

    def churn():  # 80 MB of small blocks in a worker thread's arena, touched, then freed
        blocks = [libc.malloc(4000) for _ in range(20_000)]
        for b in blocks:
            ctypes.memset(b, 1, 4000)
        # One block allocated after them outlives the work, as a tokenizer's output does: the freed
        # blocks sit in the arena's free lists, not in its top (which only free() past the trim
        # threshold shrinks in a thread's arena).
        fence.append(libc.malloc(4000))
        for b in blocks:
            libc.free(b)

    base = rss()
    t = threading.Thread(target=churn)
    t.start()
    t.join()
    kept = rss()
    released = release_freed_memory()
    print(base, kept, rss(), released)
    """
)


def test_release_freed_memory_hands_a_worker_arenas_freed_pages_back():
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    base, kept, after, released = out.stdout.split()
    base, kept, after = int(base), int(kept), int(after)
    assert kept - base > 60 * 2**20, "the freed blocks were expected to stay resident without a trim"
    assert released == "True"
    assert after - base < 20 * 2**20, f"{(after - base) / 2**20:.1f} MB still resident after the trim"


def test_the_engine_tokenizes_every_request_on_its_tokenizer_thread(ckpt_4096_positions):
    engine = AsyncEngine(EngineConfig(model=ckpt_4096_positions, max_model_len=MAX_MODEL_LEN))
    runner = RequestRunner(engine)
    seen: set[int] = set()
    tokenize = engine.engine.input_processor.tokenize

    def tokenize_and_note(prompt):  # the real tokenizer; the thread it ran on noted
        seen.add(threading.get_ident())
        return tokenize(prompt)

    engine.engine.input_processor.tokenize = tokenize_and_note  # type: ignore[method-assign]

    async def main() -> None:
        requests = [EngineRequest(prompt=f"hello {i}") for i in range(8)]
        await asyncio.gather(*(runner.prepare(r) for r in requests))
        assert engine.tokenizer_executor.num_trims == 0
        with pytest.raises(PromptTooLongError):
            await runner.prepare(EngineRequest(prompt=LONG_TEXT))
        chat = [{"role": "user", "content": LONG_TEXT}]
        with pytest.raises(PromptTooLongError):
            await runner.prepare(EngineRequest(messages=chat))
        assert engine.tokenizer_executor.num_trims == 2

    try:
        asyncio.run(main())
        assert len(seen) == 1 and seen != {threading.get_ident()}
    finally:
        asyncio.run(engine.shutdown())


def test_a_refused_request_leaves_no_reference_cycle(ckpt_4096_positions):
    """The refusal's error and its frames are freed when the answer is sent, not by a later GC pass."""
    replica = InProcessReplica(ckpt_4096_positions, max_model_len=MAX_MODEL_LEN)
    try:
        assert replica.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).is_success
        gc.collect()
        gc.disable()  # so that nothing is collected before it is looked at
        try:
            for path, body in (
                ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1}),
            ):
                answer = replica.request("POST", path, json=body)
                assert assert_openai_error(answer)["code"] == "context_length_exceeded"
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                kept = [o for o in gc.garbage if isinstance(o, (types.FrameType, types.TracebackType, BaseException))]
                big = [len(o) for o in gc.garbage if isinstance(o, list) and len(o) > 10_000]
                gc.set_debug(0)
                gc.garbage.clear()
                assert not kept and not big, (path, [repr(o)[:120] for o in kept[:8]], big)
        finally:
            gc.set_debug(0)
            gc.enable()
    finally:
        replica.close()


# Rounds of concurrent long prompts, each with its own worker thread when threads are per call.
ROUNDS = 3
CONCURRENT = 8
# One tokenization of LONG_TEXT leaves about 39 MB in the arena of the thread that ran it.
GROWTH_BOUND_BYTES = 24 * 1024**2


@pytest.mark.slow
def test_refused_long_text_prompts_do_not_grow_a_replica(ckpt_4096_positions, tmp_path):
    """Concurrent text prompts of 80,002 tokens, tokenized and refused, do not leave their tokenizer memory."""
    with ReplicaProcess(ckpt_4096_positions, "--max-model-len", str(MAX_MODEL_LEN), log_dir=tmp_path) as proc:
        process = psutil.Process(proc.proc.pid)

        async def rounds() -> None:
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=300) as http:
                for i in range(4):  # first-use costs of the completions path, before the baseline
                    assert (await http.post("/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 1})).is_success
                before = process.memory_info().rss
                for _ in range(ROUNDS):
                    answers = await asyncio.gather(
                        *(
                            http.post("/v1/completions", json={"prompt": LONG_TEXT, "max_tokens": 1})
                            for _ in range(CONCURRENT)
                        )
                    )
                    for answer in answers:
                        assert assert_openai_error(answer)["code"] == "context_length_exceeded"
                growth = process.memory_info().rss - before
                print(f"RSS {before / 2**20:.1f} MB, {growth / 2**20:+.1f} MB over {ROUNDS}x{CONCURRENT} refusals")
                assert growth < GROWTH_BOUND_BYTES, f"RSS grew {growth / 2**20:.1f} MB"
                assert (await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})).is_success

        asyncio.run(rounds())
