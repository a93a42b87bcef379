"""The prefix-cache audit on crafted prompt logs (SmolLM2's real tokenizer, loaded once)."""

from __future__ import annotations

import json
import random
import tracemalloc
import uuid

import pytest

from prefixserve.router import audit as A
from prefixserve.router.cli import main as cli_main


@pytest.fixture(scope="module")
def tok():
    return A.load_tokenizer("smollm2")


def _write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def _chat(system: str, user: str = "What now?") -> dict:
    return {"model": "smollm2", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


BASE = "You are an assistant specialising in cloud infrastructure. Answer briefly and cite the runbook."


def _kinds(report: A.AuditReport) -> set[str]:
    return {f.kind for f in report.findings}


def test_timestamp_found_with_its_fix(tmp_path, tok) -> None:
    rng = random.Random(1)
    recs = [_chat(f"Current date: 2026-06-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{i:02d}. {BASE}")
            for i in range(12)]
    report = A.audit_file(_write(tmp_path / "ts.jsonl", recs), tok, prefix_tokens=64)
    assert _kinds(report) == {"timestamp"}
    (f,) = report.findings
    assert f.records == 12 and f.distinct_values == 12 and f.breaks_cache
    assert "user message" in f.fix
    # the timestamp sits right after "Current date:" in the rendered prompt
    rendered = A.render(A.parse_record(recs[0], 1), tok)
    assert f.first_token_position == len(tok.encode(rendered[: rendered.index("2026")], add_special_tokens=False))
    assert report.unique_prefixes == 12 and report.theoretical_hit_rate == 0.0
    assert report.divergence is not None and report.divergence.position > f.first_token_position


def test_uuid_found_with_its_fix(tmp_path, tok) -> None:
    rng = random.Random(2)
    recs = [_chat(f"{BASE}\nSession: {uuid.UUID(int=rng.getrandbits(128), version=4)}") for _ in range(6)]
    report = A.audit_file(_write(tmp_path / "uuid.jsonl", recs), tok)
    assert _kinds(report) == {"uuid"}
    assert report.findings[0].distinct_values == 6
    assert "metadata" in report.findings[0].fix


def test_version_and_user_id_found_with_their_fixes(tmp_path, tok) -> None:
    recs = [_chat(f"[v2.{i // 3}.1] {BASE}") for i in range(9)]
    report = A.audit_file(_write(tmp_path / "v.jsonl", recs), tok)
    assert _kinds(report) == {"version"}
    assert report.findings[0].distinct_values == 3 and "registry" in report.findings[0].fix
    assert report.unique_prefixes == 3 and report.theoretical_hit_rate == pytest.approx(1 - 3 / 9)

    recs = [_chat(f"User ID: cust-{i % 4:04d}. {BASE}") for i in range(8)]
    report = A.audit_file(_write(tmp_path / "u.jsonl", recs), tok)
    assert _kinds(report) == {"user_id"}
    assert report.findings[0].distinct_values == 4 and "first message of the history" in report.findings[0].fix


def test_reordered_fewshots_found_with_their_fix(tmp_path, tok) -> None:
    shots = [f"Q: how do I restart service {n}?\nA: run the restart runbook for {n}." for n in ("api", "db", "cache")]
    rng = random.Random(3)
    recs = []
    for _ in range(10):
        order = shots[:]
        rng.shuffle(order)
        recs.append(_chat("Examples:\n" + "\n".join(order) + "\n\n" + BASE))
    report = A.audit_file(_write(tmp_path / "fs.jsonl", recs), tok)
    assert _kinds(report) == {"reordered_fewshots"}
    f = report.reordered_fewshots
    assert f is not None and f.records == 10 and f.distinct_values == len({r["messages"][0]["content"] for r in recs})
    assert "same order" in f.fix and f.breaks_cache
    # the same examples in one fixed order are not flagged
    fixed = [_chat("Examples:\n" + "\n".join(shots) + "\n\n" + BASE, user=f"q{i}") for i in range(10)]
    assert A.audit_file(_write(tmp_path / "fixed.jsonl", fixed), tok, prefix_tokens=48).findings == []


def test_constant_date_is_reported_as_harmless(tmp_path, tok) -> None:
    recs = [_chat(f"Knowledge cutoff: 2024-01-01. {BASE}", user=f"question {i}") for i in range(5)]
    report = A.audit_file(_write(tmp_path / "c.jsonl", recs), tok, prefix_tokens=32)
    (f,) = report.findings
    assert f.kind == "date" and f.distinct_values == 1 and not f.breaks_cache
    assert report.unique_prefixes == 1 and report.theoretical_hit_rate == pytest.approx(0.8)
    assert report.divergence is None


def test_unique_prefixes_hit_rate_and_divergence_exact(tmp_path, tok) -> None:
    systems = ["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
               "alpha beta omega delta epsilon zeta eta theta iota kappa lambda mu",
               "alpha beta sigma delta epsilon zeta eta theta iota kappa lambda mu"]
    counts = [4, 3, 3]
    rng = random.Random(4)
    recs = [_chat(s, user=f"question {rng.random()}") for s, c in zip(systems, counts) for _ in range(c)]
    rng.shuffle(recs)
    path = _write(tmp_path / "u.jsonl", recs)
    prefix_tokens = 12
    report = A.audit_file(path, tok, prefix_tokens=prefix_tokens)
    assert report.num_records == 10
    assert report.unique_prefixes == 3
    assert report.theoretical_hit_rate == pytest.approx(0.7)
    assert report.most_common_prefix_share == pytest.approx(0.4)
    rendered = A.render(A.parse_record(_chat(systems[0]), 1), tok)
    expected_pos = len(tok.encode(rendered[: rendered.index(" gamma")], add_special_tokens=False))
    assert expected_pos < prefix_tokens
    d = report.divergence
    assert d is not None and d.position == expected_pos and d.count == 6 and d.num_diverging == 6
    assert d.token_text.strip() == "gamma"


class WordTokenizer:
    """Whitespace tokenizer without a chat template (the audit takes anything with ``encode``)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def test_cacheable_token_rate_exact() -> None:
    prompts = ["a b c d e f g h x1", "a b c d e f g h x2", "a b c d z z z z"]
    records = [A.parse_record({"prompt": p}, i + 1) for i, p in enumerate(prompts)]
    report = A.audit(records, WordTokenizer(), prefix_tokens=12, block_size=4)
    # p2 hits both blocks; p3 hits block 0 only (its second block holds its last token)
    assert report.cacheable_token_rate == pytest.approx((0 + 8 + 4) / (9 + 9 + 8))
    assert report.unique_prefixes == 3 and report.theoretical_hit_rate == 0.0
    assert report.divergence is not None and report.divergence.position in (4, 8)


def test_malformed_lines_reported_by_number(tmp_path, tok) -> None:
    lines = [_chat(BASE, "q1"), "{not json", {"model": "x"}, _chat(BASE, "q2"), {"messages": "hello"},
             "", [1, 2], {"prompt": "a completions prompt"}]
    report = A.audit_file(_write(tmp_path / "m.jsonl", lines), tok)
    assert [m.line for m in report.malformed] == [2, 3, 5, 7]
    assert "invalid JSON" in report.malformed[0].reason
    assert "no 'messages' or 'prompt'" in report.malformed[1].reason
    assert report.num_records == 3
    text = A.format_report(report)
    assert "skipped line 2" in text and "skipped line 7" in text


def test_empty_unreadable_and_all_malformed_files_are_errors(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(A.AuditError, match="empty"):
        A.audit_file(empty, WordTokenizer())
    with pytest.raises(A.AuditError, match="no such file"):
        A.audit_file(tmp_path / "missing.jsonl", WordTokenizer())
    with pytest.raises(A.AuditError, match="is a directory"):
        A.audit_file(tmp_path, WordTokenizer())
    bad = _write(tmp_path / "bad.jsonl", ["nope", "{}"])
    with pytest.raises(A.AuditError, match="line 1"):
        A.audit_file(bad, WordTokenizer())
    assert cli_main(["audit", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err
    assert cli_main(["audit", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_human_and_json(tmp_path, tok, capsys) -> None:
    from prefixserve.loadtest.workloads import VolatileSystemPromptConfig, volatile_system_prompt, write_jsonl

    path = tmp_path / "vol.jsonl"
    config = VolatileSystemPromptConfig(num_requests=30, system_prompt_len=40, deploy_every=10, seed=5)
    write_jsonl(volatile_system_prompt(config), path)
    assert cli_main(["audit", str(path), "--json", "--prefix-tokens", "256"]) == 0
    data = json.loads(capsys.readouterr().out)
    kinds = {f["kind"]: f for f in data["volatile"]}
    assert set(kinds) == {"timestamp", "user_id", "version"}
    assert data["reordered_fewshots"]["kind"] == "reordered_fewshots"
    assert all(f["breaks_cache"] for f in kinds.values())
    assert data["num_records"] == 30 and data["prefix_tokens"] == 256
    assert cli_main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Theoretical hit rate" in out and "fix:" in out and "Most frequent divergence at position" in out


# ------------------------------------------------------------- hostile and large logs


class CharTokenizer:
    """One token per character: no vocabulary that grows with the log (for memory measurements)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_each_kind_of_bad_line_is_counted_and_skipped(tmp_path) -> None:
    good = json.dumps(_chat(BASE, "q")).encode()
    lines = [
        good,                                                    # 1
        b'{"messages": [{"role": "system", "content": "caf\xe9"}]}',  # 2: latin-1 byte, not UTF-8
        b"{not json",                                            # 3
        b"[" * 5_000 + b"]" * 5_000,                             # 4: nested past the recursion limit
        b'{"prompt": "' + b"x" * 30_000 + b'"}',                 # 5: longer than the limit below
        b"",                                                     # 6: blank, not an error
        json.dumps({"model": "x"}).encode(),                     # 7
        json.dumps({"messages": [{"role": "system", "content": "s"}], "cache_salt": 5}).encode(),  # 8
        good,                                                    # 9
    ]
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join(lines))  # the last line has no newline
    report = A.audit_file(path, WordTokenizer(), max_line_bytes=20_000)
    assert report.num_records == 2
    assert report.num_malformed == 6
    reasons = {m.line: m.reason for m in report.malformed}
    assert sorted(reasons) == [2, 3, 4, 5, 7, 8]
    assert "UTF-8" in reasons[2]
    assert "invalid JSON" in reasons[3]
    assert "nested too deeply" in reasons[4]
    assert "longer than 20000 bytes" in reasons[5]
    assert "no 'messages' or 'prompt'" in reasons[7]
    assert "cache_salt" in reasons[8]


