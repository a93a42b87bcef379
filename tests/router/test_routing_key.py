"""Contract 1: the routing key of a request (router/routing_key.py)."""

from __future__ import annotations

import hashlib
import random
import string
import struct

import pytest

from prefixserve.router.routing_key import (
    PREFIX_HASH_HEADER,
    InvalidPrefixHash,
    LowerCaseHeaders,
    PrefixKeyConfig,
    prefix_hash,
    prompt_cache_key_hash,
    routing_key,
    static_prefix,
)


def _text(rng: random.Random, n: int) -> str:
    alphabet = string.ascii_letters + string.digits + " .,;:\n\t" + "éß中文😀"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _seed_snippet(system_msg: str) -> str:
    # The seed article's client-side snippet, verbatim in spirit.
    return hashlib.sha256(system_msg.encode()).hexdigest()[:16]


def test_single_system_message_equals_seed_snippet():
    rng = random.Random(101)
    for _ in range(50):
        system = _text(rng, rng.randint(1, 300))
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": _text(rng, 20)}]}
        key = routing_key(body)
        assert key == _seed_snippet(system) == prefix_hash(system)
        assert len(key) == 16 and all(c in "0123456789abcdef" for c in key)


def test_user_turns_do_not_change_the_key():
    rng = random.Random(102)
    system = _text(rng, 80)
    keys = {
        routing_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": _text(rng, 40)}]})
        for _ in range(10)
    }
    assert len(keys) == 1


def test_cache_salt_goes_first_with_a_zero_byte():
    rng = random.Random(103)
    system, salt = _text(rng, 64), _text(rng, 12)
    expected = hashlib.sha256(salt.encode() + b"\x00" + system.encode()).hexdigest()[:16]
    body = {"messages": [{"role": "system", "content": system}], "cache_salt": salt}
    assert routing_key(body) == expected == prefix_hash(system, salt)
    assert routing_key(body) != prefix_hash(system)
    # An empty salt is still a salt: it differs from no salt.
    assert prefix_hash(system, "") != prefix_hash(system)


def test_leading_system_and_developer_messages_joined_by_newline():
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "not leading: ignored"},
        ]
    }
    assert static_prefix(body["messages"]) == "You are terse.\nAnswer in French."
    assert routing_key(body) == _seed_snippet("You are terse.\nAnswer in French.")


def test_content_parts_join_text_parts():
    parts = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]
    body = {"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "q"}]}
    assert routing_key(body) == _seed_snippet("Part one.\nPart two.")
    # The same text as a plain string gives the same key.
    plain = {"messages": [{"role": "system", "content": "Part one.\nPart two."}]}
    assert routing_key(plain) == routing_key(body)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"text": "no type"},
        {"type": "text"},
        {"type": "text", "text": 5},
        "a bare string",
    ],
)
def test_non_text_parts_are_refused_as_the_api_refuses_them(part):
    """A static message with any part the OpenAI front end refuses has no key: ValueError, never a partial key."""
    from prefixserve.replica.entrypoints.openai import protocol as api
    from prefixserve.replica.errors import BadRequestError

    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Part one."}, part]},
        {"role": "user", "content": "q"},
    ]
    with pytest.raises(ValueError, match="content part"):
        routing_key({"messages": messages})
    with pytest.raises(BadRequestError):
        api.validate_request(api.ChatCompletionRequest, {"messages": messages})
    # Parts after the static prefix are the API's business only: the key ignores them.
    later = [{"role": "system", "content": "s"}, {"role": "user", "content": [part]}]
    assert routing_key({"messages": later}) == prefix_hash("s")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "hello"}, {"role": "system", "content": "late"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
        [],
    ],
)
def test_no_static_prefix_means_no_affinity(messages):
    assert routing_key({"messages": messages}) is None


def test_header_wins_over_body():
    body = {"messages": [{"role": "system", "content": "abc"}], "cache_salt": "s"}
    assert routing_key(body, {PREFIX_HASH_HEADER: "client-key-1"}) == "client-key-1"
    # Header names are case-insensitive in HTTP.
    assert routing_key(body, {"x-prefix-hash": "k2"}) == "k2"
    assert routing_key(body, {"X-PREFIX-HASH": "k3"}) == "k3"
    # Without a static prefix the header still gives affinity.
    assert routing_key({"messages": [{"role": "user", "content": "q"}]}, {PREFIX_HASH_HEADER: "k4"}) == "k4"
    # Other headers are ignored.
    assert routing_key(body, {"Authorization": "Bearer x"}) == prefix_hash("abc", "s")
    # A router may choose to ignore client headers.
    assert routing_key(body, {PREFIX_HASH_HEADER: "k"}, PrefixKeyConfig(honor_header=False)) == prefix_hash("abc", "s")


