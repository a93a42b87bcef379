"""replica/entrypoints/openai/response_store.py: the bounded store of /v1/responses (pure, fast)."""

from __future__ import annotations

import pytest

from prefixserve.replica.entrypoints.openai.response_store import ResponseStore, StoredResponse


def entry(response_id: str, owner: str | None = None, text: str = "hi", replica: str | None = None) -> StoredResponse:
    response = {"id": response_id, "object": "response", "output_text": text}
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
    return StoredResponse.build(response_id, response, conversation, owner=owner, replica=replica)


def test_an_entry_keeps_its_response_conversation_owner_and_replica():
    store = ResponseStore()
    assert store.put(entry("resp_a", owner="tenant:acme", text="é", replica="app#Engine#rank-1"))
    got = store.get("resp_a", "tenant:acme")
    assert got is not None
    assert got.response() == {"id": "resp_a", "object": "response", "output_text": "é"}
    assert got.conversation() == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "é"}]
    assert got.replica == "app#Engine#rank-1"
    # The size counts the UTF-8 bytes of both JSON texts.
    assert got.size == len(got.response_json) + len(got.conversation_json)
    assert store.entries == 1 and store.bytes == got.size


def test_the_count_bound_drops_the_least_recently_used_first():
    store = ResponseStore(max_entries=2)
    store.put(entry("resp_1"))
    store.put(entry("resp_2"))
    assert store.get("resp_1", None) is not None  # a lookup is a use: resp_2 is now the oldest
    store.put(entry("resp_3"))
    assert store.get("resp_2", None) is None
    assert store.get("resp_1", None) is not None and store.get("resp_3", None) is not None
    assert store.entries == 2


def test_the_byte_bound_drops_entries_until_the_new_one_fits():
    one = entry("resp_1")
    store = ResponseStore(max_bytes=2 * one.size + one.size // 2)
    store.put(one)
    store.put(entry("resp_2"))
    assert store.bytes == 2 * one.size
    store.put(entry("resp_3"))
    assert store.get("resp_1", None) is None
    assert store.entries == 2 and store.bytes == 2 * one.size <= store.max_bytes


def test_an_entry_larger_than_the_byte_bound_is_not_stored_and_drops_nothing():
    small = entry("resp_small")
    store = ResponseStore(max_bytes=small.size + 10)
    assert store.put(small)
    big = entry("resp_big", text="x" * 100)
    assert not store.put(big)
    assert store.get("resp_big", None) is None
    assert store.get("resp_small", None) is not None and store.bytes == small.size


def test_another_owner_finds_nothing_and_cannot_delete_or_replace():
    store = ResponseStore()
    store.put(entry("resp_a", owner="key:aaaa"))
    for other in ("key:bbbb", "tenant:acme", None):
        assert store.get("resp_a", other) is None
        assert not store.delete("resp_a", other)
    # A put of the same id by another owner (a reused client request id) stores nothing.
    assert not store.put(entry("resp_a", owner="key:bbbb", text="theirs"))
    mine = store.get("resp_a", "key:aaaa")
    assert mine is not None and mine.response()["output_text"] == "hi"
    # Its own owner replaces it.
    assert store.put(entry("resp_a", owner="key:aaaa", text="again"))
    again = store.get("resp_a", "key:aaaa")
    assert again is not None and again.response()["output_text"] == "again"
    assert store.entries == 1 and store.bytes == again.size


def test_delete_removes_the_entry_and_its_bytes():
    store = ResponseStore()
    store.put(entry("resp_a"))
    assert store.delete("resp_a", None)
    assert store.get("resp_a", None) is None and store.entries == 0 and store.bytes == 0
    assert not store.delete("resp_a", None)


def test_bounds_of_zero_store_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(max_entries=0)
    assert not store.put(entry("resp_a")) and store.entries == 0
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError):
            ResponseStore(max_entries=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            ResponseStore(max_bytes=bad)  # type: ignore[arg-type]