def test_malformed_list_is_capped_but_every_line_is_counted(tmp_path) -> None:
    lines = ["{bad"] * 150 + [_chat(BASE)]
    report = A.audit_file(_write(tmp_path / "many.jsonl", lines), WordTokenizer())
    assert report.num_malformed == 150 and len(report.malformed) == A.MAX_REPORTED_MALFORMED
    assert [m.line for m in report.malformed] == list(range(1, 101))
    assert "and 50 more malformed lines" in A.format_report(report)


def test_static_prefix_and_routing_keys_come_from_the_router(tmp_path) -> None:
    from prefixserve.router.prefix import prefix_hash, routing_key, static_prefix

    dev = {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]}
    recs = [
        {"messages": [{"role": "system", "content": BASE}, dev, {"role": "user", "content": "a"}]},
        {"messages": [{"role": "system", "content": BASE}, dev, {"role": "user", "content": "b"}],
         "cache_salt": "tenant-2"},
        {"messages": [{"role": "user", "content": "no system"}]},
    ]
    record = A.parse_record(recs[0], 1)
    assert record.system == static_prefix(recs[0]["messages"]) == BASE + "\nbe\nbrief"
    assert record.key == routing_key(recs[0]) == prefix_hash(BASE + "\nbe\nbrief")
    assert A.parse_record(recs[1], 2).key == prefix_hash(BASE + "\nbe\nbrief", "tenant-2")
    report = A.audit_file(_write(tmp_path / "keys.jsonl", recs), WordTokenizer())
    assert report.unique_routing_keys == 2 and report.num_without_routing_key == 1
    assert "Routing keys (X-Prefix-Hash): 2 distinct; 1 prompt(s) without a static prefix" in A.format_report(report)