def test_lower_case_headers_keep_the_first_of_a_repeated_header_and_key_as_any_mapping_does():
    raw = [(b"Host", b"h"), (b"X-Prefix-Hash", b"first"), (b"x-prefix-hash", b"second"), (b"accept", b"*/*")]
    headers = LowerCaseHeaders.from_raw(raw)
    assert headers == {"host": "h", "x-prefix-hash": "first", "accept": "*/*"}
    body = {"messages": [{"role": "system", "content": "abc"}]}
    assert routing_key(body, headers) == "first"
    assert routing_key(body, LowerCaseHeaders.from_raw([(b"accept", b"*/*")])) == prefix_hash("abc")
    # Looked up by the lower-case name alone: a name put in with capitals is not an HTTP header here.
    assert routing_key(body, LowerCaseHeaders({PREFIX_HASH_HEADER: "k"})) == prefix_hash("abc")


@pytest.mark.parametrize("size", [10, 32 * 1024, 32 * 1024 + 1, 200_000])
def test_keys_are_sha256_whether_or_not_the_payload_is_memoized(size):
    text = _text(random.Random(size), size)
    for salt in (None, "tenant-a", "tenant-b"):
        expected = hashlib.sha256(((salt + "\x00") if salt is not None else "").encode() + text.encode())
        for _ in range(2):  # the second from the memo where the payload is small enough for it
            assert prefix_hash(text, salt) == expected.hexdigest()[:16]


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "ctl\x01", "é-non-ascii", "x" * 129])
def test_bad_header_rejected(bad):
    body = {"messages": [{"role": "system", "content": "abc"}]}
    with pytest.raises(InvalidPrefixHash, match=PREFIX_HASH_HEADER):
        routing_key(body, {PREFIX_HASH_HEADER: bad})


def test_header_length_bound_is_configurable():
    body = {"messages": []}
    assert routing_key(body, {PREFIX_HASH_HEADER: "x" * 128}) == "x" * 128
    with pytest.raises(InvalidPrefixHash):
        routing_key(body, {PREFIX_HASH_HEADER: "x" * 9}, PrefixKeyConfig(max_header_len=8))


def test_completions_prompt_hashes_first_n_characters():
    rng = random.Random(104)
    cfg = PrefixKeyConfig(completion_prefix_chars=32)
    head = _text(rng, 32)
    a = routing_key({"prompt": head + _text(rng, 50)}, config=cfg)
    b = routing_key({"prompt": head + _text(rng, 50)}, config=cfg)
    assert a == b == prefix_hash(head)
    # Shorter prompts hash whole; the default N is 256.
    assert routing_key({"prompt": "short"}) == prefix_hash("short")
    long = _text(rng, 400)
    assert routing_key({"prompt": long}) == prefix_hash(long[:256])
    # A batch routes by its first prompt; salt applies.
    assert routing_key({"prompt": ["first", "second"], "cache_salt": "t"}) == prefix_hash("first", "t")
    assert routing_key({"prompt": ""}) is None


def test_completions_token_ids():
    ids = list(range(1000, 1300))
    expected = hashlib.sha256(struct.pack("<256I", *ids[:256])).hexdigest()[:16]
    assert routing_key({"prompt": ids}) == expected
    assert routing_key({"prompt": [ids]}) == expected
    with pytest.raises(ValueError, match="token ids"):
        routing_key({"prompt": [-1, 2]})


def test_malformed_bodies_raise_value_error():
    with pytest.raises(ValueError, match="messages must be a list"):
        routing_key({"messages": "hello"})
    with pytest.raises(ValueError, match="content"):
        routing_key({"messages": [{"role": "system", "content": 42}]})
    with pytest.raises(ValueError, match="cache_salt"):
        routing_key({"messages": [{"role": "system", "content": "x"}], "cache_salt": 5})
    with pytest.raises(ValueError, match="completion_prefix_chars"):
        PrefixKeyConfig(completion_prefix_chars=0)


def test_body_without_messages_or_prompt_has_no_key():
    assert routing_key({"model": "m"}) is None


# -- multi-turn affinity (opt-in) ----------------------------------------------------------


def _conversation(system: str, turns: list[str]) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def test_multi_turn_keys_are_off_by_default():
    body = {"messages": _conversation("sys", ["hi", "hello", "more"])}
    assert routing_key(body, {"X-Session-Id": "s1"}) == prefix_hash("sys")


