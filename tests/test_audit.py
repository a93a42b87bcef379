"""The prefix-cache audit on crafted prompt logs (SmolLM2's real tokenizer, loaded once)."""

from __future__ import annotations

import json
import random
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
        A.read_log(empty)
    with pytest.raises(A.AuditError, match="no such file"):
        A.read_log(tmp_path / "missing.jsonl")
    with pytest.raises(A.AuditError, match="is a directory"):
        A.read_log(tmp_path)
    bad = _write(tmp_path / "bad.jsonl", ["nope", "{}"])
    with pytest.raises(A.AuditError, match="line 1"):
        A.read_log(bad)
    assert cli_main(["audit", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err


def test_cli_human_and_json(tmp_path, tok, capsys) -> None:
    from prefixserve.loadtest.workloads import VolatileSystemPromptConfig, volatile_system_prompt, write_jsonl

    path = tmp_path / "vol.jsonl"
    write_jsonl(volatile_system_prompt(VolatileSystemPromptConfig(num_requests=30, system_prompt_len=40, deploy_every=10, seed=5)), path)
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