def _log(path, n: int, pool: int | None) -> str:
    """``n`` chat records; questions drawn from a pool of ``pool`` (None: every one distinct)."""
    rng = random.Random(7)
    with open(path, "w") as f:
        for i in range(n):
            q = rng.randrange(pool) if pool else i
            f.write(json.dumps(_chat(f"Tenant {q % 5}. {BASE}", f"question number {q}")) + "\n")
    return str(path)


def _peak(path: str, **kwargs) -> tuple[int, A.AuditReport]:
    tracemalloc.start()
    try:
        report = A.audit_file(path, CharTokenizer(), prefix_tokens=256, block_size=16, **kwargs)
        return tracemalloc.get_traced_memory()[1], report
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_number_of_records(tmp_path) -> None:
    _peak(_log(tmp_path / "warm.jsonl", 100, pool=50))  # one-time costs (imports, regex caches) out of the way
    small_peak, small = _peak(_log(tmp_path / "2k.jsonl", 2_000, pool=50))
    large_peak, large = _peak(_log(tmp_path / "20k.jsonl", 20_000, pool=50))
    assert small.num_records == 2_000 and large.num_records == 20_000
    assert large.unique_prefixes == small.unique_prefixes == 50 and not large.approximate
    # Ten times the records, the same distinct prefixes: the same memory, not ten times it.
    assert large_peak < 1.5 * small_peak


