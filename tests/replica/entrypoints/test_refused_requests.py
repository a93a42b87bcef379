"""Hostile clients: refused requests keep nothing and cost little, client errors log as such.

The fast tests run the real front end and a tiny engine in this process
(``InProcessReplica``); the slow one measures a real ``prefixserve replica``
process's RSS across refused requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle

import httpx
import psutil
import pytest
from server_helpers import ReplicaProcess, assert_openai_error, metric

from prefixserve.replica.engine.bounded_memo import ENTRY_OVERHEAD_BYTES, BoundedMemo
from prefixserve.replica.engine.input_processor import min_message_tokens
from prefixserve.replica.entrypoints.openai import protocol as api
from prefixserve.replica.errors import OverloadedError, PromptTooLongError

MAX_MODEL_LEN = 128
API_KEY = "sk-hostile"
AUTH = {"authorization": f"Bearer {API_KEY}"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# conftest's replica: an InProcessReplica on the shared ckpt, with these options.
REPLICA_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, api_keys=[API_KEY], replica_name="refusals")


def empty_chat(n: int, role: str = "system") -> list[dict[str, str]]:
    return [{"role": role, "content": ""}] * n


def test_the_message_bound_comes_from_the_template_and_is_sound(replica):
    engine = replica.engine.engine
    per_message = engine.input_processor.min_message_tokens
    assert per_message > 0 and engine.input_processor.max_messages == MAX_MODEL_LEN // per_message
    tokenizer = replica.engine.tokenizer
    # Every chat of n messages, in any roles, renders at least n * per_message tokens.
    for n in (1, 2, 7, 30):
        for i, role in enumerate(ROLES):
            mixed = [{"role": ROLES[(i + k) % len(ROLES)], "content": ""} for k in range(n)]
            for chat in (empty_chat(n, role), mixed):
                ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
                assert len(ids) >= n * per_message, (role, n, len(ids))
    # One message more than the bound allows is refused; exactly the bound is not refused by it.
    engine.input_processor.check_messages_size(empty_chat(engine.input_processor.max_messages))
    with pytest.raises(PromptTooLongError, match="messages"):
        engine.input_processor.check_messages_size(empty_chat(engine.input_processor.max_messages + 1))


def test_a_template_that_renders_empty_messages_as_nothing_gives_no_bound(replica):
    class SkipsEmpty:
        chat_template = "{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %}{% endfor %}"

        def apply_chat_template(self, messages, **kwargs):
            return replica.engine.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    assert min_message_tokens(SkipsEmpty()) == 0


def test_many_empty_messages_are_refused_before_validation_and_rendering(replica, monkeypatch):
    rendered = []
    processor = replica.engine.engine.input_processor
    real = processor.encode_chat
    monkeypatch.setattr(processor, "encode_chat", lambda m, **kw: rendered.append(len(m)) or real(m, **kw))
    validated = []
    real_validate = api.validate_request
    monkeypatch.setattr(api, "validate_request", lambda cls, data: validated.append(1) or real_validate(cls, data))
    for role in ("system", "user"):
        chat = [*empty_chat(100_000, role), {"role": "user", "content": "unique"}]
        answer = replica.request(
            "POST", "/v1/chat/completions", headers=AUTH, content=json.dumps({"messages": chat, "max_tokens": 1})
        )
        error = assert_openai_error(answer)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    assert rendered == [] and validated == []


def test_a_refused_chat_leaves_no_memo_and_admitted_ones_are_memoized(replica):
    engine = replica.engine.engine.input_processor
    engine._static_prefix_ids.clear()
    # Few messages, few characters, but more tokens than fit: refused only once rendered.
    system = " ".join(["x1"] * 200)
    too_long = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}], "max_tokens": 1}
    refused = replica.request("POST", "/v1/chat/completions", headers=AUTH, json=too_long)
    assert assert_openai_error(refused)["code"] == "context_length_exceeded"
    assert len(engine._static_prefix_ids) == 0 and engine._static_prefix_ids.nbytes == 0
    ok = replica.request(
        "POST",
        "/v1/chat/completions",
        headers=AUTH,
        json={
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}],
            "max_tokens": 1,
        },
    )
    assert ok.status_code == 200, ok.text
    assert len(engine._static_prefix_ids) == 1
    scraped = metric(replica.request("GET", "/metrics").text, "prefixserve:request_cache_bytes", cache="static_prefix")
    assert scraped == engine._static_prefix_ids.nbytes > 0


def test_the_memo_is_bounded_by_bytes_least_recently_used_out_first():
    memo: BoundedMemo[str] = BoundedMemo(max_bytes=10 * (100 + ENTRY_OVERHEAD_BYTES), max_entries=1000)
    for i in range(30):
        assert memo.put(i, f"v{i}", 100)
        assert memo.nbytes <= memo.max_bytes
    assert len(memo) == 10 and memo.get(29) == "v29" and memo.get(19) is None
    memo.get(20)  # now the most recently used: survives the next insert, 21 does not
    memo.put("new", "x", 100)
    assert memo.get(20) == "v20" and memo.get(21) is None
    # One entry over a quarter of the bound is not stored (it would flush the others).
    assert not memo.put("huge", "x", memo.max_bytes) and memo.get("huge") is None and len(memo) == 10
    memo.clear()
    assert (len(memo), memo.nbytes) == (0, 0)
    counted: BoundedMemo[int] = BoundedMemo(max_bytes=10**9, max_entries=3)
    for i in range(5):
        counted.put(i, i, 1)
    assert len(counted) == 3


def test_the_kv_event_memo_is_bounded_in_bytes_and_reports_its_size():
    from prefixserve.replica.contract.kv_events import KVEventPublisher

    publisher = KVEventPublisher(max_keys=8, max_blocks_per_key=4)
    assert publisher.nbytes == 0
    sizes = []
    for i in range(100):
        publisher.remember("k" * 128 + f"{i:03d}", [bytes([i % 256]) * 16] * 50)
        sizes.append(publisher.nbytes)
    assert sizes[0] > 0 and max(sizes) == sizes[-1] == sizes[8] and len(publisher) == 8


def test_a_too_long_token_id_prompt_names_the_prompt(replica):
    for prompt in ([17] * (MAX_MODEL_LEN + 1), [17] * (MAX_MODEL_LEN - 2)):
        answer = replica.request("POST", "/v1/completions", headers=AUTH, json={"prompt": prompt, "max_tokens": 8})
        error = assert_openai_error(answer)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt"), error
    chat = replica.request(
        "POST",
        "/v1/chat/completions",
        headers=AUTH,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN},
    )
    assert assert_openai_error(chat)["param"] == "messages"


def test_concurrent_requests_with_the_same_request_id_all_succeed(replica):
    body = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        return await asyncio.gather(
            *(
                replica.http.post("/v1/completions", json=body, headers={**AUTH, "x-request-id": "same-id"})
                for _ in range(4)
            )
        )

    answers = replica.loop.run_until_complete(main())
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert {a.headers["x-request-id"] for a in answers} == {"same-id"}
    assert {a.json()["id"] for a in answers} == {"cmpl-same-id"}


def test_openapi_schema_needs_the_api_key(replica):
    assert assert_openai_error(replica.request("GET", "/openapi.json"))["code"] == "invalid_api_key"
    schema = replica.request("GET", "/openapi.json", headers=AUTH)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    for path in ("/docs", "/redoc"):
        assert replica.request("GET", path).status_code == 404


def test_a_client_gone_while_its_body_is_read_logs_one_info_line(replica, caplog):
    """The client sends half its body, then disconnects: 499, one info line, no error, no traceback."""
    events = [{"type": "http.request", "body": b'{"prompt": "x", ', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", AUTH["authorization"].encode()),
            (b"x-request-id", b"gone-1"),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 5),
        "server": ("replica", 80),
    }
    with caplog.at_level(logging.INFO, logger="prefixserve"):
        replica.loop.run_until_complete(replica.app(scope, receive, send))
    assert sent[0]["status"] == 499
    mine = [r for r in caplog.records if r.name.startswith("prefixserve") and "gone-1" in r.getMessage()]
    assert len(mine) == 1 and mine[0].levelno == logging.INFO and mine[0].exc_info is None, mine
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_client_errors_log_one_info_line_with_the_request_id(replica, caplog):
    with caplog.at_level(logging.INFO, logger="prefixserve"):
        answer = replica.request(
            "POST",
            "/v1/chat/completions",
            headers={**AUTH, "x-request-id": "long-1"},
            json={"messages": [{"role": "user", "content": "x " * 400}], "max_tokens": 1},
        )
    assert assert_openai_error(answer)["code"] == "context_length_exceeded"
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "long-1" in refused[0].getMessage(), refused
    assert refused[0].levelno == logging.INFO and refused[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stream_error_crosses_ray_as_plain_fields():
    """What an engine replica sends instead of raising a client error (replica/entrypoints/serve/deployment.py)."""
    from prefixserve.replica.contract.stream import StreamError

    err = api.error_from_exception(PromptTooLongError("too long", param="prompt"))
    item = pickle.loads(pickle.dumps(StreamError.of(err)))
    again = item.to_api_error()
    assert (again.status_code, again.code, again.param, again.message) == (
        400,
        "context_length_exceeded",
        "prompt",
        "too long",
    )
    assert again.body() == err.body()
    overloaded = StreamError.of(OverloadedError("full", retry_after_s=2.0)).to_api_error()
    assert (overloaded.status_code, overloaded.error_type, overloaded.headers()) == (
        429,
        "rate_limit_error",
        {"Retry-After": "2"},
    )
    assert pickle.loads(pickle.dumps(PromptTooLongError("x", param="prompt"))).param == "prompt"


# -- a real replica process -------------------------------------------------------------------

# Refused requests measured, after WARMUP ones (allocator arenas, first-use imports).
REFUSED = 10
WARMUP = 2
# RSS growth allowed over REFUSED requests: each one leaked about 17 MB (170 MB in all).
GROWTH_BOUND_BYTES = 40 * 1024**2


@pytest.mark.slow
def test_refused_huge_chats_do_not_grow_a_replica(ckpt, tmp_path):
    """100,000 empty system messages plus a unique one (3.5 MB), refused, ten times over.

    The unique system message makes every request's static prefix new (a memo keyed by it
    would grow by one entry of about 17 MB each time).
    """
    with ReplicaProcess(ckpt, "--max-model-len", str(MAX_MODEL_LEN), log_dir=tmp_path) as proc:
        process = psutil.Process(proc.proc.pid)
        with httpx.Client(base_url=proc.base_url, timeout=120) as http:

            def refuse(i: int) -> None:
                chat = [
                    *empty_chat(100_000),
                    {"role": "system", "content": f"unique {i} " + "y" * 1000},
                    {"role": "user", "content": "q"},
                ]
                answer = http.post(
                    "/v1/chat/completions",
                    content=json.dumps({"messages": chat, "max_tokens": 1}),
                    headers={"content-type": "application/json"},
                )
                assert assert_openai_error(answer)["code"] == "context_length_exceeded"

            for i in range(WARMUP):
                refuse(i)
            before = process.memory_info().rss
            for i in range(REFUSED):
                refuse(WARMUP + i)
            growth = process.memory_info().rss - before
            print(f"RSS {before / 2**20:.1f} MB, +{growth / 2**20:.1f} MB over {REFUSED} refused requests")
            assert growth < GROWTH_BOUND_BYTES, f"RSS grew {growth / 2**20:.1f} MB over {REFUSED} refused requests"
            cache = metric(http.get("/metrics").text, "prefixserve:request_cache_bytes", cache="static_prefix")
            assert cache == 0
            assert http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).status_code == 200
        log = proc.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]