def test_session_header_keys_each_conversation_and_keeps_it():
    config = PrefixKeyConfig(session_header=True)
    first = routing_key({"messages": _conversation("sys", ["hi"])}, {"x-session-id": "s1"}, config)
    later = routing_key({"messages": _conversation("sys", ["hi", "a", "b"])}, {"X-Session-Id": "s1"}, config)
    other = routing_key({"messages": _conversation("sys", ["hi"])}, {"X-Session-Id": "s2"}, config)
    assert first == later != other
    assert first == hashlib.sha256(b"sys\x00session:s1").hexdigest()[:16]
    # No header: the plain key; the X-Prefix-Hash header still wins.
    assert routing_key({"messages": _conversation("sys", ["hi"])}, {}, config) == prefix_hash("sys")
    assert (
        routing_key({"messages": _conversation("sys", ["hi"])}, {"X-Session-Id": "s1", "X-Prefix-Hash": "abc"}, config)
        == "abc"
    )


def test_key_turns_extends_the_key_with_the_conversations_leading_turns():
    config = PrefixKeyConfig(key_turns=1)
    opening = routing_key({"messages": _conversation("sys", ["question one"])}, {}, config)
    later = routing_key({"messages": _conversation("sys", ["question one", "answer", "two"])}, {}, config)
    other = routing_key({"messages": _conversation("sys", ["another user"])}, {}, config)
    assert opening == later != other
    assert opening == hashlib.sha256(b"sys\x00question one").hexdigest()[:16]
    assert opening != prefix_hash("sys")
    # Fewer turns than key_turns: the plain key.
    two = PrefixKeyConfig(key_turns=2)
    assert routing_key({"messages": _conversation("sys", ["q"])}, {}, two) == prefix_hash("sys")
    with pytest.raises(ValueError, match="key_turns"):
        PrefixKeyConfig(key_turns=-1)


def test_prompt_cache_key_is_the_key_when_present():
    system = "You are a support agent for ACME."
    by_prefix = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    keyed = {**by_prefix, "prompt_cache_key": "customer-42"}
    expected = hashlib.sha256(b"\x00prompt_cache_key:customer-42").hexdigest()[:16]
    assert routing_key(keyed) == expected == prompt_cache_key_hash("customer-42")
    assert routing_key(keyed) != routing_key(by_prefix)
    # Another system prompt, the same cache key: one key (the client's grouping wins).
    other = {"messages": [{"role": "system", "content": "Other."}], "prompt_cache_key": "customer-42"}
    assert routing_key(other) == routing_key(keyed)
    # No static prefix at all still routes by the cache key; completions too.
    assert routing_key({"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": "k"}) == (
        prompt_cache_key_hash("k")
    )
    assert routing_key({"prompt": "abc", "prompt_cache_key": "k"}) == prompt_cache_key_hash("k")
    # The salt goes first, as for every key; the header still wins; an empty key is no key.
    salted = {**keyed, "cache_salt": "s"}
    assert routing_key(salted) == prompt_cache_key_hash("customer-42", "s") != routing_key(keyed)
    assert routing_key(keyed, {PREFIX_HASH_HEADER: "explicit"}) == "explicit"
    assert routing_key({**by_prefix, "prompt_cache_key": ""}) == routing_key(by_prefix)
    # The tag keeps a cache key apart from a system prompt of the same text.
    assert prompt_cache_key_hash("x") != prefix_hash("prompt_cache_key:x") != prefix_hash("x")
    with pytest.raises(ValueError, match="prompt_cache_key"):
        routing_key({**by_prefix, "prompt_cache_key": 7})


def test_an_adapters_requests_get_a_key_of_their_own() -> None:
    import hashlib

    from prefixserve.router.routing_key import adapter_key

    body = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]}
    base = routing_key(body)
    assert base is not None
    key = routing_key(body, adapter="support-v2")
    assert (
        key
        == hashlib.sha256(b"\x00lora:support-v2\x00" + base.encode()).hexdigest()[:16]
        == adapter_key(base, "support-v2")
    )
    assert key != base and key != routing_key(body, adapter="support-v3")
    # Without a static prefix the adapter alone keys it: its requests share its replicas.
    bare = {"messages": [{"role": "user", "content": "hi"}]}
    assert routing_key(bare) is None
    assert routing_key(bare, adapter="support-v2") == hashlib.sha256(b"\x00lora:support-v2\x00").hexdigest()[:16]
    # The header is the client's own key, used as sent.
    assert routing_key(body, {"X-Prefix-Hash": "abc"}, adapter="support-v2") == "abc"