def test_memory_is_bounded_by_the_limits_when_every_prompt_differs(tmp_path) -> None:
    # Small enough that the 2k-record log already fills every limit.
    limits = A.AuditLimits(max_prefixes=200, max_blocks=1_000, max_values=100, max_layouts=100)
    small_peak, small = _peak(_log(tmp_path / "2k.jsonl", 2_000, pool=None), limits=limits)
    large_peak, large = _peak(_log(tmp_path / "20k.jsonl", 20_000, pool=None), limits=limits)
    assert large.approximate and large.unique_prefixes == 20_000  # past the limit each counts as new
    assert "tracking limit was reached" in A.format_report(large)
    assert large_peak < 1.5 * small_peak


def test_an_overlong_line_is_never_held_whole(tmp_path) -> None:
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(_chat(BASE)).encode() + b"\n")
        f.write(b'{"prompt": "' + b"y" * (24 << 20) + b'"}\n')
        f.write(json.dumps(_chat(BASE, "again")).encode() + b"\n")
    peak, report = _peak(str(path), max_line_bytes=1 << 16)
    assert report.num_records == 2 and [m.line for m in report.malformed] == [2]
    assert peak < 4 << 20  # the 24 MB line went by in bounded chunks


def test_progress_bar_goes_to_stderr(tmp_path, capsys) -> None:
    path = _log(tmp_path / "p.jsonl", 50, pool=5)
    records = list(A.iter_log(path, progress=True))
    assert len(records) == 50
    captured = capsys.readouterr()
    assert "audit" in captured.err and captured.out == ""
