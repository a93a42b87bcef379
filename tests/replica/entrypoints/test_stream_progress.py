"""A replica's stream over HTTP, continued on another replica (replica/contract/continuation.py):
the progress comments a front end asks for count exactly what the client got, and a request with
``prefixserve_continuation`` built from the comments of a cut stream gives the rest of it, under the
same answer id, with no role delta or echo again. Chat and completions; the refusals."""

from __future__ import annotations

import json

import pytest

from prefixserve.replica.contract.continuation import (
    CONTINUATION_FIELD,
    PROGRESS_COMMENT,
    STREAM_PROGRESS_HEADER,
    parse_progress,
)

REPLICA_OPTIONS = {"max_model_len": 512}
PROGRESS = {STREAM_PROGRESS_HEADER: "1"}
CHAT = {
    "messages": [{"role": "user", "content": "Say something long."}],
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stop": ["\u2603" * 40],  # never met: 39 characters are held back, so the first events bring no text
}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}


def events(text: str) -> list[tuple[list[dict], dict | None]]:
    """Each SSE event as (its progress comments, its data JSON or None)."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line]
        if not lines:
            continue
        notes = [parse_progress(line) for line in lines if line.startswith(PROGRESS_COMMENT)]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        out.append((notes, json.loads(data[0]) if data and data[0] != "[DONE]" else None))
    return out


def piece(event: dict | None) -> str:
    if event is None or not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def stream(replica, path: str, body: dict, headers: dict | None = None) -> list[tuple[list[dict], dict | None]]:
    r = replica.request("POST", path, json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return events(r.text)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_progress_counts_what_the_client_got_and_a_continuation_gives_the_rest(replica, path, body):
    plain = stream(replica, path, body)
    assert not any(notes for notes, _ in plain), "comments only when asked for"
    whole = stream(replica, path, {**body, "stream_options": {"include_usage": True}}, PROGRESS)
    text = "".join(piece(e) for _, e in whole)
    assert text == "".join(piece(e) for _, e in plain)
    notes = [n for ns, _ in whole for n in ns]
    last = [e for _, e in whole if e is not None][-1]
    assert notes[0]["prompt"] > 0 and notes[0]["id"] == last["id"]
    assert sum(len(n["ids"]) for n in notes) == last["usage"]["completion_tokens"] == 40
    assert sum(n["chars"] for n in notes) == len(text)
    held = [e for ns, e in whole if ns and e is None]
    if path == "/v1/chat/completions":
        assert held, "no comment-only event: the stop string held nothing back"
    for cut in (3, len(whole) // 2, len(whole) - 3):
        sent = whole[:cut]
        sent_notes = [n for ns, _ in sent for n in ns]
        continuation = {
            "id": notes[0]["id"],
            "output_token_ids": [t for n in sent_notes for t in n["ids"]],
            "emitted_chars": sum(n["chars"] for n in sent_notes),
            "num_prompt_tokens": notes[0]["prompt"],
        }
        rest = stream(replica, path, {**body, CONTINUATION_FIELD: continuation}, PROGRESS)
        data = [e for _, e in rest if e is not None]
        assert all(e["id"] == notes[0]["id"] for e in data)
        assert not any((e["choices"][0].get("delta") or {}).get("role") for e in data if e["choices"])
        assert "".join(piece(e) for _, e in sent) + "".join(piece(e) for _, e in rest) == text, f"cut {cut}"


def test_an_echoed_completion_is_not_echoed_again(replica):
    body = {**COMPLETION, "echo": True}
    whole = stream(replica, "/v1/completions", body, PROGRESS)
    assert piece(whole[0][1]) == "Once upon a time"
    notes = [n for ns, _ in whole for n in ns]
    sent = [n for ns, _ in whole[:4] for n in ns]
    continuation = {
        "id": notes[0]["id"],
        "output_token_ids": [t for n in sent for t in n["ids"]],
        "emitted_chars": sum(n["chars"] for n in sent),
        "num_prompt_tokens": notes[0]["prompt"],
    }
    rest = stream(replica, "/v1/completions", {**body, CONTINUATION_FIELD: continuation})
    assert "".join(piece(e) for _, e in whole[:4]) + "".join(piece(e) for _, e in rest) == "".join(
        piece(e) for _, e in whole
    )


@pytest.mark.parametrize(
    "change, status, code",
    [
        ({"stream": False}, 400, None),
        ({"n": 2, "temperature": 0.8}, 400, None),
        (
            {CONTINUATION_FIELD: {"id": "x", "output_token_ids": [1], "emitted_chars": 0, "num_prompt_tokens": 3}},
            400,
            "continuation_mismatch",
        ),
        (
            {CONTINUATION_FIELD: {"id": "x", "output_token_ids": [-1], "emitted_chars": 0, "num_prompt_tokens": 3}},
            400,
            None,
        ),
        (
            {
                CONTINUATION_FIELD: {
                    "id": "x",
                    "output_token_ids": [1],
                    "emitted_chars": 0,
                    "num_prompt_tokens": 3,
                    "extra": 1,
                }
            },
            400,
            None,
        ),
    ],
    ids=["not-streamed", "several-sequences", "prompt-length", "bad-token", "unknown-key"],
)
def test_a_continuation_that_cannot_be_taken_is_a_400(replica, change, status, code):
    good = {"id": "chatcmpl-x", "output_token_ids": [5, 6], "emitted_chars": 0, "num_prompt_tokens": 1}
    body = {**CHAT, CONTINUATION_FIELD: good, **change}
    r = replica.request("POST", "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code
