"""The prefix-cache audit on crafted prompt logs (SmolLM2's real tokenizer, loaded once)."""

from __future__ import annotations

import json
import random
import re
import tracemalloc
import uuid
from re import _constants as RC  # the parsed form of a pattern, for its shape
from re import _parser as RP

import pytest

from prefixserve.loadtest import prompt_audit as A
from prefixserve.router.cli import main as cli_main
from prefixserve.router.cli.common import EXIT_SKIPPED


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
    recs = [
        _chat(f"Current date: 2026-06-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{i:02d}. {BASE}")
        for i in range(12)
    ]
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
    systems = [
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
        "alpha beta omega delta epsilon zeta eta theta iota kappa lambda mu",
        "alpha beta sigma delta epsilon zeta eta theta iota kappa lambda mu",
    ]
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
    lines = [
        _chat(BASE, "q1"),
        "{not json",
        {"model": "x"},
        _chat(BASE, "q2"),
        {"messages": "hello"},
        "",
        [1, 2],
        {"prompt": "a completions prompt"},
    ]
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
        good,  # 1
        b'{"messages": [{"role": "system", "content": "caf\xe9"}]}',  # 2: latin-1 byte, not UTF-8
        b"{not json",  # 3
        b"[" * 5_000 + b"]" * 5_000,  # 4: nested past the recursion limit
        b'{"prompt": "' + b"x" * 30_000 + b'"}',  # 5: longer than the limit below
        b"",  # 6: blank, not an error
        json.dumps({"model": "x"}).encode(),  # 7
        json.dumps({"messages": [{"role": "system", "content": "s"}], "cache_salt": 5}).encode(),  # 8
        good,  # 9
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
    from prefixserve.router.routing_key import prefix_hash, routing_key, static_prefix

    dev = {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]}
    recs = [
        {"messages": [{"role": "system", "content": BASE}, dev, {"role": "user", "content": "a"}]},
        {
            "messages": [{"role": "system", "content": BASE}, dev, {"role": "user", "content": "b"}],
            "cache_salt": "tenant-2",
        },
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


# ------------------------------------------------------- linear time, bad text, exit status
# Linearity is shown by counting work, never by timing it: regex scans per detector,
# comparisons between span offsets, characters handed to the tokenizer, and the
# shape of every detector pattern (what makes a backtracking regex super-linear).

_CATEGORY_PATTERNS = {
    RC.CATEGORY_DIGIT: r"\d",
    RC.CATEGORY_NOT_DIGIT: r"\D",
    RC.CATEGORY_SPACE: r"\s",
    RC.CATEGORY_NOT_SPACE: r"\S",
    RC.CATEGORY_WORD: r"\w",
    RC.CATEGORY_NOT_WORD: r"\W",
}
# Latin, a few non-ASCII spaces, digits and letters: enough to tell the patterns' classes apart.
_ALPHABET = frozenset(map(chr, range(0x250))) | frozenset("\u00a0\u2003\u3000\u0663\u4e00")
_REPEATS = (RC.MAX_REPEAT, RC.MIN_REPEAT, RC.POSSESSIVE_REPEAT)


def _chars(item, icase: bool, first_only: bool) -> frozenset[str]:
    """The characters ``item`` (a parsed regex node) can match: its first one only, or any of them."""
    op, av = item
    if op is RC.LITERAL:
        c = chr(av)
        return frozenset({c, c.lower(), c.upper()} if icase else {c})
    if op is RC.NOT_LITERAL:
        return _ALPHABET - _chars((RC.LITERAL, av), icase, first_only)
    if op is RC.ANY:
        return _ALPHABET - {"\n"}
    if op is RC.IN:
        out: set[str] = set()
        for sub_op, sub_av in av:
            if sub_op is RC.RANGE:
                out |= _chars_range(sub_av, icase)
            elif sub_op is RC.CATEGORY:
                out |= {c for c in _ALPHABET if re.match(_CATEGORY_PATTERNS[sub_av], c)}
            elif sub_op is RC.LITERAL:
                out |= _chars((RC.LITERAL, sub_av), icase, first_only)
        return frozenset(_ALPHABET - out) if av and av[0][0] is RC.NEGATE else frozenset(out)
    if op is RC.AT:
        return frozenset()
    return frozenset().union(*(_seq_chars(s, icase, first_only) for s in _children(op, av)))


def _chars_range(bounds, icase: bool) -> set[str]:
    out = {chr(c) for c in range(bounds[0], bounds[1] + 1)}
    return out | {c.swapcase() for c in out} if icase else out


def _children(op, av) -> list:
    """The sub-sequences of a node: a repeat's body, a group's, each branch."""
    if op in _REPEATS:
        return [av[2]]
    if op is RC.SUBPATTERN:
        return [av[3]]
    if op is RC.ATOMIC_GROUP:
        return [av]
    if op is RC.BRANCH:
        return list(av[1])
    return []


def _nullable(item) -> bool:
    op, av = item
    if op is RC.AT:
        return True
    if op in _REPEATS:
        return av[0] == 0 or all(_nullable(x) for x in av[2])
    if op is RC.BRANCH:
        return any(all(_nullable(x) for x in s) for s in av[1])
    if op in (RC.SUBPATTERN, RC.ATOMIC_GROUP):
        return all(_nullable(x) for x in _children(op, av)[0])
    return False


def _seq_chars(seq, icase: bool, first_only: bool) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for item in seq:
        out |= _chars(item, icase, first_only)
        if first_only and not _nullable(item):
            break
    return out


def _unbounded(item) -> bool:
    return item[0] in _REPEATS and item[1][1] == RC.MAXREPEAT


def _walk(seq):
    for item in seq:
        yield item
        for sub in _children(*item):
            yield from _walk(sub)


def _tail(item, icase: bool) -> frozenset[str]:
    """Characters a backtracking unbounded repeat at the end of ``item`` can give back (empty: none)."""
    op, av = item
    if _unbounded(item) and op is not RC.POSSESSIVE_REPEAT:
        return _seq_chars(av[2], icase, first_only=False)
    if op in (RC.SUBPATTERN, RC.BRANCH):
        return frozenset().union(*(_seq_tail(s, icase) for s in _children(op, av)))
    return frozenset()  # an atomic group or a possessive repeat keeps what it took


def _seq_tail(seq, icase: bool) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for item in reversed(list(seq)):
        out |= _tail(item, icase)
        if not _nullable(item):
            break
    return out


def backtracking_hazards(pattern: re.Pattern[str]) -> list[str]:
    """Shapes that make a backtracking regex super-linear, in any sequence of ``pattern``.

    * a backtracking unbounded repeat (or a group or branch ending in one)
      followed, through optional items only, by another unbounded repeat whose
      first character it can also take (``\\s*:?\\s*`` on a run of spaces: quadratic);
    * a backtracking unbounded repeat holding another unbounded repeat (``(\\.\\d+)*``).
    A possessive repeat (``*+``) never gives characters back, so it is no hazard.
    """
    icase = bool(pattern.flags & re.IGNORECASE)
    hazards = []

    def check(seq) -> None:
        items = list(seq)
        for i, item in enumerate(items):
            op, av = item
            if _unbounded(item) and op is not RC.POSSESSIVE_REPEAT and any(_unbounded(x) for x in _walk(av[2])):
                hazards.append(f"nested unbounded repeat at item {i}")
            takes = _tail(item, icase)
            for later in items[i + 1 :] if takes else ():
                if _unbounded(later) and _chars(later, icase, first_only=True) & takes:
                    hazards.append(f"adjacent overlapping repeats at item {i}")
                    break
                if not _nullable(later):
                    break
            for sub in _children(op, av):
                check(sub)

    check(RP.parse(pattern.pattern, pattern.flags))
    return hazards


def test_the_hazard_check_finds_the_quadratic_shapes() -> None:
    assert backtracking_hazards(re.compile(r"id\s*[:=#]?\s*x"))
    assert backtracking_hazards(re.compile(r"\[v\d+(?:\.\d+)*[\w.-]*\]"))
    assert backtracking_hazards(re.compile(r"(?:a|b\d*)\d+"))  # a branch ending in a repeat
    assert not backtracking_hazards(re.compile(r"(?>a|b\d*)\d+"))  # atomic: gives nothing back
    assert not backtracking_hazards(re.compile(r"id\s*+[:=#]?\s*+x"))
    assert not backtracking_hazards(re.compile(r"\d+:\d+"))  # a required ':' between: linear
    assert not backtracking_hazards(re.compile(r"[\w.-]*[A-Za-z0-9]"))  # one unbounded repeat


@pytest.mark.parametrize("detector", A.DETECTORS, ids=lambda d: d.kind)
def test_detector_patterns_have_no_backtracking_hazard(detector) -> None:
    assert backtracking_hazards(detector.pattern) == []


class CountedInt(int):
    """An offset that counts the comparisons made with it."""

    comparisons = 0

    def _count(self, other, op):
        CountedInt.comparisons += 1
        return op(int(self), int(other))

    def __lt__(self, other):
        return self._count(other, int.__lt__)  # noqa: E704

    def __le__(self, other):
        return self._count(other, int.__le__)  # noqa: E704

    def __gt__(self, other):
        return self._count(other, int.__gt__)  # noqa: E704

    def __ge__(self, other):
        return self._count(other, int.__ge__)  # noqa: E704


class _CountedMatch:
    def __init__(self, m: re.Match[str]) -> None:
        self._m = m

    def span(self) -> tuple[int, int]:
        s, e = self._m.span()
        return CountedInt(s), CountedInt(e)

    def group(self, i: int = 0) -> str:
        return self._m.group(i)


class CountedPattern:
    """A detector's real regex, counting its scans and handing out counted offsets."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.scans = 0

    def finditer(self, text: str):
        self.scans += 1
        return (_CountedMatch(m) for m in self.pattern.finditer(text))


def _counted_detectors() -> list[A.Detector]:
    return [A.Detector(d.kind, CountedPattern(d.pattern), d.fix) for d in A.DETECTORS]  # type: ignore[arg-type]


def _timestamps(n: int, sep: str) -> str:
    # Every timestamp also matches the date detector (its overlap is resolved per match).
    return sep.join(f"at 2024-01-{1 + i % 28:02d}T10:{i % 60:02d}:00Z v1.{i}" for i in range(n))


def _span_work(n: int, sep: str) -> tuple[int, int, list[int]]:
    detectors = _counted_detectors()
    text = _timestamps(n, sep)
    CountedInt.comparisons = 0
    spans = A._spans(text, detectors)
    after_spans = CountedInt.comparisons
    A._normalized_lines(text, spans)
    assert len(spans) == 2 * n  # a timestamp and a version each; the dates lost to the timestamps
    return after_spans, CountedInt.comparisons - after_spans, [d.pattern.scans for d in detectors]  # type: ignore[attr-defined]


@pytest.mark.parametrize("sep", [" ", "\n"], ids=["one line", "a line each"])
def test_volatile_spans_take_linear_work(sep) -> None:
    small_spans, small_lines, scans = _span_work(500, sep)
    large_spans, large_lines, _ = _span_work(4_000, sep)
    assert scans == [1] * len(A.DETECTORS)  # one regex scan per detector, whatever the matches
    # Eight times the matches: about eight times the comparisons (a quadratic merge is 64x),
    # the sort of the masking pass adding its log factor.
    assert large_spans <= 9 * small_spans
    assert large_lines <= 11 * small_lines


class CountingTokenizer(CharTokenizer):
    """Counts the calls and the characters it tokenizes."""

    def __init__(self) -> None:
        self.calls = 0
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        self.chars += len(text)
        return super().encode(text)


@pytest.mark.parametrize("sep", [" ", "\n"], ids=["one line", "a line each"])
def test_a_record_is_tokenized_a_bounded_number_of_times(sep) -> None:
    for n in (100, 3_000):
        tokenizer = CountingTokenizer()
        record = A.parse_record(_chat(_timestamps(n, sep)), 1)
        auditor = A.Auditor(tokenizer)
        auditor.add(record)
        rendered = len(A.render(record, tokenizer))
        # The whole prompt once, plus a prefix of it per kind of finding: a bounded number of passes.
        assert tokenizer.calls <= 2 + len(A.DETECTORS)
        assert tokenizer.chars <= (2 + len(A.DETECTORS)) * rendered


SURROGATE_LINES = [
    '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a\\ud800b"}]}',
    '{"messages": [{"role": "system", "content": "hi \\udc00"}, {"role": "user", "content": "q"}]}',
    '{"prompt": "x\\udfff"}',
    '{"messages": [{"role": "user", "content": "q"}], "cache_salt": "\\ud834"}',
    '{"messages": [{"role": "system", "content": "pair \\ud83d\\ude00 is fine"}, {"role": "user", "content": "q"}]}',
]


def test_a_lone_surrogate_skips_its_record_only(tmp_path, tok) -> None:
    path = _write(tmp_path / "sur.jsonl", [*SURROGATE_LINES, _chat(BASE)])
    report = A.audit_file(path, tok)
    assert report.num_records == 2  # the surrogate pair (an emoji) and the plain chat
    reasons = {m.line: m.reason for m in report.malformed}
    assert sorted(reasons) == [1, 2, 3, 4]
    assert "messages[1].content holds a lone surrogate (\\ud800 at character 1)" in reasons[1]
    assert "messages[0].content" in reasons[2] and "'prompt'" in reasons[3] and "'cache_salt'" in reasons[4]


def test_cli_names_each_skipped_line_on_stderr_and_exits_3(tmp_path, tok, capsys) -> None:
    path = _write(tmp_path / "sur.jsonl", [_chat(BASE), *SURROGATE_LINES[:2], "{bad", "[" * 5_000])
    assert cli_main(["audit", path]) == EXIT_SKIPPED == 3
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert [e.split(": ", 2)[1] for e in err] == [f"{path}:{i}" for i in (2, 3, 4, 5)]
    assert all(e.startswith("prefixserve audit: ") and e.endswith("(skipped)") for e in err)
    assert "Traceback" not in captured.err and "Prefix-cache audit" in captured.out
    good = _write(tmp_path / "good.jsonl", [_chat(BASE), _chat(BASE, "again")])
    assert cli_main(["audit", good, "--json"]) == 0
    assert capsys.readouterr().err == ""
