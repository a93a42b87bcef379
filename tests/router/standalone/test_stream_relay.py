"""The standalone router's relay of a movable stream (router/standalone/stream_relay.py): whole events
only, in any chunking, progress comments taken out and counted, the stopping replica's error held
back, a malformed comment making the stream unmovable."""

from __future__ import annotations

import json
import random

from prefixserve.replica.contract.continuation import SHUTTING_DOWN_CODE, progress_comment
from prefixserve.router.migration import StreamProgress
from prefixserve.router.standalone.stream_relay import ProgressRelay


def data(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + "\n\n"


def answer() -> tuple[str, str]:
    """A replica's answer with progress comments, and what the client must get of it."""
    events = [
        data(""),  # the role delta: no tokens, no comment
        progress_comment([1, 2], 3, prompt_tokens=9, answer_id="chatcmpl-7") + data("abc"),
        progress_comment([3], 0) + "\n",  # held-back text: a comment-only event
        progress_comment([4, 5], 4, ["call_1"]) + data("defg"),
        "data: [DONE]\n\n",
    ]
    client = data("") + data("abc") + data("defg") + "data: [DONE]\n\n"
    return "".join(events), client


def test_every_chunking_gives_the_client_the_same_whole_events_and_the_same_count():
    raw, client = answer()
    rng = random.Random(5)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(0, 12)))
        pieces = [raw[a:b].encode() for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        relay = ProgressRelay(StreamProgress())
        out = b""
        for piece in pieces:
            got = relay.feed(piece)
            assert not got or got.endswith(b"\n\n"), "half an event reached the client"
            out += got
        assert out.decode() == client, trial
        p = relay.progress
        assert (p.token_ids, p.chars, p.call_ids, p.num_prompt_tokens, p.answer_id) == (
            [1, 2, 3, 4, 5],
            7,
            ["call_1"],
            9,
            "chatcmpl-7",
        )
        assert relay.valid and not relay.stopping and not relay.pending


def test_the_stopping_replicas_error_is_held_back_and_ends_the_relay():
    error = {"error": {"message": "stopping", "type": "server_error", "param": None, "code": SHUTTING_DOWN_CODE}}
    raw = progress_comment([1], 1, prompt_tokens=3, answer_id="x") + data("a") + f"data: {json.dumps(error)}\n\n"
    relay = ProgressRelay(StreamProgress())
    out = relay.feed(raw.encode()) + relay.feed(b"data: [DONE]\n\n")
    assert out.decode() == data("a") and relay.stopping
    other = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": "x"}}
    relay = ProgressRelay(StreamProgress())
    assert relay.feed(f"data: {json.dumps(other)}\n\n".encode()) == f"data: {json.dumps(other)}\n\n".encode()
    assert not relay.stopping  # any other error is the client's to see


def test_a_malformed_comment_makes_the_stream_unmovable_and_is_still_taken_out():
    relay = ProgressRelay(StreamProgress())
    out = relay.feed(b": progress {not json\n" + data("a").encode())
    assert out == data("a").encode() and not relay.valid
    out = relay.feed((progress_comment([2], 1) + data("b")).encode())
    assert out == data("b").encode() and relay.progress.token_ids == []
