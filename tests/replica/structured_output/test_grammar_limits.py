"""What a constraint may ask before it is compiled (limits.py), and the compile pool's fairness and
bounds (compile.py): a client's slow schemas cannot hold every worker, the queue is bounded."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from model_helpers import _tokenizer_dir

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.errors import EngineOverloadedError, RequestRejected
from prefixserve.replica.structured_output.compile import CompilePoolConfig, GrammarCache, GrammarQueueFullError
from prefixserve.replica.structured_output.limits import GrammarLimitError, GrammarLimits, repeat_counts
from prefixserve.replica.structured_output.params import StructuredOutputsParams as Params


@pytest.mark.parametrize(
    "text, ebnf, counts",
    [
        ("^a{30000}$", False, [30000]),
        ("[a-z]{3,40}x{5,}y{,7}", False, [40, 5, 7]),
        ("(a{30}b{2}){30}", False, [900, 60]),  # a repeated group multiplies what it holds
        ("((ab){10}){10}", False, [100]),
        (r"\{5000}[{9999}(]\d{4}", False, [4]),  # escaped and in-class braces are text
        ("a{x}b{}c{1,2,3}", False, []),  # not quantifiers
        ("a{99999999999999999999999}", False, [10**9]),  # huge, without int() of the digits
        ('root ::= "a{5000}" [a-z]{3,40} # x{7000}\n', True, [40]),  # EBNF: literals and comments skipped
    ],
)
def test_repeat_counts(text, ebnf, counts):
    assert list(repeat_counts(text, ebnf=ebnf)) == counts


LIMITS = GrammarLimits(max_repeat=1000, max_length=16384)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "string", "pattern": "^a{30000}$"}}, "repeat of 30000 copies"),
        ({"json": {"type": "object", "properties": {"p": {"type": "string", "pattern": "(a{100}){11}"}}}}, "1100"),
        ({"json": {"type": "object", "patternProperties": {"^k{2000}$": {}}}}, "repeat of 2000"),
        ({"json": {"type": "string", "maxLength": 100000}}, "maxLength 100000"),
        ({"json": {"type": "array", "items": {"type": "array", "minItems": 20000}}}, "minItems 20000"),
        ({"regex": "[0-9]{1001}"}, "max_grammar_repeat"),
        ({"grammar": "root ::= [a-z]{5000}"}, "max_grammar_repeat"),
        # Each under the bound, together over its square: the spec as a whole is bounded.
        (
            {"json": {"type": "object", "properties": {f"p{i}": {"pattern": "^a{999}$"} for i in range(4)}}},
            "squared counts",
        ),
    ],
)
def test_over_the_limits_is_refused_naming_the_limit(spec, message):
    with pytest.raises(GrammarLimitError, match=message) as info:
        LIMITS.check(Params(**spec))
    assert isinstance(info.value, RequestRejected)  # a 400 at the front ends


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"type": "string", "pattern": "^a{1000}$"}},
        {"json": {"type": "object", "properties": {f"d{i}": {"pattern": r"^\d{4}-\d{2}-\d{2}$"} for i in range(50)}}},
        {"json": {"type": "string", "maxLength": 16384, "minLength": 1}},
        {"json": {"type": "object", "properties": {"pattern": {"type": "string"}, "maxLength": {"type": "integer"}}}},
        {"regex": r"[a-z]{1,1000}"},
        {"grammar": 'root ::= "x"{1000}'},
        {"choice": ["a{5000}"]},
    ],
)
def test_ordinary_constraints_pass(spec):
    LIMITS.check(Params(**spec))


def test_a_spec_longer_than_the_bound_is_refused_naming_the_knob():
    spec = {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}}
    with pytest.raises(GrammarLimitError, match="max_grammar_spec_chars"):
        GrammarLimits(max_spec_chars=500).check(Params(**spec))
    GrammarLimits(max_spec_chars=5000).check(Params(**spec))


def test_engine_config_knobs_reach_the_cache():
    config = EngineConfig(
        model="x",
        max_grammar_repeat=50,
        max_grammar_length=60,
        max_grammar_spec_chars=70,
        grammar_compile_workers=3,
        grammar_compile_workers_per_client=2,
        grammar_compile_queue_size=5,
        grammar_compile_queue_per_client=1,
    )
    cache = GrammarCache.from_config(lambda: None, config)  # type: ignore[arg-type,return-value]
    try:
        assert cache.limits == GrammarLimits(50, 60, 70)
        assert cache.pool == CompilePoolConfig(3, 2, 5, 1)
    finally:
        cache.close()
    with pytest.raises(ValueError, match="grammar_compile_workers_per_client"):
        EngineConfig(model="x", grammar_compile_workers=2, grammar_compile_workers_per_client=3)
    with pytest.raises(ValueError, match="grammar_compile_queue_per_client"):
        EngineConfig(model="x", grammar_compile_queue_size=2, grammar_compile_queue_per_client=3)


# -- the pool, on the real xgrammar --------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar_backend():
    from transformers import AutoTokenizer

    from prefixserve.replica.structured_output.xgrammar_backend import XGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
    return XGrammarBackend(tokenizer, 49152, [tokenizer.eos_token_id])


def slow_schema(letter: str) -> Params:
    """Just under the default bound: a pattern of 1000 copies (about 0.2 s of xgrammar on two cores)."""
    return Params(json={"type": "string", "pattern": f"^{letter}{{1000}}$"})


class HeldSlowCompiles:
    """The real backend, its compiles of ``slow_schema`` held until released (as compiles that
    take long hold their workers, whatever the machine's speed)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.slow_started: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def compile(self, params: Params) -> object:
        if "{1000}" in params.spec:
            self.slow_started.append(params.spec)
            assert self.release.wait(timeout=600)
        return self.inner.compile(params)  # type: ignore[attr-defined]


def test_a_clients_slow_schemas_leave_a_worker_for_another_client(xgrammar_backend):
    backend = HeldSlowCompiles(xgrammar_backend)
    cache = GrammarCache(lambda: backend, timeout_s=600.0, pool=CompilePoolConfig(max_workers=2))
    done: list[str] = []
    lock = threading.Lock()

    def record(name: str):
        def callback(_):
            with lock:
                done.append(name)

        return callback

    try:
        # Refused at once, before any worker is taken: the four that froze replicas for minutes.
        for letter in "abcd":
            with pytest.raises(GrammarLimitError):
                cache.submit(Params(json={"type": "string", "pattern": f"^{letter}{{30000}}$"}), "attacker")
        slow = [cache.submit(slow_schema(letter), "attacker") for letter in "abcd"]
        for i, future in enumerate(slow):
            future.add_done_callback(record(f"slow{i}"))
        simple = cache.submit(Params(json={"type": "object", "properties": {"ok": {"type": "boolean"}}}), "victim")
        simple.add_done_callback(record("simple"))
        # Compiled while every attacker compile is held: had the attacker taken both workers, this
        # would wait for the release and run out of its (hang-guard) time.
        simple.result(timeout=120)
        with lock:
            assert done == ["simple"], done
        assert len(backend.slow_started) == 1  # the attacker's share: one worker
        backend.release.set()
        concurrent.futures.wait(slow, timeout=600)
        assert done[1:] == ["slow0", "slow1", "slow2", "slow3"] and all(f.exception() is None for f in slow)
    finally:
        backend.release.set()
        cache.close()


class BlockingBackend:
    """Compiles only when released: holds workers as a slow compile does, deterministically."""

    name = "blocking"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []

    def compile(self, params: Params) -> object:
        self.started.append(params.spec)
        assert self.release.wait(timeout=600)
        return object()


def test_the_queue_is_bounded_in_all_and_per_client():
    backend = BlockingBackend()
    pool = CompilePoolConfig(max_workers=2, max_workers_per_client=1, max_queued=3, max_queued_per_client=2)
    cache = GrammarCache(lambda: backend, pool=pool)  # type: ignore[arg-type,return-value]
    try:
        a = [cache.submit(Params(regex=f"a{i}"), "a") for i in range(3)]  # one runs, two wait
        with pytest.raises(GrammarQueueFullError, match="grammar_compile_queue_per_client") as info:
            cache.submit(Params(regex="a3"), "a")
        assert isinstance(info.value, EngineOverloadedError) and info.value.retry_after_s >= 1  # 429 + Retry-After
        b = cache.submit(Params(regex="b0"), "b")  # takes the second worker at once
        c = cache.submit(Params(regex="c0"), "c")  # waits: the queue now holds 3
        with pytest.raises(GrammarQueueFullError, match="grammar_compile_queue_size"):
            cache.submit(Params(regex="d0"), "d")
        # The same spec joins its compile: no queue slot needed.
        assert cache.submit(Params(regex="a1"), "d") is a[1]
        backend.release.set()
        concurrent.futures.wait([*a, b, c], timeout=600)
        assert all(f.exception() is None for f in (*a, b, c))
        # Served in turn: a's first, b's, then c's before a's second and third (round robin).
        assert backend.started[:2] == ["a0", "b0"] and backend.started.index("c0") < backend.started.index("a2")
        cache.submit(Params(regex="d0"), "d").result(timeout=600)
    finally:
        backend.release.set()
        cache.close()


def test_the_front_end_names_the_client_by_key_digest_or_address():
    from starlette.requests import Request

    from prefixserve.replica.entrypoints.openai.http_frontend import FrontendOptions, client_identity

    def request(auth: str | None, host: str = "10.0.0.7") -> Request:
        headers = [(b"authorization", auth.encode())] if auth is not None else []
        return Request({"type": "http", "headers": headers, "client": (host, 5000)})

    keyed = FrontendOptions.build(["k1", "k2"], 1 << 20)
    one, two = client_identity(request("Bearer k1"), keyed), client_identity(request("Bearer k2"), keyed)
    assert one and two and one != two and "k1" not in one
    assert client_identity(request("Bearer k1", host="10.0.0.8"), keyed) == one  # a key's share, from anywhere
    open_server = FrontendOptions.build(None, 1 << 20)
    assert client_identity(request(None), open_server) == "addr:10.0.0.7"
    assert client_identity(request(None, host="10.0.0.8"), open_server) != "addr:10.0.0.7"
